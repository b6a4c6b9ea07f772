"""CPU test layer: a reference attention for SGLang's ``torch_native`` backend with attention sinks
and hybrid sliding-window pools (not product code; applied by `patches.apply` only without CUDA).

SGLang 0.5.23's ``TorchNativeAttnBackend`` (``layers/attention/torch_native_backend.py``) cannot run
a hybrid sliding-window model with sinks (gpt-oss, Granite SWA) for two reasons:
  * ``forward_extend`` / ``forward_decode`` (lines 279 and 338) take no ``sinks`` argument, which
    ``RadixAttention`` passes on (``base_attn_backend.py:355``: "unexpected keyword argument 'sinks'");
  * with an ``SWAKVPool`` they write a window layer's K / V at the translated window slots
    (``swa_out_cache_loc``, line 52) but read them back at the full pool's slots
    (``k_cache[per_req_tokens]``, lines 137 and 238), which are other rows of the window buffer.

`ReferenceAttention.forward_extend` / `forward_decode` replace both methods for the layers that need
it (sinks given, or a window layer of an ``SWAKVPool``) and call SGLang's own for every other layer.
They compute softmax attention in float32, one request at a time: causal, the window of
``layer.sliding_window_size`` (SGLang's exclusive bound: key ``j`` is seen by query ``i`` when
``i - window <= j <= i``), and, when ``sinks`` is given, one extra logit per head in the softmax's
denominator whose value is dropped (gpt-oss's attention sinks). Slow and exact; sized for tiny
configs.
"""

from __future__ import annotations

from typing import Any

import torch


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_offset: int,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of queries `q` `[Tq, Hq, D]` at positions `q_offset..` over keys / values `k`, `v`
    `[Tk, Hk, D]` at positions `0..Tk-1` (GQA: `Hq` a multiple of `Hk`); `window` < 0: no window.
    Returns `[Tq, Hq, Dv]` in `q`'s dtype."""
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk:
        raise ValueError(f"reference attention: {hq} query heads are not a multiple of {hk} KV heads")
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    q_pos = torch.arange(q_offset, q_offset + q.shape[0], device=q.device).unsqueeze(1)
    k_pos = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    seen = k_pos <= q_pos
    if window is not None and window > -1:
        seen &= k_pos >= q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hq, 1, 1).expand(hq, q.shape[0], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def _window_layer(pool: Any, layer_id: int) -> bool:
    mapping = getattr(pool, "layers_mapping", None)
    return mapping is not None and hasattr(pool, "swa_kv_pool") and bool(mapping[layer_id][1])


def _needs_reference(backend: Any, layer: Any, sinks: Any) -> bool:
    if getattr(layer, "is_cross_attention", False):
        return False
    return sinks is not None or _window_layer(backend.token_to_kv_pool, layer.layer_id)


def _store(backend: Any, layer: Any, forward_batch: Any, k: Any, v: Any, save_kv_cache: bool) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
        )


def _kv(backend: Any, layer: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pool = backend.token_to_kv_pool
    if _window_layer(pool, layer.layer_id):
        slots = pool.translate_loc_from_full_to_swa(slots)
    return pool.get_key_buffer(layer.layer_id)[slots], pool.get_value_buffer(layer.layer_id)[slots]


def _run(backend: Any, q: torch.Tensor, layer: Any, forward_batch: Any, sinks: Any, decode: bool) -> torch.Tensor:
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    window = layer.sliding_window_size if layer.sliding_window_size is not None else -1
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens.tolist()
    if decode:
        q_lens = [1] * len(seq_lens)
    else:
        q_lens = forward_batch.extend_seq_lens.tolist()
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        slots = req_to_token[forward_batch.req_pool_indices[i], :seq_len].to(torch.int64)
        k, v = _kv(backend, layer, slots)
        out[start : start + q_len] = attend(
            q[start : start + q_len], k, v, scale=layer.scaling, q_offset=seq_len - q_len, window=window, sinks=sinks
        )
        start += q_len
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def install(backend_cls: Any) -> None:
    """Wrap `backend_cls.forward_extend` / `forward_decode` (SGLang's ``TorchNativeAttnBackend``)."""
    if getattr(backend_cls, "_sgl_hicache_reference_attention", False):
        return
    original_extend, original_decode = backend_cls.forward_extend, backend_cls.forward_decode

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if not _needs_reference(self, layer, sinks):
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        _store(self, layer, forward_batch, k, v, save_kv_cache)
        return _run(self, q, layer, forward_batch, sinks, decode=False)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if not _needs_reference(self, layer, sinks):
            return original_decode(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        _store(self, layer, forward_batch, k, v, save_kv_cache)
        return _run(self, q, layer, forward_batch, sinks, decode=True)

    backend_cls.forward_extend = forward_extend
    backend_cls.forward_decode = forward_decode
    backend_cls._sgl_hicache_reference_attention = True


__all__ = ["attend", "install"]
