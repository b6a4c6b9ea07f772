"""CPU-only workarounds that let SGLang 0.5.23 run EAGLE speculative decoding on `torch_native` attention
(not product code; applied by `patches.apply`, only when CUDA is absent).

SGLang's CPU path for EAGLE is the `intel_amx` attention backend, whose kernels come from sgl-kernel's
CPU build (not on PyPI) and which falls back to `torch_native` without AMX
(`srt/arg_groups/overrides.py:1303`). `torch_native` as shipped cannot run EAGLE:
  * `srt/speculative/draft_utils.py:64`: the draft model's extend backend has no `torch_native` entry
    ("EAGLE is not supported in attention backend torch_native"; also the multi-step draft decode
    backend, `draft_utils.py:115`, needed only with `--speculative-num-steps` > 1);
  * `srt/layers/attention/torch_native_backend.py:279` (`forward_extend`): a TARGET_VERIFY batch carries
    no `extend_prefix_lens` / `extend_seq_lens` (`intel_amx_backend.py:70`, `_build_extend_metadata`,
    derives them from `spec_info`, as does this patch).
The patch gives the draft the same `TorchNativeAttnBackend` class the target uses and computes the
speculative extends (TARGET_VERIFY, DRAFT_EXTEND_V2) as a reference: each request's cached prefix K / V
from the pool through `req_to_token`, its new tokens' K / V as passed, causal among the new tokens
(a chain: `--speculative-eagle-topk 1`; a token tree is refused with a clear error). Correct, not fast.

DeepSeek's MTP (`--speculative-algorithm NEXTN`, SGLang's alias of EAGLE with the NextN layer of the
target's checkpoint as the draft, `models/deepseek_nextn.py`) needs one more: `patch_deepseek_mtp`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_applied = False


def spec_extend_attention(
    q, k, v, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, scaling, enable_gqa
):
    """Reference attention of a speculative extend. `q`, `k`, `v`: the batch's new tokens
    `[tokens, heads, dim]`, request by request (`extend_lens[i]` each); request `i` attends over its
    `prefix_lens[i]` cached tokens (rows `req_to_token[req_pool_indices[i], :prefix]` of the pool's
    `k_buffer` / `v_buffer`) and causally over its new tokens. Returns `[tokens, heads, v_dim]`."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    start = 0
    for i, (pre, ext) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        end = start + int(ext)
        rows = req_to_token[int(req_pool_indices[i]), : int(pre)].to(torch.int64)
        keys = torch.cat([k_buffer[rows].to(q.dtype), k[start:end].to(q.dtype)], 0)
        vals = torch.cat([v_buffer[rows].to(q.dtype), v[start:end].to(q.dtype)], 0)
        n, total = end - start, int(pre) + end - start
        qpos = torch.arange(int(pre), total).unsqueeze(1)
        mask = torch.arange(total).unsqueeze(0) <= qpos  # the prefix, and the new tokens up to each one
        o = scaled_dot_product_attention(
            q[start:end].movedim(0, 1).unsqueeze(0),
            keys.movedim(0, 1).unsqueeze(0),
            vals.movedim(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=enable_gqa,
        )
        out[start:end] = o.squeeze(0).movedim(0, 1)[:n]
        start = end
    return out


def patch_deepseek_mtp() -> None:
    """`srt/models/deepseek_v2.py:3447` (`DeepseekV2ForCausalLM.set_embed_and_head`, which the NextN
    draft inherits and the EAGLE worker calls to share the target's embedding and LM head,
    `speculative/eagle_worker_v2.py:378`) ends with `torch.cuda.empty_cache()` and
    `torch.cuda.synchronize()`: "Torch not compiled with CUDA enabled" on CPU torch. The same
    assignment without them."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    def set_embed_and_head(self, embed, head):
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head

    DeepseekV2ForCausalLM.set_embed_and_head = set_embed_and_head


def apply() -> bool:
    """Patch `TorchNativeAttnBackend` and the draft backend factory (see the module docstring).
    Idempotent; returns True if the patches are in place."""
    global _applied
    if _applied:
        return True
    try:
        import torch
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
        from sglang.srt.speculative.draft_utils import DraftBackendFactory
    except ImportError as e:
        logger.warning("sglang_cpu_layer: SGLang classes not found (%s); not patched", e)
        return False

    original_extend = TorchNativeAttnBackend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        mode = forward_batch.forward_mode
        if not (mode.is_target_verify() or mode.is_draft_extend_v2()):
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if layer.is_cross_attention or k is None or v is None:
            raise NotImplementedError("sglang_cpu_layer: speculative extend without new K/V")
        if mode.is_target_verify():
            spec = forward_batch.spec_info
            if getattr(spec, "tree_topk", 1) not in (1, None):
                raise NotImplementedError(
                    "sglang_cpu_layer: a draft token tree (topk > 1) on "
                    "torch_native; run --speculative-eagle-topk 1 on CPU"
                )
            prefix = forward_batch.seq_lens
            extend = torch.full_like(prefix, int(spec.draft_token_num))
        else:
            prefix, extend = forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        o = spec_extend_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
            v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            prefix,
            extend,
            layer.scaling,
            layer.tp_q_head_num != layer.tp_k_head_num,
        )
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    TorchNativeAttnBackend.forward_extend = forward_extend

    def torch_native_draft_extend(self):
        backend = TorchNativeAttnBackend(self.draft_model_runner)
        return "torch_native", backend

    original_create = DraftBackendFactory._create_backend

    def create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        # `draft_utils.py:64`: torch_native has no entry; the draft's extend gets the target's class
        if "torch_native" not in backend_map and backend_name != "decode_attention_backend":
            backend_map = {**backend_map, "torch_native": lambda: torch_native_draft_extend(self)}
        return original_create(self, backend_name, backend_map, error_template, stamps_children)

    DraftBackendFactory._create_backend = create_backend
    patch_deepseek_mtp()
    _applied = True
    logger.info("sglang_cpu_layer: EAGLE on torch_native patched for CPU")
    return True


__all__ = ["apply", "spec_extend_attention"]
