"""Import-only stand-in for sgl-kernel's CPU build (which is not published on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a number of ``sgl_kernel`` names at module load.
On the Llama path with ``--attention-backend torch_native`` none of them is called, so every name
resolves to a function that raises ``NotImplementedError`` only when it is *called*. Names that were
called are recorded in ``CALLED`` so that a test can assert the CPU path never needed a real kernel.

A few kernels that SGLang's CPU path does call have pure-torch reference implementations here
(``REFERENCE``), each naming the SGLang call site it serves; they are correct, not fast.

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


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
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
            req_to_token[int(idx), int(start):int(end)] = out_cache_loc[off:off + n].to(req_to_token.dtype)
        off += max(n, 0)


REFERENCE = {"copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
             "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu}


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
