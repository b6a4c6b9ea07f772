"""End to end with an MLA pool: the real SGLang 0.5.23 CPU server, a tiny DeepSeek-V2 config
(`scripts/cpu/tiny-deepseek`: 2 layers, kv_lora_rank 32 + rope 16, all layers dense), random weights
of realistic scale, `--radix-cache-backend sgl_hicache` at TP = 1. SGLang builds an
`MLATokenToKVPool`; the backend tiers its latent + rope rows through the MLA adapter.

Greedy outputs and logprobs of a prompt served from host and disk hits, and from disk after a
restart, equal those of the same prompt served from a device hit (SGLang's own prefix reuse, no tier
movement); a token changed in the last cached page moves the logprobs (so the check is not vacuous).

Caveat, measured here: SGLang 0.5.23 has no MLA attention kernel on CPU except `intel_amx` (needs
sgl-kernel's CPU build, not on PyPI, and AMX). `torch_native` reads the MLA pool as if it were MHA K /
V, which runs only when `kv_lora_rank == qk_nope_head_dim` (hence the config's 32). The outputs are
then not DeepSeek's attention: a prefill from scratch (decompressed K / V) and an extend over a cached
prefix (the latent rows read as K) differ, with SGLang's default radix cache exactly as with this
backend (same outputs, measured: scratch [271, 643, 256, ...], device hit [467, 834, 0, ...]). So the
reference here is the device hit; the extend is a deterministic function of every cached latent row,
which is what a tiering test needs to compare. For the same reason a page's latent rows differ with
the mode that computed them (layer 2's input is layer 1's attention output), so the prompt is
HIT + 4 tokens: its last page never completes within the 8 output tokens, and no request is
repointed onto a page computed in the other mode (measured: with a complete last page, decode
logprobs after a host hit differed from a device hit's from the second decode step on, for that
reason alone; the prompt's own logprobs were equal).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import NEEDS_SGLANG
from test_sglang_e2e import LOGPROB_TOL, _flood, _gen_lp, _logprob_diff, _prompt, _settled_pool

pytestmark = NEEDS_SGLANG

REPO = Path(__file__).resolve().parent.parent
TINY_MLA = REPO / "scripts" / "cpu" / "tiny-deepseek"
PAGE, HIT, VOCAB = 16, 304, 1024


def make_mla_model(dst: Path, seed: int = 0) -> Path:
    """The tiny DeepSeek-V2 config with N(0, ~1/sqrt(fan_in)) weights in bf16 safetensors."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((TINY_MLA / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, inter, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, r, nope, rope, vd = (cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                             cfg["qk_rope_head_dim"], cfg["v_head_dim"])

    def w(out_f, in_f, gain=1.0):
        return (torch.randn(out_f, in_f, generator=g) * gain / in_f**0.5).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": torch.randn(V, h, generator=g).to(torch.bfloat16),
         "model.norm.weight": ones(h), "lm_head.weight": w(V, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(nh * (nope + rope), h, 2.0)
        t[p + "self_attn.kv_a_proj_with_mqa.weight"] = w(r + rope, h, 2.0)
        t[p + "self_attn.kv_a_layernorm.weight"] = ones(r)
        t[p + "self_attn.kv_b_proj.weight"] = w(nh * (nope + vd), r, 2.0)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * vd)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_e2e_mla")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(workdir):
    from sgl_hicache.sglang.server import SGLangServer

    model = make_mla_model(workdir / "model")
    started = []

    def start(name: str, disk_dir: Path) -> SGLangServer:
        env = {"SGLHICACHE_HOST_TOKENS": "4096", "SGLHICACHE_DISK_DIR": str(disk_dir),
               "SGLHICACHE_DISK_TOKENS": str(64 * 1024), "SGLHICACHE_CHECK_INVARIANTS": "1",
               # a 64-page pool: eviction copies device -> host (see test_sglang_e2e / docs, "Open")
               "SGLHICACHE_EVICTION_DEMOTES": "host"}
        srv = SGLangServer.start(model, load_format=None, log_path=workdir / f"{name}.log", env=env, timeout_s=300,
                                 extra_args=["--max-total-tokens", "1024", "--page-size", str(PAGE),
                                             "--radix-cache-backend", "sgl_hicache", "--log-level", "warning"])
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
        assert not srv.alive()


def test_mla_server_outputs_equal_from_scratch_and_from_every_tier_and_after_a_restart(start_server, workdir):
    disk = workdir / "disk"
    srv = start_server("first", disk)
    st = _settled_pool(srv)
    assert st["config"]["pool_kind"] == "mla" and "planes=1" in st["config"]["namespace"], st["config"]
    P = _prompt(1, HIT + 4)  # 19 whole pages and 4 tokens (see the module docstring)
    _, d0, _ = _gen_lp(srv, P, 0)
    assert sum(d0.values()) == 0, d0
    out_dev, d1, lp_dev = _gen_lp(srv, P, HIT)  # the reference: SGLang's own device-pool reuse
    assert d1["device"] == HIT, d1
    _flood(srv, 2, 4)  # P leaves the device, stays on host
    out_host, d2, lp_host = _gen_lp(srv, P, HIT)
    assert d2["host"] > 0 and d2["host"] + d2["storage"] == HIT, d2
    _flood(srv, 3, 20)  # P leaves device and host, stays on disk
    out_disk, d3, lp_disk = _gen_lp(srv, P, HIT)
    assert d3["storage"] > 0 and d3["device"] + d3["host"] + d3["storage"] == HIT, d3
    assert out_dev == out_host == out_disk, (out_dev, out_host, out_disk)
    diffs = {n: _logprob_diff(lp_dev, lp) for n, lp in (("host", lp_host), ("disk", lp_disk))}
    print(f"\nMLA logprob |diff| vs the device hit: {diffs}")
    assert all(d <= LOGPROB_TOL for d in diffs.values()), diffs
    # not vacuous: one token changed in the last cached page moves the tail's logprobs far past the tolerance
    P3 = list(P)
    P3[HIT - 3] = (P[HIT - 3] - 16 + 1) % (VOCAB - 16) + 16
    lp3 = _gen_lp(srv, P3, HIT)[2]
    late = max(abs(a[1] - b[1]) for a, b in zip(lp3["output"], lp_dev["output"]))
    print(f"MLA output logprob |diff| with a token of the last cached page changed: {late:.4f}")
    assert late > 1000 * LOGPROB_TOL, late
    pool = _settled_pool(srv)["pool"]
    assert pool["request_held_tokens"] == 0 and pool["check"] == "ok", pool
    srv.stop()

    again = start_server("restart", disk)
    out, d, lp = _gen_lp(again, P, HIT)
    assert d["storage"] > 0 and d["device"] == 0, d
    assert out == out_dev, (out, out_dev)
    diff = _logprob_diff(lp_dev, lp)
    print(f"MLA logprob |diff| after the restart: {diff}")
    assert diff <= LOGPROB_TOL, diff
