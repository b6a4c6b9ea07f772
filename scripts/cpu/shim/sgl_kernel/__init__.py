"""Import-only stand-in for sgl-kernel's CPU build (which is not published on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a number of ``sgl_kernel`` names at module load.
On the Llama path with ``--attention-backend torch_native`` none of them is called, so every name
resolves to a function that raises ``NotImplementedError`` only when it is *called*. Names that were
called are recorded in ``CALLED`` so that a test can assert the CPU path never needed a real kernel.

The linear-attention ops a gated-delta-net hybrid (Qwen3-Next) calls are not stand-ins but torch
reference implementations, in ``sgl_kernel.mamba`` (imported below, so that the ones SGLang reads from
``torch.ops.sgl_kernel`` are registered as soon as ``sgl_kernel`` is).

The kernels that SGLang's CPU path calls for EAGLE speculative decoding (``--speculative-eagle-topk 1``)
have pure-torch reference implementations here (``REFERENCE``): ports of SGLang's own Triton kernels,
each naming the SGLang call site it serves; correct, not fast. They are recorded in ``CALLED`` too.

This is a CPU workaround installed by ``scripts/install_sglang_cpu.sh`` (via a .pth file); it is not
part of the ``sgl_hicache`` product and is never installed on a GPU machine.
"""

import ctypes

