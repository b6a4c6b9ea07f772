"""The CPU test layer's torch references of SGLang's linear-attention kernels
(scripts/cpu/shim/sgl_kernel/mamba.py), which make a tiny Qwen3-Next run on SGLang's CPU path.

What a prefix cache of a recurrent model relies on, checked here without SGLang: a state taken at a
split point and continued gives bit for bit what one pass over the whole sequence gives (prefill in
two parts, prefill then decode steps), for the causal conv and the gated delta rule; the conv agrees
with torch's own depthwise conv1d and the delta rule with its closed form for one step.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SHIM = Path(__file__).resolve().parents[2] / "scripts" / "cpu" / "shim" / "sgl_kernel" / "mamba.py"


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("sgl_hicache_test_shim_mamba", SHIM)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


DIM, WIDTH, SLOTS = 12, 4, 3
H, HV, K, V = 2, 4, 8, 8


def _conv_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(DIM, n, generator=g).to(torch.bfloat16)
    w = torch.randn(DIM, WIDTH, generator=g).to(torch.bfloat16)
    b = torch.randn(DIM, generator=g).to(torch.bfloat16)
    return x, w, b


def _prefill_conv(ops, x, w, b, states, slot, has_init):
    return ops.causal_conv1d_fn_cpu(
        x, w, b, "silu", states, torch.tensor([has_init]), torch.tensor([slot]), torch.tensor([0, x.shape[1]])
    )


def test_causal_conv_matches_torch_depthwise_conv1d(ops):
    x, w, b = _conv_inputs(10)
    states = torch.zeros(SLOTS, DIM, WIDTH - 1, dtype=torch.bfloat16)
    out = _prefill_conv(ops, x, w, b, states, 1, False)
    ref = F.silu(F.conv1d(F.pad(x.float()[None], (WIDTH - 1, 0)), w.float()[:, None, :], b.float(), groups=DIM))[0]
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(states[1], x[:, -(WIDTH - 1) :]), "the slot's state is the last width-1 inputs"
    assert states[0].abs().sum() == 0 and states[2].abs().sum() == 0, "other slots untouched"


def test_causal_conv_split_prefill_and_decode_equal_one_pass_bit_for_bit(ops):
    x, w, b = _conv_inputs(10, seed=1)
    one = torch.zeros(SLOTS, DIM, WIDTH - 1, dtype=torch.bfloat16)
    whole = _prefill_conv(ops, x, w, b, one, 0, False)
    two = torch.zeros_like(one)
    head = _prefill_conv(ops, x[:, :6], w, b, two, 2, False)
    tail = _prefill_conv(ops, x[:, 6:8], w, b, two, 2, True)
    steps = [ops.causal_conv1d_update_cpu(x[:, t][None], two, w, b, "silu", torch.tensor([2]))[0] for t in (8, 9)]
    assert torch.equal(torch.cat([head, tail, torch.stack(steps, 1)], 1), whole)
    assert torch.equal(two[2], one[0])


def _gdn_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, H, K, generator=g).to(torch.bfloat16)
    k = torch.randn(1, n, H, K, generator=g).to(torch.bfloat16)
    v = torch.randn(1, n, HV, V, generator=g).to(torch.bfloat16)
    a = torch.randn(n, HV, generator=g).to(torch.bfloat16)
    b = torch.randn(n, HV, generator=g).to(torch.bfloat16)
    A_log = torch.randn(HV, generator=g)
    dt_bias = torch.randn(HV, generator=g)
    return q, k, v, a, b, A_log, dt_bias


def _prefill_gdn(ops, q, k, v, a, b, A_log, dt_bias, states, slot, lo, hi):
    g, beta = ops.fused_gdn_gating_cpu(A_log, a[lo:hi], b[lo:hi], dt_bias)
    start = states[slot].float().clone()
    out, pool, h = ops.chunk_gated_delta_rule_cpu(
        q[:, lo:hi],
        k[:, lo:hi],
        v[:, lo:hi],
        g,
        beta,
        states,
        torch.tensor([0, hi - lo]),
        False,
        True,
        torch.tensor([slot]),
    )
    # h: the state at the start of each 64-token chunk (what extra_buffer's prefill tracking reads)
    assert pool is states and h.shape[:2] == (1, -(-(hi - lo) // ops.CHUNK)) and torch.equal(h[0, 0], start)
    return out


def test_gated_delta_rule_split_prefill_and_decode_equal_one_pass_bit_for_bit(ops):
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(9)
    one = torch.zeros(SLOTS, HV, V, K)
    whole = _prefill_gdn(ops, q, k, v, a, b, A_log, dt_bias, one, 0, 0, 9)
    two = torch.zeros_like(one)
    parts = [
        _prefill_gdn(ops, q, k, v, a, b, A_log, dt_bias, two, 1, 0, 5),
        _prefill_gdn(ops, q, k, v, a, b, A_log, dt_bias, two, 1, 5, 7),
    ]
    for t in (7, 8):
        parts.append(
            ops.fused_sigmoid_gating_delta_rule_update_cpu(
                A_log=A_log,
                dt_bias=dt_bias,
                q=q[:, t : t + 1],
                k=k[:, t : t + 1],
                v=v[:, t : t + 1],
                a=a[t : t + 1],
                b=b[t : t + 1],
                initial_state_source=two,
                initial_state_indices=torch.tensor([1]),
                cu_seqlens=torch.tensor([0, 1]),
                use_qk_l2norm_in_kernel=True,
            )
        )
    assert torch.equal(torch.cat(parts, 1), whole)
    assert torch.equal(two[1], one[0]) and two[0].abs().sum() == 0


def test_gated_delta_rule_first_step_closed_form(ops):
    """From a zero state one step gives S = beta v k^T (k, q l2-normed, q scaled by K^-1/2), o = S q."""
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(1, seed=3)
    states = torch.zeros(1, HV, V, K)
    out = _prefill_gdn(ops, q, k, v, a, b, A_log, dt_bias, states, 0, 0, 1)
    beta = b.float().sigmoid()[0]
    kk = F.normalize(k.float()[0, 0], dim=-1, eps=1e-3).repeat_interleave(HV // H, 0)
    qq = F.normalize(q.float()[0, 0], dim=-1, eps=1e-3).repeat_interleave(HV // H, 0) * K**-0.5
    S = beta[:, None, None] * v.float()[0, 0][:, :, None] * kk[:, None, :]
    torch.testing.assert_close(states[0], S, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        out.float()[0, 0], (S * qq[:, None, :]).sum(-1).to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2
    )
