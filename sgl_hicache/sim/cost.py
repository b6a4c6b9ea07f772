"""The embedded engine's cost model: seconds of virtual time for prefill, decode and transfers.

Notation: P_a = `model.active_params`, P_t = `model.total_params`, L = layers, H = query heads,
d = head_dim, b = bytes per element, G = `hw.num_gpus`, R = ``hw.peak_flops * hw.mfu * G``
(the node's sustained FLOP/s), W = ``hw.hbm_bandwidth * G`` (the node's sustained HBM bytes/s).

Prefill of n new tokens after c cached ones (one sequence)::

    flops   = 2 * P_a * n                                 # every weight: one multiply-add per token
            + 4 * L * H * d * (n * c + n * n / 2)         # attention: QK^T and PV (2 matmuls x 2 FLOPs),
                                                          # each new token against c cached tokens and,
                                                          # causally, half of the n new ones
    seconds = max(flops / R, weight_bytes / W)            # the weights are read at least once

``weight_bytes = P_t * b`` for a dense model; for a MoE only the experts touched are read, at most
``min(P_t, P_a * tokens) * b`` (each token touches at most its own P_a).

One decode step of a batch of B sequences whose contexts total T tokens (T counts every token each
sequence attends to, its own new token included)::

    flops   = 2 * P_a * B + 4 * L * H * d * T
    bytes   = weight_bytes(B tokens) + T * kv_bytes_per_token
    seconds = max(flops / R, bytes / W)

Transfers: ``seconds = latency + nbytes / bandwidth``; link bandwidths come from
`HardwarePreset.link_bandwidth` (device<->host: the PCIe links of all GPUs; host<->disk: the disk).

What the model leaves out, on purpose: kernel launch and scheduling overheads, tensor-parallel
communication, MFU falling off for short sequences (a floor is the weight read), and overlap between
compute and transfer (the engine decides what overlaps). Calibration against published figures:
docs/calibration.md (``benchmarks/engine/calibration.py``).
"""

from __future__ import annotations

from .presets import HardwarePreset, ModelPreset


def _check_nonneg(**values: float) -> None:
    for name, v in values.items():
        if (type(v) is int or type(v) is float) and v >= 0:
            continue  # the common case, decided without isinstance calls (it runs every step)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name} must be a non-negative number, got {v!r}")


def attention_flops(model: ModelPreset, new_tokens: float, cached_tokens: float) -> float:
    """``4 * L * H * d * (n * c + n^2 / 2)``: the score and value matmuls of n new tokens."""
    n, c = float(new_tokens), float(cached_tokens)
    return 4.0 * model.num_layers * model.num_attention_heads * model.head_dim * (n * c + n * n / 2.0)


def prefill_flops(model: ModelPreset, new_tokens: float, cached_tokens: float = 0) -> float:
    """``2 * P_a * n + attention_flops(n, c)``."""
    _check_nonneg(new_tokens=new_tokens, cached_tokens=cached_tokens)
    return 2.0 * model.active_params * new_tokens + attention_flops(model, new_tokens, cached_tokens)


def weight_read_bytes(model: ModelPreset, tokens: float) -> float:
    """Weight bytes one forward pass over `tokens` tokens reads: all of them for a dense model, at
    most ``P_a`` per token for a MoE."""
    if tokens <= 0:
        return 0.0
    return min(model.total_params, model.active_params * tokens) * model.dtype_bytes


def prefill_seconds(model: ModelPreset, hw: HardwarePreset, new_tokens: float, cached_tokens: float = 0) -> float:
    """Virtual seconds to prefill `new_tokens` after `cached_tokens` already in the KV cache.

    ``max(prefill_flops / (peak * mfu * G), weight_read_bytes(n) / (hbm * G))``; 0 for no new tokens.
    """
    if new_tokens == 0:
        _check_nonneg(cached_tokens=cached_tokens)
        return 0.0
    compute = prefill_flops(model, new_tokens, cached_tokens) / hw.sustained_flops
    memory = weight_read_bytes(model, new_tokens) / (hw.hbm_bandwidth * hw.num_gpus)
    return max(compute, memory)


def batch_prefill_seconds(model: ModelPreset, hw: HardwarePreset, chunks: list[tuple[float, float]]) -> float:
    """One forward pass prefilling several sequences, ``chunks = [(new_tokens, cached_tokens), ...]``
    (chunked prefill / continuous batching): FLOPs add up, the weights are read once."""
    if not chunks:
        return 0.0
    flops = sum(prefill_flops(model, n, c) for n, c in chunks)
    tokens = sum(n for n, _ in chunks)
    if tokens == 0:
        return 0.0
    return max(flops / hw.sustained_flops, weight_read_bytes(model, tokens) / (hw.hbm_bandwidth * hw.num_gpus))


def decode_flops(model: ModelPreset, batch_context_tokens: float, batch_size: int) -> float:
    """``2 * P_a * B + 4 * L * H * d * T``."""
    _check_nonneg(batch_context_tokens=batch_context_tokens, batch_size=batch_size)
    return (
        2.0 * model.active_params * batch_size
        + 4.0 * model.num_layers * model.num_attention_heads * model.head_dim * batch_context_tokens
    )


def decode_bytes(model: ModelPreset, batch_context_tokens: float, batch_size: int) -> float:
    """``weight_read_bytes(B) + T * kv_bytes_per_token``."""
    _check_nonneg(batch_context_tokens=batch_context_tokens, batch_size=batch_size)
    return weight_read_bytes(model, batch_size) + batch_context_tokens * model.kv_bytes_per_token


def decode_step_seconds(model: ModelPreset, hw: HardwarePreset, batch_context_tokens: float, batch_size: int) -> float:
    """Virtual seconds of one decode step (one new token for each of `batch_size` sequences whose
    contexts total `batch_context_tokens`): ``max(compute, memory)``; 0 for an empty batch."""
    if batch_size == 0:
        return 0.0
    compute = decode_flops(model, batch_context_tokens, batch_size) / hw.sustained_flops
    memory = decode_bytes(model, batch_context_tokens, batch_size) / (hw.hbm_bandwidth * hw.num_gpus)
    return max(compute, memory)


def transfer_seconds(nbytes: float, link_bandwidth: float, latency_s: float = 0.0) -> float:
    """``latency_s + nbytes / link_bandwidth``; 0 for nothing to move."""
    _check_nonneg(nbytes=nbytes, latency_s=latency_s)
    if not (isinstance(link_bandwidth, (int, float)) and link_bandwidth > 0):
        raise ValueError(f"link_bandwidth must be > 0 bytes/s, got {link_bandwidth!r}")
    if nbytes == 0:
        return 0.0
    return latency_s + nbytes / link_bandwidth


def kv_transfer_seconds(model: ModelPreset, hw: HardwarePreset, tokens: float, src: str, dst: str) -> float:
    """Seconds to move the KV of `tokens` tokens over one tier link of `hw` (e.g. "disk" -> "host")."""
    _check_nonneg(tokens=tokens)
    return transfer_seconds(tokens * model.kv_bytes_per_token, hw.link_bandwidth(src, dst))


__all__ = [
    "attention_flops",
    "batch_prefill_seconds",
    "decode_bytes",
    "decode_flops",
    "decode_step_seconds",
    "kv_transfer_seconds",
    "prefill_flops",
    "prefill_seconds",
    "transfer_seconds",
    "weight_read_bytes",
]
