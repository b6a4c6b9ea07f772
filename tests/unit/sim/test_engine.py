"""The embedded engine: determinism, policies on hand-checkable traces, and the report."""

from __future__ import annotations

import dataclasses
import json
from array import array

import pytest
from conftest import mooncake_trace

from sgl_hicache.replay import load_trace
from sgl_hicache.replay.trace import Request
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.run import compare, run_policy
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig


def req(i: int, tokens: list[int], out: int = 4, t: float = 0.0) -> Request:
    return Request(f"r{i}", None, t, array("q", tokens), out, i + 1)


def config(policy: str, device: int = 64, host: int = 256, disk: int = 1024, **kw) -> EngineConfig:
    return EngineConfig(
        policy,
        get_model("tiny-llama"),
        get_hardware("cpu-local"),
        device_tokens=device,
        host_tokens=host,
        disk_tokens=disk,
        page_size=4,
        concurrency=1,
        **kw,
    )


def test_same_trace_same_report():
    reqs = load_trace(mooncake_trace(), limit=60, scale=16)
    base = EngineConfig(
        "prefetch",
        get_model("llama3-8b"),
        get_hardware("h200"),
        device_tokens=4096,
        host_tokens=8192,
        disk_tokens=65536,
        page_size=16,
        concurrency=4,
    )
    a, b = run_policy(reqs, base), run_policy(reqs, base)
    for r in (a, b):
        r.pop("engine")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_hand_checked_revisit_after_eviction():
    """A is served, B pushes A out of the 16-token device tier, then A comes back."""
    a = list(range(100, 116))  # 4 pages
    b = list(range(200, 216))
    reqs = [req(0, a), req(1, b), req(2, a)]
    recompute = run_policy(reqs, config("recompute", device=24, host=0, disk=0))
    demote = run_policy(reqs, config("demote", device=24, host=64, disk=0))
    # recompute: A's second visit finds nothing (B needed the pages); demote: all 16 tokens from host
    assert recompute["hit_tokens"] == {"device": 0, "host": 0, "disk": 0}
    assert demote["hit_tokens"] == {"device": 0, "host": 16, "disk": 0}
    assert demote["miss_tokens"] == 32


def test_disk_hits_when_host_is_small():
    seqs = [list(range(1000 * k, 1000 * k + 16)) for k in range(4)]
    reqs = [req(i, s) for i, s in enumerate(seqs)] + [req(10, seqs[0])]
    rep = run_policy(reqs, config("demote", device=24, host=16, disk=256))
    assert rep["hit_tokens"]["disk"] == 16
    assert rep["bytes_moved"]["host->disk"] > 0 and rep["bytes_moved"]["disk->host"] > 0


def test_demote_never_fewer_hits_than_recompute_on_the_real_trace():
    reqs = load_trace(mooncake_trace(), limit=300, scale=16)
    base = EngineConfig(
        "recompute",
        get_model("llama3-8b"),
        get_hardware("h200"),
        device_tokens=6144,
        host_tokens=16384,
        disk_tokens=131072,
        page_size=16,
        concurrency=4,
    )
    out = compare(reqs, base)
    hits = {p: sum(r["hit_tokens"].values()) for p, r in out["policies"].items()}
    assert hits["demote"] >= hits["recompute"]
    assert hits["prefetch"] >= hits["recompute"] and hits["predict"] >= hits["recompute"]
    assert hits["demote"] > hits["recompute"], "tiers added no hit on a trace with reuse beyond the device tier"
    for rep in out["policies"].values():
        assert rep["requests"] == 300
        assert rep["prompt_tokens"] == sum(len(r.input_ids) for r in reqs)
        assert rep["miss_tokens"] == rep["prompt_tokens"] - sum(rep["hit_tokens"].values())
        assert 0 < rep["ttft_s"]["p50"] <= rep["ttft_s"]["p90"] <= rep["ttft_s"]["p99"]
        assert set(rep["prefetch"]) >= {"promoted_tokens", "used_tokens", "precision", "coverage"}
    assert "demote/recompute" in out["ratios"]


