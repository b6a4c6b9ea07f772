"""A hybrid linear-attention model served by `--radix-cache-backend sgl_hicache` on the real SGLang
0.5.23 CPU server: the tiny Qwen3-Next (one gated-delta-net layer, one attention layer; see
tests/test_sglang_qwen3_next_cpu.py for the CPU test layer it needs and SGLang's flags).

A prefix hit needs the recurrent state at the hit point: the backend keeps a state snapshot where a
finished request ended (its own mamba slot, taken at its commit), tiers it device -> host -> disk
beside the attention layers' KV pages, and restores it into a hitting request's own slot.

What it proves, with one server per phase:
- a prompt P whose first HIT tokens were a finished request's prompt gives the same greedy tokens and
  logprobs (its tail's and every output token's) when that prefix is served from device, from host,
  from disk, and from disk after a restart on the same directory, as P from scratch; each phase's
  SGLang cached-token details and the backend's snapshot counters show the tier that served it, so
  the equalities are not vacuous;
- the snapshots left the device under mamba slot pressure by demotion (not dropped), and every tier
  charged them at their byte size within its budget;
- a snapshot file rewritten with another valid state (digest included) moves P's outputs: the
  restored state is what the forward reads; a snapshot file with a flipped byte fails its check and
  P is recomputed, equal to scratch.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import NEEDS_SGLANG
from servers import BackendServers
from test_sglang_e2e import LOGPROB_TOL, _gen_lp, _logprob_diff, _prompt
from test_sglang_qwen3_next_cpu import MAMBA_ARGS

pytestmark = NEEDS_SGLANG

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "cpu"))
from realistic_weights_qwen3_next import make_model  # noqa: E402  (from scripts/cpu, put on sys.path above)

HIT = 40  # the first request's prompt: its state snapshot is the hit point of P
TAIL = 12
DEVICE_TOKENS = 512
MAMBA_SLOTS = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_mamba")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(workdir):
    from sgl_hicache.sglang.server import has_cuda

    if has_cuda():
        pytest.skip("proves the CPU test layer's kernels; on a GPU SGLang runs its own")
    # host: 1,014 tokens of KV and 7 snapshots of the tiny model
    env = {"SGLHICACHE_CHECK_INVARIANTS": "1", "SGLHICACHE_MAMBA_STATE_SHARE": "0.34"}
    args = ("--max-mamba-cache-size", str(MAMBA_SLOTS), "--max-running-requests", "2", *MAMBA_ARGS)
    servers = BackendServers(
        make_model(workdir / "model"),
        workdir,
        page=1,
        host_tokens=1536,
        device_tokens=DEVICE_TOKENS,
        env=env,
        args=args,
        timeout_s=600,
    )
    yield servers.start
    servers.close()


def _states(srv) -> dict:
    info = json.loads(srv.get("/server_info"))
    return info["internal_states"][0]["sgl_hicache"]


def _flood(srv, seed: int, count: int, n: int = 120) -> None:
    for i in range(count):
        srv.generate(_prompt(seed * 1000 + i, n), max_new_tokens=1, ignore_eos=True)


def _restored(srv) -> dict:
    m = _states(srv)["mamba_states"]
    return {t: m[f"restored_{t}"] for t in ("device", "host", "disk")}


class _FakeStates:
    """A `MambaPool` stand-in: one state of `n` bytes per slot (slot 0 unused), SGLang's allocator
    calls (`alloc`, `free`) and `copy_from`."""

    def __init__(self, slots: int, n: int) -> None:
        import torch

        self.snapshot_bytes = n
        self.buf = torch.zeros((slots + 1, n), dtype=torch.uint8)
        self.mamba_cache = SimpleNamespace(temporal=self.buf)
        self.free_slots = list(range(1, slots + 1))

    def alloc(self, k: int):
        import torch

        if len(self.free_slots) < k:
            return None
        got, self.free_slots = self.free_slots[:k], self.free_slots[k:]
        return torch.tensor(got)

    def free(self, idx) -> None:
        self.free_slots += [int(i) for i in idx.view(-1)]

    def copy_from(self, src, dst) -> None:
        self.buf[dst] = self.buf[src]

    def read(self, slots):
        return self.buf[slots].clone().view(len(slots), 1, 1, 1, 1, -1)

    def write(self, slots, pages) -> None:
        self.buf[slots] = pages.contiguous().view(len(slots), -1).view(self.buf.dtype)


def test_snapshots_demote_under_slot_pressure_charge_their_bytes_and_survive_a_restart(tmp_path):
    """Device slots asked back demote their states to host, host over its byte budget to disk; each
    tier restores the state bit for bit into another slot without changing its own copy; a new
    instance on the same directory finds the files; a file that fails its digest is refused."""
    import torch

    from sgl_hicache.policy.snapshots import SnapshotCosts
    from sgl_hicache.sglang.mamba_snapshots import SUFFIX, SnapshotTiers

    n = 64
    fake = _FakeStates(8, n)

    def tiers() -> SnapshotTiers:
        costs = SnapshotCosts(n, 100.0, 1.0)
        return SnapshotTiers(fake, fake, fake, costs, host_bytes=2 * n + n // 2, disk_dir=tmp_path, disk_bytes=100 * n)

    t = tiers()
    states = {}
    for i in range(4):  # four finished requests hand over their slots: states at depths 10, 20, 30, 40
        slot = int(fake.alloc(1)[0])
        fake.buf[slot] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        key = bytes([i]) * 16
        states[key] = fake.buf[slot].clone()
        assert t.take(key, 10 * (i + 1), 10 * i, slot)
    assert not t.take(key, 40, 30, int(fake.alloc(1)[0]))  # one per key: the caller keeps its slot
    assert t.evict_device(4) == 4 and t.used["device"] == 0 and len(fake.free_slots) == 7
    assert t.counters["demoted_device"] == 4 and t.counters["dropped_device"] == 0
    assert t.bytes_in("host") == 2 * n <= t.host_bytes and t.bytes_in("disk") == 2 * n
    assert {t.tier_of(k) for k in states} == {"host", "disk"}
    dst = int(fake.alloc(1)[0])
    for key, want in states.items():
        tier = t.tier_of(key)
        fake.buf[dst] = 0
        assert t.restore(key, dst) == tier and torch.equal(fake.buf[dst], want), tier
    files = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) == t.used["disk"] >= 2

    again = tiers()  # a restart: the disk files are found, the DRAM copies are gone
    assert again.counters["disk_found_at_start"] == len(files) and again.used["host"] == 0
    on_disk = [k for k in states if k in again]
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    served = [again.restore(k, dst) for k in on_disk]
    assert served.count(None) == 1 and again.counters["disk_corrupt"] == 1, served
    assert served.count("disk") == len(on_disk) - 1


def test_hybrid_outputs_equal_scratch_from_every_tier_and_after_a_restart(start_server, workdir):
    from sgl_hicache.sglang.mamba_snapshots import SUFFIX, decode_header, encode_file

    disk = workdir / "disk"
    srv = start_server("first", disk)
    st = _states(srv)
    assert st["config"]["pool_kind"] == "mamba", st["config"]
    size = st["mamba_states"]["snapshot_bytes"]
    # P is served from every tier; R's and S's snapshots are altered on disk before the restart. Their
    # hit points (depths HIT, HIT + 1, HIT + 2) name their snapshot files apart (the file header's depth)
    prompts = {name: _prompt(seed, HIT + k + TAIL) for k, (name, seed) in enumerate((("P", 1), ("R", 2), ("S", 3)))}
    hits = {name: HIT + k for k, name in enumerate(prompts)}
    ref = {}

    def scratch(name: str) -> None:
        out, d0, lp = _gen_lp(srv, prompts[name], 0)  # from scratch: the reference
        assert sum(d0.values()) == 0, d0
        ref[name] = (out, lp)
        # finished: its state at the hit point is kept
        srv.generate(prompts[name][: hits[name]], max_new_tokens=1, ignore_eos=True)

    scratch("P")
    P = prompts["P"]
    out_dev, d1, lp_dev = _gen_lp(srv, P, HIT)
    assert d1["device"] == HIT, d1
    assert _restored(srv) == {"device": 1, "host": 0, "disk": 0}
    scratch("R")
    scratch("S")

    _flood(srv, 2, 4)  # the snapshots leave the mamba slots (demoted), P's pages the device
    m = _states(srv)["mamba_states"]
    print(f"\nafter the first flood: {m}")
    assert m["demoted_device"] > 0 and m["dropped_device"] == 0 and m["device_snapshots"] <= MAMBA_SLOTS, m
    out_host, d2, lp_host = _gen_lp(srv, P, HIT)
    assert d2["device"] == 0 and d2["host"] == HIT and d2["storage"] == 0, d2
    assert _restored(srv) == {"device": 1, "host": 1, "disk": 0}

    _flood(srv, 3, 14)  # P's pages and the snapshots leave the host for disk
    m = _states(srv)["mamba_states"]
    assert m["demoted_host"] > 0 and m["host_bytes"] <= m["host_budget_bytes"], m
    assert m["disk_bytes"] == (m["disk_writes"] - m["disk_deleted"]) * size <= m["disk_budget_bytes"], m
    out_disk, d3, lp_disk = _gen_lp(srv, P, HIT)
    assert d3["storage"] == HIT, d3
    assert _restored(srv) == {"device": 1, "host": 1, "disk": 1}

    out_ref, lp_ref = ref["P"]
    assert out_ref == out_dev == out_host == out_disk, (out_ref, out_dev, out_host, out_disk)
    diffs = {n: _logprob_diff(lp_ref, lp) for n, lp in (("device", lp_dev), ("host", lp_host), ("disk", lp_disk))}
    print(f"\nQwen3-Next logprob |diff| vs scratch: {diffs}")
    assert all(d <= LOGPROB_TOL for d in diffs.values()), diffs
    pool = _states(srv)["pool"]
    assert pool["request_held_tokens"] == 0 and pool["check"] == "ok", pool
    srv.stop()

    files = {decode_header(f.read_bytes())[0]: f for f in disk.rglob(f"*{SUFFIX}")}
    assert {HIT, HIT + 1, HIT + 2} <= set(files), sorted(files)
    # R's snapshot rewritten with another valid state (digest included): the forward must read it
    original = files[HIT + 1].read_bytes()
    depth, ancestor, n, _ = decode_header(original)
    payload = bytearray(original[-n:])
    for i in range(0, n, 64):
        payload[i] ^= 0x10
    files[HIT + 1].write_bytes(encode_file(depth, ancestor, bytes(payload)))
    # S's snapshot with one payload byte flipped (its digest now fails): refused, S recomputed
    raw = bytearray(files[HIT + 2].read_bytes())
    raw[-3] ^= 0xFF
    files[HIT + 2].write_bytes(bytes(raw))

    again = start_server("restart", disk)
    out, d, lp = _gen_lp(again, P, HIT)
    assert d["storage"] > 0 and d["device"] == 0, d
    assert _restored(again)["disk"] == 1
    assert out == out_ref, (out, out_ref)
    diff = _logprob_diff(lp_ref, lp)
    print(f"Qwen3-Next logprob |diff| after the restart: {diff}")
    assert diff <= LOGPROB_TOL, diff

    _, d_r, lp_r = _gen_lp(again, prompts["R"], HIT + 1)
    assert d_r["storage"] > 0 and _restored(again)["disk"] == 2, d_r
    moved = _logprob_diff(ref["R"][1], lp_r)
    print(f"Qwen3-Next logprob |diff| from an altered snapshot: {moved}")
    assert moved > 1000 * LOGPROB_TOL, moved

    out_s, d_s, lp_s = _gen_lp(again, prompts["S"], HIT + 2)
    m = _states(again)["mamba_states"]
    assert m["disk_corrupt"] == 1 and m["restored_disk"] == 2, m
    assert sum(d_s.values()) == 0, d_s
    assert out_s == ref["S"][0] and _logprob_diff(ref["S"][1], lp_s) <= LOGPROB_TOL