CALLED: list = []


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """Reference of sgl-kernel's CPU ``copy_all_layer_kv_cache_cpu``: for every buffer ``i`` (a raw
    pointer ``data_ptrs[i]`` whose token rows are ``strides[i]`` bytes apart), copy row ``src_loc[j]``
    to row ``tgt_loc[j]`` for every ``j`` (all rows are read before any is written).

    Called by ``sglang/kernels/ops/kvcache/cache_move.py:191`` (``copy_all_layer_kv_cache_func``) from
    ``MHATokenToKVPool._init_kv_copy_and_warmup`` (``srt/mem_cache/memory_pool.py:2420``, a warm-up
    with ``src == tgt == 0``) and ``_move_kv_cache_impl`` (``memory_pool.py:3468``): speculative decoding
    moves the accepted draft tokens' KV rows within the pool."""
    import torch

    CALLED.append("copy_all_layer_kv_cache_cpu")
    tgt = tgt_loc.to(torch.int64).cpu()
    src = src_loc.to(torch.int64).cpu()
    if tgt.numel() == 0:
        return
    rows = int(max(int(tgt.max()), int(src.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt] = buf[src]  # advanced indexing reads every source row first


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Reference of sgl-kernel's CPU ``assign_req_to_token_pool_cpu`` (the Triton kernel
    ``assign_req_to_token_pool``, ``srt/mem_cache/allocation.py:691``): request ``i`` gets
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` from the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the requests' runs back to back).

    Called by ``srt/mem_cache/allocation.py:746`` (``assign_req_to_token_pool_func``): speculative
    decoding's per-step slot allocation (``alloc_for_spec_decode``)."""
    CALLED.append("assign_req_to_token_pool_cpu")
    off = 0
    for idx, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(end) - int(start)
        if n > 0:
            req_to_token[int(idx), int(start) : int(end)] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += max(n, 0)


# ---- EAGLE speculative decoding (``--speculative-eagle-topk 1``): faithful ports of SGLang's Triton kernels
def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
) -> None:
    """Reference of ``assign_draft_cache_locs_contiguous`` (``sglang/kernels/ops/speculative/cache_locs.py:43``;
    CPU call site ``cache_locs.py:99``): request ``i``'s ``topk * num_cols`` slots of ``req_to_token`` from
    ``seq_lens[i]`` on, into ``out_cache_loc`` at ``i * topk * num_cols``."""
    CALLED.append("assign_draft_cache_locs_contiguous_cpu")
    n = int(topk) * int(num_cols)
    for i, (idx, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[int(idx), int(start) : int(start) + n].to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Reference of ``assign_extend_cache_locs`` (``cache_locs.py:500``; CPU call sites ``cache_locs.py:740,
    763``): request ``i``'s ``req_to_token`` entries ``start_offset[i]:end_offset[i]``, back to back into
    ``out_cache_loc``."""
    CALLED.append("assign_extend_cache_locs_cpu")
    off = 0
    for idx, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = max(int(end) - int(start), 0)
        out_cache_loc[off : off + n] = req_to_token[int(idx), int(start) : int(end)].to(out_cache_loc.dtype)
        off += n


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """Reference of ``fill_bonus_tokens`` (``sglang/kernels/ops/speculative/eagle.py:14``; CPU call site
    ``eagle.py:40``): request ``i``'s last accepted token."""
    CALLED.append("fill_bonus_tokens_cpu")
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[int(accept_stride) * i + int(n) - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Reference of ``fill_accept_out_cache_loc`` (``eagle.py:55``; CPU call site ``eagle.py:80``): the
    slots of the accepted entries (``accept_index`` != -1), packed in order."""
    CALLED.append("fill_accept_out_cache_loc_cpu")
    dst = 0
    for src in accept_index.reshape(-1).tolist():
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[int(src)]
            dst += 1


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """Reference of the EAGLE tree build: a line-for-line port of SGLang's Triton
    ``sgl_build_tree_kernel_efficient_triton`` (``sglang/kernels/ops/speculative/spec_tree.py:48``; CPU call
    site ``spec_tree.py:412``); modes FULL_MASK (0) and QLEN_ONLY (1)."""
    CALLED.append("build_tree_kernel_efficient_cpu")
    if int(tree_mask_mode) not in (0, 1):
        raise NotImplementedError(f"build_tree_kernel_efficient_cpu: tree mask mode {tree_mask_mode}")
    n, topk = int(draft_token_num), int(topk)
    seq = verified_seq_len.tolist()
    prefix_sum = [sum(seq[:b]) for b in range(len(seq))]
    parents, sel = parent_list.reshape(len(seq), -1).tolist(), selected_index.reshape(len(seq), -1).tolist()
    mask = tree_mask.reshape(-1)
    pos, r_idx = positions.reshape(-1), retrieve_index.reshape(-1)
    r_next, r_sib = retrieve_next_token.reshape(-1), retrieve_next_sibling.reshape(-1)

    def parent_position(b, i):  # (found, position) of node i's parent among the selected tokens
        ptb = sel[b][i] // topk
        if ptb == 0:
            return True, -1
        tok = parents[b][ptb]
        for pp in range(n - 1):
            if sel[b][pp] == tok:
                return True, pp
        return False, 0

    for b, seq_len in enumerate(seq):
        seq_tree_idx = n * n * b + prefix_sum[b] * n
        pos[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            r_idx[b * n + i] = b * n + i
            found, pp = parent_position(b, i - 1)
            if found:
                addr = b * n + pp + 1
                nxt = int(r_next[addr])
                r_next[addr] = i
                if nxt != -1:
                    r_sib[b * n + i] = nxt
        r_idx[b * n] = b * n
        for x in range(n):
            t = (
                (seq_tree_idx + (seq_len + n) * x + seq_len + 1)
                if int(tree_mask_mode) == 0
                else (n * n * b + n * x + 1)
            )
            mask[t - 1] = 1
            mask[t : t + n - 1] = 0
            if x > 0:
                cur, position = x - 1, 0
                for _ in range(int(depth)):
                    position += 1
                    mask[t + cur] = 1
                    found, pp = parent_position(b, cur)
                    if not found or pp < 0:
                        break
                    cur = pp
                pos[b * n + x] = position + seq_len


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Reference of greedy tree verification: a port of SGLang's Triton ``verify_tree_greedy_kernel_triton``
    (``spec_tree.py:180``; CPU call site ``spec_tree.py:510``)."""
    CALLED.append("verify_tree_greedy_cpu")
    bs, n = candidates.shape[0], candidates.shape[1]
    steps = accept_index.shape[1]
    cand, ridx = candidates.reshape(-1).tolist(), retrive_index.reshape(-1).tolist()
    rnext, rsib = retrive_next_token.reshape(-1).tolist(), retrive_next_sibling.reshape(-1).tolist()
    target = target_predict.reshape(-1)
    pred, acc = predicts.reshape(-1), accept_index.reshape(-1)
    for b in range(bs):
        last = ridx[b * n]
        acc[b * steps] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = rnext[b * n + cur]
            tok = int(target[last])
            matched = False
            while cur != -1:
                if cand[b * n + cur] == tok:
                    pred[last] = tok
                    accepted += 1
                    acc[b * steps + accepted] = ridx[b * n + cur]
                    last = ridx[b * n + cur]
                    matched = True
                    break
                cur = rsib[b * n + cur]
            if not matched:
                break
        accept_token_num[b] = accepted
        pred[last] = target[last]


REFERENCE = {
    f.__name__: f
    for f in (
        copy_all_layer_kv_cache_cpu,
        assign_req_to_token_pool_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        assign_extend_cache_locs_cpu,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
    )
}


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        CALLED.append(name)
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but only an import-only CPU stand-in is installed "
            "(scripts/cpu/shim/sgl_kernel); use --attention-backend torch_native on CPU"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)


from . import mamba  # noqa: F401, E402  (registers its ops on torch.ops.sgl_kernel, after the stand-ins above)