def test_prefetch_moves_disk_reads_off_the_critical_path():
    """Disk-resident prompts revisited while others compute: prefetch brings them up and costs no
    more than demote. With a 2,048-token host tier the prefetch room guard (`policy/guard.py`) now
    keeps most prefetches back, so the two are level (1.00002x after the eviction and
    demand-before-prefetch merges; 0.1 % is the bound, not a tuned figure)."""
    reqs = load_trace(mooncake_trace(), limit=200, scale=16)
    base = EngineConfig(
        "demote",
        get_model("llama3-8b"),
        get_hardware("h200"),
        device_tokens=8192,
        host_tokens=2048,
        disk_tokens=262144,
        page_size=16,
        concurrency=8,
    )
    demote = run_policy(reqs, base)
    prefetch = run_policy(reqs, dataclasses.replace(base, policy="prefetch"))
    assert prefetch["hit_tokens"]["disk"] > 0
    assert prefetch["prefetch"]["promoted_tokens"] > 0 and prefetch["prefetch"]["coverage"] > 0
    assert prefetch["ttft_s"]["mean"] <= demote["ttft_s"]["mean"] * 1.001


def test_prefill_cost_is_charged_from_the_cost_model():
    """One request on an empty engine: TTFT is exactly one prefill of the whole prompt."""
    from sgl_hicache.sim import cost

    cfg = config("recompute", device=64, host=0, disk=0)
    engine = EmbeddedEngine(cfg)
    records = engine.run([req(0, list(range(40)), out=1)])
    expected = cost.batch_prefill_seconds(cfg.model, cfg.hardware, [(40, 0)])
    assert records[0].ttft_s == pytest.approx(expected)


def test_device_too_small_is_a_clear_error():
    cfg = config("recompute", device=8, host=0, disk=0)
    with pytest.raises(RuntimeError, match="too small"):
        EmbeddedEngine(cfg).run([req(0, list(range(40)))])


def test_disk_reads_queue_behind_disk_writes():
    """The disk is one pipe: a read scheduled after a write starts when the write is done."""
    from sgl_hicache.sim.simulator import VirtualLinks

    links = VirtualLinks(get_model("llama3-8b"), get_hardware("h200"))
    w = links.seconds("host->disk", 4096)
    r = links.seconds("disk->host", 4096)
    assert w > r > 0  # the preset writes slower than it reads
    assert links.schedule("host->disk", 4096, 0.0) == pytest.approx(w)
    assert links.schedule("disk->host", 4096, 0.0) == pytest.approx(w + r)
    assert links.schedule("host->device", 4096, 0.0) == pytest.approx(links.seconds("host->device", 4096))


def test_host_to_disk_writes_are_charged_to_the_disk():
    seqs = [list(range(1000 * k, 1000 * k + 16)) for k in range(4)]
    reqs = [req(i, s) for i, s in enumerate(seqs)] + [req(10, seqs[0])]
    cfg = config("demote", device=24, host=16, disk=256)
    rep = run_policy(reqs, cfg)
    written_tokens = rep["bytes_moved"]["host->disk"] // cfg.storage_layout.bytes_per_token
    assert written_tokens > 0
    from sgl_hicache.sim.simulator import VirtualLinks

    expected = VirtualLinks(cfg.model, cfg.hardware).seconds("host->disk", written_tokens)
    assert rep["engine"]["disk_write_seconds"] == pytest.approx(expected)


def test_a_requests_own_device_pages_are_not_room_for_it():
    """A request whose matched prefix sits unlocked on the device needs room for the rest beside it:
    its own pages are locked for it, so they are not evictable room. Counted as room, a request
    that could not fit looked as if it did (short_pages <= 0), no queued prefetch gave up its lock
    for it, and the engine idled behind it until the arrivals ran out."""
    from sgl_hicache.sim.simulator import _Flight

    eng = EmbeddedEngine(config("prefetch", device=32, host=64, disk=256))  # 8 device pages of 4 tokens
    cache = eng.cache
    mine, other = list(range(100, 116)), list(range(500, 512))  # 4 pages, 3 pages
    for tokens in (mine, other):
        cache.insert(tokens, cache.allocate_device(len(tokens) // 4))
    held = cache.match(other, touch=False).last_node
    cache.lock(held)  # what a queued request's prefetch job holds
    head = req(0, mine + list(range(900, 916)), out=1)  # its 4 cached pages, 4 new ones, 1 for output
    ticket, _ = eng.controller.arrive(head.input_ids)
    flight = _Flight(head, 0.0, ticket)
    ok, _, _ = eng._try_admit(flight)
    assert not ok
    # 5 pages needed, 1 free, nothing evictable but its own: 4 short (was counted as 0)
    assert flight.short_pages == 4
    cache.unlock(held)
    eng.close()
