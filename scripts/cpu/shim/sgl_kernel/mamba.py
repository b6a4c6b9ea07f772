"""Torch reference implementations of the ``sgl_kernel`` linear-attention ops SGLang's CPU path calls
for a gated-delta-net hybrid (Qwen3-Next), in place of sgl-kernel's CPU build (not on PyPI).

CPU test layer only: installed with the import-only stand-in (``scripts/install_sglang_cpu.sh``),
never on a GPU machine, never imported by ``sgl_hicache``. Where SGLang 0.5.23 imports them:

- ``layers/attention/linear/gdn_backend.py:184`` ``causal_conv1d_fn_cpu``, ``causal_conv1d_update_cpu``
  (also ``layers/attention/linear/kda_backend.py:39``), and ``gdn_backend.py:188``
  ``torch.ops.sgl_kernel.fused_gdn_gating_cpu``;
- ``layers/attention/linear/kernels/gdn_triton.py:28`` ``chunk_gated_delta_rule_cpu`` (prefill) and
  ``gdn_triton.py:32`` ``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu`` (decode).

The ops are registered on ``torch.ops.sgl_kernel`` by ``register_ops()`` (the package's import runs it).

Layouts (SGLang's pools, ``configs/mamba_utils.py``: ``Mamba2StateShape``): a conv state is
``[slots, conv_dim, kernel - 1]``; a recurrent state is ``[slots, HV, V, K]`` (value-major). Both are
updated in place at the given slot indices; a negative index is a padding row and is skipped.

The recurrence runs token by token in float32 (no chunking): prefill and decode apply the same
arithmetic to each token, so a state restored from a cache continues exactly as if computed in one
go -- what a cache-hit test needs, and slow only at sizes a test never uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# FLA's chunk length (``kernels/ops/attention/fla/chunk_delta_h.py`` ``CHUNK_SIZE``; SGLang's
# ``mamba_chunk_size`` default, ``hybrid_linear_attn_backend.py:140``): the grid of ``h``
CHUNK = 64


def _conv_window(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """One output column of a depthwise causal conv: ``window`` ``[dim, width]`` (oldest first)."""
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return F.silu(y) if silu else y


def causal_conv1d_fn_cpu(
    x,
    conv_weights,
    bias,
    activation,
    conv_states,
    has_initial_state,
    cache_indices,
    query_start_loc,
    seq_lens_cpu=None,
    **_ignored,
):
    """Prefill conv: ``x`` ``[dim, tokens]`` (sequences packed by ``query_start_loc``); each sequence
    starts from its slot's conv state when ``has_initial_state`` says so, else from zeros; the slot's
    state becomes the sequence's last ``width - 1`` inputs. Returns ``[dim, tokens]`` in x's dtype."""
    dim, width = conv_weights.shape[0], conv_weights.shape[-1]
    w = conv_weights.reshape(dim, width)
    out = torch.empty_like(x)
    silu = activation in ("silu", "swish", True)
    bounds = query_start_loc.tolist()
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        slot = int(cache_indices[i])
        if slot < 0 or hi <= lo:
            continue
        init = has_initial_state is not None and bool(has_initial_state[i])
        state = conv_states[slot].to(x.dtype) if init else x.new_zeros(dim, width - 1)
        xs = torch.cat([state, x[:, lo:hi]], dim=1)  # [dim, width - 1 + n]
        for t in range(hi - lo):
            out[:, lo + t] = _conv_window(xs[:, t : t + width], w, bias, silu).to(x.dtype)
        conv_states[slot] = xs[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(
    x,
    conv_states,
    conv_weights,
    bias,
    activation,
    conv_state_indices=None,
    intermediate_conv_window=None,
    intermediate_state_indices=None,
    **_ignored,
):
    """Decode conv: ``x`` ``[batch, dim]`` (or ``[batch, dim, steps]``), one row per slot of
    ``conv_state_indices``; shifts each new input into the slot's state. Returns x's shape."""
    if intermediate_conv_window is not None:
        raise NotImplementedError("sgl_kernel CPU reference: speculative conv windows are not implemented")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    dim, width = conv_weights.shape[0], conv_weights.shape[-1]
    w = conv_weights.reshape(dim, width)
    silu = activation in ("silu", "swish", True)
    out = torch.empty_like(xs)
    for b in range(xs.shape[0]):
        slot = b if conv_state_indices is None else int(conv_state_indices[b])
        if slot < 0:
            out[b].zero_()
            continue
        state = conv_states[slot].to(x.dtype)
        for t in range(xs.shape[-1]):
            window = torch.cat([state, xs[b, :, t : t + 1]], dim=1)
            out[b, :, t] = _conv_window(window, w, bias, silu).to(x.dtype)
            state = window[:, 1:]
        conv_states[slot] = state.to(conv_states.dtype)
    return out.squeeze(-1) if squeeze else out


def fused_gdn_gating_cpu(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` per token and value head
    (``a``, ``b``: ``[tokens, HV]``); both ``[1, tokens, HV]`` float32, as the Triton kernel gives."""
    # row by row: vectorised exp / softplus round differently with the tensor's length, and a token's
    # gate must not depend on how many tokens came with it (prefill vs decode)
    decay = -A_log.float().exp()
    g = (
        torch.stack(
            [
                decay * F.softplus(a[t].float() + dt_bias.float(), beta=beta, threshold=threshold)
                for t in range(a.shape[0])
            ]
        )
        if a.shape[0]
        else a.new_zeros(a.shape, dtype=torch.float32)
    )
    gate = torch.stack([b[t].float().sigmoid() for t in range(b.shape[0])]) if b.shape[0] else g.clone()
    return g.unsqueeze(0), gate.unsqueeze(0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _delta_rule(q, k, v, g, beta, state, l2norm: bool, scale: float, chunk_starts: list | None = None):
    """The gated delta rule over one sequence, token by token, in float32.
    q, k: ``[n, H, K]``; v: ``[n, HV, V]``; g, beta: ``[n, HV]``; state ``[HV, V, K]`` (float32).
    Returns (``[n, HV, V]`` float32, the final state). With ``chunk_starts`` (a list), the state at the
    start of every ``CHUNK``-token chunk (before token ``c * CHUNK``) is appended to it."""
    hv = v.shape[1]
    rep = hv // q.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32)
    s = state
    for t in range(v.shape[0]):
        if chunk_starts is not None and t % CHUNK == 0:
            chunk_starts.append(s.clone())  # (at t = 0, s may alias the pool row written at the end)
        # every reduction on one token's tensors: the same shapes (so the same rounding) whether the
        # token comes in a long prefill, a short one or a decode step
        q_t = q[t].float().repeat_interleave(rep, dim=0)
        k_t = k[t].float().repeat_interleave(rep, dim=0)
        if l2norm:
            q_t, k_t = _l2norm(q_t), _l2norm(k_t)
        q_t = q_t * scale
        s = s * g[t].float().exp()[:, None, None]
        kv = (s * k_t[:, None, :]).sum(-1)  # [HV, V]
        delta = (v[t].float() - kv) * beta[t].float()[:, None]
        s = s + delta[:, :, None] * k_t[:, None, :]
        out[t] = (s * q_t[:, None, :]).sum(-1)
    return out, s


def chunk_gated_delta_rule_cpu(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    cu_seqlens,
    head_first=False,
    use_qk_l2norm_in_kernel=True,
    initial_state_indices=None,
    scale=None,
    **_ignored,
):
    """Prefill: ``q``, ``k`` ``[1, tokens, H, K]``, ``v`` ``[1, tokens, HV, V]``, ``g``, ``beta``
    ``[1, tokens, HV]``; sequences packed by ``cu_seqlens``, sequence i starting from (and writing
    back) ``initial_state[initial_state_indices[i]]``. Returns (``[1, tokens, HV, V]`` in q's dtype,
    the state pool, the per-chunk states ``h``). ``h`` ``[1, chunks, HV, V, K]`` (float32) is what FLA's
    chunk kernel returns beside the final state: for each sequence in order, the state at the start of
    each of its ``CHUNK``-token chunks. SGLang's extra_buffer strategy reads it for a prefix-cache
    snapshot at a chunk boundary inside the extend (``hybrid_linear_attn_backend.py:1047``
    ``_track_mamba_state_extend``, rows from ``mamba/prefill_track_metadata.py:52``); the CPU build
    returns None there, which is why SGLang refuses extra_buffer on CPU."""
    if head_first:
        raise NotImplementedError("sgl_kernel CPU reference: head_first layouts are not implemented")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros((1, q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype)
    bounds = cu_seqlens.tolist()
    h: list = []
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        slot = i if initial_state_indices is None else int(initial_state_indices[i])
        starts: list = []
        if slot < 0 or hi <= lo:
            h += [torch.zeros(initial_state.shape[1:], dtype=torch.float32)] * (-(-(hi - lo) // CHUNK))
            continue
        o, s = _delta_rule(
            q[0, lo:hi],
            k[0, lo:hi],
            v[0, lo:hi],
            g[0, lo:hi],
            beta[0, lo:hi],
            initial_state[slot].float(),
            use_qk_l2norm_in_kernel,
            scale,
            starts,
        )
        h += starts
        out[0, lo:hi] = o.to(q.dtype)
        initial_state[slot] = s.to(initial_state.dtype)
    chunks = torch.stack(h).unsqueeze(0) if h else None
    return out, initial_state, chunks


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    initial_state_source,
    initial_state_indices,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=True,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale=None,
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer=None,
    **_ignored,
):
    """Decode: the gating (``fused_gdn_gating_cpu``) and one delta-rule step per sequence, ``q``, ``k``
    ``[1, batch, H, K]``, ``v`` ``[1, batch, HV, V]``, ``a``, ``b`` ``[batch, HV]``; the state of slot
    ``initial_state_indices[i]`` is updated in place. Returns ``[1, batch, HV, V]`` in q's dtype."""
    if is_kda or intermediate_states_buffer is not None or disable_state_update:
        raise NotImplementedError("sgl_kernel CPU reference: KDA and speculative verify are not implemented")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    out = torch.zeros((1, v.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype)
    for i in range(v.shape[1]):
        slot = int(initial_state_indices[i])
        if slot < 0:
            continue
        o, s = _delta_rule(
            q[0, i : i + 1],
            k[0, i : i + 1],
            v[0, i : i + 1],
            g[0, i : i + 1],
            beta[0, i : i + 1],
            initial_state_source[slot].float(),
            use_qk_l2norm_in_kernel,
            scale,
        )
        out[0, i] = o[0].to(q.dtype)
        initial_state_source[slot] = s.to(initial_state_source.dtype)
    return out


def fused_rmsnorm_gated_cpu(x, weight, g, eps: float):
    """Gated RMSNorm, norm before gate: ``rmsnorm(x) * weight * silu(g)`` in float32, x's dtype out
    (``kernels/ops/attention/fla/fused_norm_gate.py:447``; ``layernorm_gated.py:rms_norm_ref``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(g.float())).to(x.dtype)


def register_ops() -> None:
    """Put the ops SGLang reads from ``torch.ops.sgl_kernel`` on that namespace (at import time:
    ``gdn_backend.py:188``, ``gdn_triton.py:32``; at call time: ``fused_norm_gate.py:447``)."""
    ns = torch.ops.sgl_kernel
    for fn in (fused_gdn_gating_cpu, fused_sigmoid_gating_delta_rule_update_cpu, fused_rmsnorm_gated_cpu):
        if fn.__name__ not in vars(ns):
            setattr(ns, fn.__name__, fn)


register_ops()
