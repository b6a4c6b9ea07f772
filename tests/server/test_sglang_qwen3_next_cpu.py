"""A hybrid linear-attention model on the real SGLang 0.5.23 CPU server, with SGLang's default cache:
the tiny Qwen3-Next (`scripts/cpu/tiny-qwen3-next`: one gated-delta-net layer, one gated attention
layer, a 4-expert MoE; random weights of realistic scale, scripts/cpu/realistic_weights_qwen3_next.py).

It runs here only with the CPU test layer: torch references of the `sgl_kernel` linear-attention ops
(scripts/cpu/shim/sgl_kernel/mamba.py) and `sglang_cpu_layer.patches.hybrid_linear_attention_without_amx` (SGLang's
CPU path assumes AMX), here with `--mamba-radix-cache-strategy no_buffer --page-size 1
--disable-overlap-schedule` (SGLang's default flags resolve to extra_buffer, which on CPU needs the
CPU test layer's `mamba_extra_buffer` patches: tests/server/test_sglang_mamba_extra_buffer.py).

What it proves: a second turn that SGLang's own Mamba radix cache serves from the first turn's state
snapshot (prompt + reply, `cached_tokens` > 0) gives the outputs and logprobs of the same prompt from
scratch (after /flush_cache) bit for bit; a token changed early in the prompt moves them, so the
equality is not vacuous. This is the reference the tiered backend meets from every tier
(tests/server/test_sglang_mamba.py).
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "cpu"))
from realistic_weights_qwen3_next import make_model  # noqa: E402  (from scripts/cpu, put on sys.path above)

VOCAB = 1024
MAMBA_ARGS = ["--mamba-radix-cache-strategy", "no_buffer", "--page-size", "1", "--disable-overlap-schedule"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sgl_hicache.client.server import SGLangServer, has_cuda

    if has_cuda():
        pytest.skip("proves the CPU test layer's kernels; on a GPU SGLang runs its own")
    work = tmp_path_factory.mktemp("qwen3_next")
    model = make_model(work / "model")
    srv = SGLangServer.start(
        model,
        load_format=None,
        log_path=work / "server.log",
        timeout_s=600,
        extra_args=["--max-total-tokens", "2048", "--log-level", "warning", *MAMBA_ARGS],
    )
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)


def _flush(srv) -> None:
    """SGLang's /flush_cache: the next request computes from scratch."""
    from servers import flush_cache

    flush_cache(srv)


def _gen(srv, ids, n=6):
    r = srv.post(
        "/generate",
        {
            "input_ids": list(ids),
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        },
    )
    meta = r["meta_info"]
    return r["output_ids"], int(meta.get("cached_tokens") or 0), [lp[0] for lp in meta["output_token_logprobs"]]


def test_a_mamba_cache_hit_equals_scratch_bit_for_bit(server):
    rng = random.Random(1)
    first = [rng.randrange(16, VOCAB) for _ in range(40)]
    reply, cached, _ = _gen(server, first)
    assert cached == 0
    second = first + reply + [rng.randrange(16, VOCAB) for _ in range(10)]
    out_hit, cached_hit, lp_hit = _gen(server, second)
    # no_buffer: the only state snapshot is the first turn's at its end (prompt + reply but the last token)
    assert cached_hit == len(first) + len(reply) - 1, cached_hit
    _flush(server)
    out_scratch, cached_scratch, lp_scratch = _gen(server, second)
    assert cached_scratch == 0
    assert out_hit == out_scratch and lp_hit == lp_scratch, (out_hit, out_scratch, lp_hit, lp_scratch)
    # not vacuous: an early token changed moves the logprobs
    changed = list(second)
    changed[5] = (changed[5] - 16 + 1) % (VOCAB - 16) + 16
    _flush(server)
    lp_changed = _gen(server, changed)[2]
    moved = max(abs(a - b) for a, b in zip(lp_changed, lp_scratch))
    print(f"\nQwen3-Next: logprob |diff| hit vs scratch 0.0; with one early token changed {moved:.4f}")
    assert moved > 1e-3, moved
