"""End to end with an MLA pool: the real SGLang 0.5.23 CPU server, a tiny DeepSeek-V2 config
(`scripts/cpu/tiny-deepseek`: 2 layers, kv_lora_rank 32 + rope 16, all layers dense), random weights
of realistic scale, `--radix-cache-backend sgl_hicache` at TP = 1, and at TP = 2 (one copy of the
latent for both ranks: rank 0 writes, both read; outputs equal TP=1's). SGLang builds an
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
from servers import BackendServers
from test_sglang_e2e import TP_ENV, _flood, _gen_lp, _logprob_diff, _prompt, _scheduler_pid, _settled_pool
from tier_walk import (
    assert_a_changed_cached_page_moves,
    assert_restart_serves_from_disk,
    assert_settled_and_clean,
    assert_tiers_equal,
    walk_tiers,
)

REPO = Path(__file__).resolve().parents[2]
TINY_MLA = REPO / "scripts" / "cpu" / "tiny-deepseek"
PAGE, HIT, VOCAB = 16, 304, 1024


def make_mla_model(dst: Path, seed: int = 0, config: Path = TINY_MLA) -> Path:
    """A tiny DeepSeek config (`config`'s folder: V2 by default) with N(0, ~1/sqrt(fan_in)) weights in
    bf16 safetensors. Layers from `first_k_dense_replace` on are MoE (gate, routed and shared experts;
    V3's `e_score_correction_bias` under `noaux_tc`); with `num_nextn_predict_layers: 1` the checkpoint
    also holds the NextN (MTP) layer at index `num_hidden_layers`, as DeepSeek V3's does: a decoder
    layer (a copy of the first) plus `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` (SGLang's
    `DeepseekV3ForCausalLMNextN` takes the embedding and LM head from the target)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((config / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, inter, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, r, nope, rope, vd = (
        cfg["num_attention_heads"],
        cfg["kv_lora_rank"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )

    def w(out_f, in_f, gain=1.0):
        return (torch.randn(out_f, in_f, generator=g) * gain / in_f**0.5).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    def mlp(p, width):
        t[p + "gate_proj.weight"] = w(width, h)
        t[p + "up_proj.weight"] = w(width, h)
        t[p + "down_proj.weight"] = w(h, width)

    t = {
        "model.embed_tokens.weight": torch.randn(V, h, generator=g).to(torch.bfloat16),
        "model.norm.weight": ones(h),
        "lm_head.weight": w(V, h),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(nh * (nope + rope), h, 2.0)
        t[p + "self_attn.kv_a_proj_with_mqa.weight"] = w(r + rope, h, 2.0)
        t[p + "self_attn.kv_a_layernorm.weight"] = ones(r)
        t[p + "self_attn.kv_b_proj.weight"] = w(nh * (nope + vd), r, 2.0)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * vd)
        if i >= cfg["first_k_dense_replace"]:  # MoE
            experts, width = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = w(experts, h)
            if cfg["topk_method"] == "noaux_tc":
                t[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(experts, dtype=torch.float32)
            for e in range(experts):
                mlp(p + f"mlp.experts.{e}.", width)
            mlp(p + "mlp.shared_experts.", width * cfg["n_shared_experts"])
        else:
            mlp(p + "mlp.", inter)
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
    if cfg.get("num_nextn_predict_layers", 0):
        # the NextN layer: the target's first layer (MoE: SGLang's NextN layer always is), fed the next
        # token's normed embedding alone (`eh_proj` = [I, 0] ignores the target's hidden state): it
        # proposes what the target's first layer predicts, so some proposals are accepted
        p = f"model.layers.{L}."
        for name, value in list(t.items()):
            if name.startswith("model.layers.0."):
                t[p + name[len("model.layers.0.") :]] = value.clone()
        t[p + "enorm.weight"] = ones(h)
        t[p + "hnorm.weight"] = ones(h)
        t[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1).to(torch.bfloat16)
        t[p + "shared_head.norm.weight"] = ones(h)
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_e2e_mla")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def shared():
    """TP=1's device hit of the walked prompt, the TP=2 test's reference (filled by the first test)."""
    return {}


@pytest.fixture
def start_server(workdir):
    # a 64-page pool: eviction copies device -> host (see test_sglang_e2e / docs, "Open")
    env = {"SGLHICACHE_CHECK_INVARIANTS": "1", "SGLHICACHE_EVICTION_DEMOTES": "host"}
    servers = BackendServers(make_mla_model(workdir / "model"), workdir, page=PAGE, host_tokens=4096, env=env)
    yield servers.start
    servers.close()


def test_mla_server_host_and_disk_hits_and_a_restart_equal_the_device_hit(start_server, workdir, shared):
    """The walked prompt's host and disk hits, and its disk hit after a restart, give the greedy outputs
    and logprobs of its device hit (not of its scratch run: the module docstring says why)."""
    disk = workdir / "disk"
    srv = start_server("first", disk)
    st = _settled_pool(srv)
    assert st["config"]["pool_kind"] == "mla" and "planes=1" in st["config"]["namespace"], st["config"]
    # 19 whole pages and 4 tokens (see the module docstring); the reference is SGLang's own device-pool reuse
    walk = walk_tiers(srv, _prompt(1, HIT + 4), HIT)
    shared["tp1"] = (walk.outputs["device"], walk.hits["device"], walk.logprobs["device"])
    assert_tiers_equal(walk, "device", "MLA")
    assert_a_changed_cached_page_moves(srv, walk, "device")
    assert_settled_and_clean(srv, io=False)
    srv.stop()
    assert_restart_serves_from_disk(start_server("restart", disk), walk, "device")


def _shared_host_mapping(pid: int) -> str:
    """The (deleted) shared host buffer file a scheduler process maps: `dev:inode path`."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "sgl_hicache-host-" in line:
            parts = line.split()
            return f"{parts[3]}:{parts[4]} {' '.join(parts[5:])}"
    pytest.fail(f"process {pid} maps no sgl_hicache host buffer")


def test_mla_tp2_one_rank_writes_both_read(start_server, workdir, shared):
    """MLA at --tp 2: one copy of the latent for both ranks. Rank 0 alone writes the host buffer (one
    shared-memory buffer both ranks map) and the page files (one directory, no rank in it); rank 1
    reads them. Greedy outputs from device, host and disk hits, and after a restart, equal TP=1's device
    hit (the reference under MLA here: the module docstring)."""
    import json as _json

    P = _prompt(1, HIT + 4)
    if "tp1" not in shared:  # run alone: TP=1's device hit, the reference (see the module docstring)
        ref = start_server("mla-tp1-ref", workdir / "disk-mla-tp1")
        _gen_lp(ref, P, 0)
        shared["tp1"] = _gen_lp(ref, P, HIT)
        ref.stop()
    out1, d, lp1 = shared["tp1"]
    assert d["device"] == HIT, d

    disk = workdir / "disk-mla-tp2"
    stats = workdir / "mla-tp2-stats.json"
    fault = workdir / "mla-read-fault"  # names the rank whose disk reads fail while it exists
    srv = start_server(
        "mla-tp2",
        disk,
        tp=2,
        SGLHICACHE_STATS_FILE=str(stats),
        SGLHICACHE_STATS_INTERVAL_S="0.5",
        SGLHICACHE_FAULT_DISK_READ_FILE=str(fault),
        **TP_ENV,
    )
    pids = {r: _scheduler_pid(srv, r) for r in (0, 1)}
    maps = {r: _shared_host_mapping(pid) for r, pid in pids.items()}
    assert maps[0] == maps[1] and maps[0].endswith("(deleted)"), maps  # one buffer, its name already gone
    assert not list(Path("/dev/shm").glob(f"sgl_hicache-host-{pids[0]}-*"))
    walk = walk_tiers(srv, P, HIT)
    print(
        f"\nMLA outputs TP=1 {out1}, TP=2 {walk.outputs}; "
        f"logprob |diff| TP=2 vs TP=1 device hit {_logprob_diff(lp1, walk.logprobs['device']):.2e}"
    )
    assert walk.outputs["device"] == out1, (out1, walk.outputs)
    assert_tiers_equal(walk, "device", "MLA TP=2")
    # the leader's disk reads fail: its failure is both ranks' (agreed), Q's disk part is recomputed on both
    Q = _prompt(7, HIT + 4)
    out_q = _gen_lp(srv, Q, 0)[0]  # from scratch
    _flood(srv, 8, 4)  # Q to host (and, written through, to disk), as P above
    assert _gen_lp(srv, Q, HIT)[1]["host"] > 0
    _flood(srv, 9, 20)  # Q on disk only
    fault.write_text("0")
    try:
        out_q2, dq, _ = _gen_lp(srv, Q, HIT)  # (input logprobs from 0 would turn prefix reuse off)
    finally:
        fault.unlink()
    assert dq["storage"] == 0 and out_q2 == out_q, (dq, out_q, out_q2)
    st0 = _settled_pool(srv)
    tp0 = st0["backend"]["tp"]
    assert tp0["role"] == "leader" and tp0["left_to_leader"] == {}, tp0
    assert st0["errors"].get("disk->host_errors", 0) > 0, st0["errors"]  # the injected failures, on rank 0
    assert tp0["digests_checked"] > 50, tp0  # equal trees and host slots on both ranks at every step
    assert "namespace" in st0["config"] and "tp=" not in st0["config"]["namespace"], st0["config"]
    assert st0["pool"]["check"] == "ok", st0["pool"]

    def follower():
        try:
            snap = _json.loads(Path(f"{stats}.rank1").read_text())
        except (OSError, ValueError):
            return None
        return snap if snap["hit_tokens"]["disk"] > 0 and snap["errors"].get("peer_rank_errors") else None

    import time as _time

    deadline = _time.monotonic() + 60
    while (st1 := follower()) is None and _time.monotonic() < deadline:
        _time.sleep(0.5)
    assert st1 is not None, "rank 1 published no stats with its disk hit"
    tp1 = st1["backend"]["tp"]
    left = tp1["left_to_leader"]
    print(
        f"rank 1 left to rank 0 (pages per link): {left}; rank 1 read host->device "
        f"{st1['bytes_moved']['host->device']} bytes"
    )
    assert tp1["role"] == "follower" and left.get("device->host", 0) > 0 and left.get("host->disk", 0) > 0, tp1
    assert st1["bytes_moved"]["host->device"] > 0 and st1["hit_tokens"]["host"] > 0, st1["bytes_moved"]
    assert st1["errors"].get("peer_rank_errors", 0) > 0, st1["errors"]  # rank 0's failures, recorded by rank 1
    assert sorted(p.name for p in disk.iterdir() if p.is_dir()) == ["tp2-shared"], list(disk.iterdir())
    srv.stop()

    assert_restart_serves_from_disk(start_server("mla-tp2-restart", disk, tp=2, **TP_ENV), walk, "device")
