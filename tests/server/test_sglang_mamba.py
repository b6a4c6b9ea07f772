"""A hybrid linear-attention model served by `--radix-cache-backend sgl_hicache` on the real SGLang
0.5.23 CPU server: the tiny Qwen3-Next (one gated-delta-net layer, one attention layer; see
tests/server/test_sglang_qwen3_next_cpu.py for the CPU test layer it needs and SGLang's flags).

A prefix hit needs the recurrent state at the hit point: the backend keeps a state snapshot where a
finished request ended (its own mamba slot, taken at its commit), tiers it device -> host -> disk
beside the attention layers' KV pages, and restores it into a hitting request's own slot.

What it proves, with one server per phase:
- a prompt P whose first HIT tokens were a finished request's prompt gives the same greedy tokens and
  logprobs (its tail's and every output token's) when that prefix is served from device, from host,
  from disk, and from disk after a restart on the same directory, as P from scratch; each phase's
  SGLang cached-token details and the backend's snapshot counters show the tier that served it, so
  the equalities are not vacuous;
- the snapshots left the device under mamba slot pressure once their host copy landed (none dropped), and every tier
  charged them at their byte size within its budget;
- a snapshot file rewritten with another valid state (digest included) moves P's outputs: the
  restored state is what the forward reads; a snapshot file with a flipped byte fails its check and
  P is recomputed, equal to scratch;
- with the scheduler-I/O guard on, no state copy, file write, sleep or wait ran inside a cache call
  SGLang made: the snapshots' device -> host, host -> disk and disk -> host copies ran on the
  transfer engine's threads (the guard counted them there).
Unit tests (no server): the snapshot tiers' copies in flight, landed, and failed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from servers import CHECKED, BackendServers
from test_sglang_e2e import LOGPROB_TOL, _gen_lp, _logprob_diff, _prompt
from test_sglang_qwen3_next_cpu import MAMBA_ARGS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "cpu"))
from realistic_weights_qwen3_next import make_model  # from scripts/cpu, put on sys.path above

HIT = 40  # the first request's prompt: its state snapshot is the hit point of P
TAIL = 12
DEVICE_TOKENS = 512
MAMBA_SLOTS = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_mamba")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mamba_servers(workdir: Path, page: int, slots: int, args: list[str], host_tokens: int = 1536) -> BackendServers:
    """The servers of a phase: the tiny Qwen3-Next on the backend with `slots` mamba slots, 2 running
    requests, `DEVICE_TOKENS` of KV and a host of `host_tokens`, a third of it for snapshots (1,536:
    1,014 tokens of KV and 7 snapshots); the tree checks and the scheduler-I/O guard on."""
    from sgl_hicache.client.server import has_cuda

    if has_cuda():
        pytest.skip("proves the CPU test layer's kernels; on a GPU SGLang runs its own")
    env = {**CHECKED, "SGLHICACHE_MAMBA_STATE_SHARE": "0.34"}
    return BackendServers(
        make_model(workdir / "model"),
        workdir,
        page=page,
        host_tokens=host_tokens,
        device_tokens=DEVICE_TOKENS,
        env=env,
        args=("--max-mamba-cache-size", str(slots), "--max-running-requests", "2", *args),
        timeout_s=600,
    )


@pytest.fixture
def start_server(workdir):
    servers = mamba_servers(workdir, 1, MAMBA_SLOTS, MAMBA_ARGS)
    yield servers.start
    servers.close()


def _states(srv) -> dict:
    info = json.loads(srv.get("/server_info"))
    return info["internal_states"][0]["sgl_hicache"]


def _flood(srv, seed: int, count: int, n: int = 120) -> None:
    for i in range(count):
        srv.generate(_prompt(seed * 1000 + i, n), max_new_tokens=1, ignore_eos=True)


def _no_scheduler_io(srv, *links: str) -> None:
    """No copy, file write, sleep or wait ran inside a cache call SGLang made (the snapshots' movers
    are in the guarded handler table); the state copies of `links` ran, on the engine's threads."""
    io = _states(srv)["scheduler_io"]
    offenders = io.pop("first_offender")
    assert io["copy"] == 0 and not io["copy_by_link"], (io, offenders)
    assert io["disk_write"] == io["sleep"] == io["event_wait"] == 0, (io, offenders)
    elsewhere = io["copy_elsewhere_by_link"]
    assert all(elsewhere.get(link, 0) > 0 for link in links), io


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


class _Engine:
    """A transfer engine run by hand: `submit` queues ops; `run` executes them through the handler
    table (as the engine's workers do), or fails them with an I/O error (`fail`)."""

    def __init__(self) -> None:
        self.handlers: dict = {}
        self.queued: list = []

    def submit(self, ops, kind: str) -> None:
        self.queued += list(ops)

    def run(self, fail: bool = False) -> int:
        from sgl_hicache.transfer.handlers import execute

        ops, self.queued = self.queued, []
        for op in ops:
            if fail:
                op.error = OSError("injected")
                op.executed.set()
            else:
                execute(op, self.handlers)
        return len(ops)


def _tiers(fake: _FakeStates, engine: _Engine, path, host: int, n: int):
    from sgl_hicache.policy.snapshots import SnapshotCosts
    from sgl_hicache.sglang.kinds.mamba.mamba_snapshots import SnapshotTiers

    costs = SnapshotCosts(n, 100.0, 1.0)
    return SnapshotTiers(
        fake,
        fake,
        fake,
        costs,
        host_bytes=host,
        disk_dir=path,
        disk_bytes=100 * n,
        handlers=engine.handlers,
        submit=engine.submit,
    )


def _settle(t, engine: _Engine) -> None:
    for _ in range(10):  # copies land at step boundaries (`pump`), which start the next ones
        engine.run()
        t.pump()
    assert not engine.queued and not t.pending


def test_snapshots_move_down_in_the_background_charge_their_bytes_and_survive_a_restart(tmp_path):
    """Taken snapshots are copied to host by the engine (not by the caller), host over its byte budget
    to disk; eviction then frees their slots without a copy; each tier restores the state bit for bit
    into another slot without changing its own copy (a disk one once its read landed); a new instance
    on the same directory finds the files; a file that fails its digest is refused."""
    import torch

    from sgl_hicache.sglang.kinds.mamba.mamba_snapshots import PENDING, READY, SUFFIX

    n = 64
    fake = _FakeStates(8, n)
    engine = _Engine()
    t = _tiers(fake, engine, tmp_path, 2 * n + n // 2, n)
    states = {}
    for i in range(4):  # four finished requests hand over their slots: states at depths 10, 20, 30, 40
        slot = int(fake.alloc(1)[0])
        fake.buf[slot] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        key = bytes([i]) * 16
        states[key] = fake.buf[slot].clone()
        assert t.take(key, 10 * (i + 1), 10 * i, slot)
    assert not t.take(key, 40, 30, int(fake.alloc(1)[0]))  # one per key: the caller keeps its slot
    # write-through: two host copies fit the host share and are in flight; their slots are not evictable
    assert t.slots_moving() == 2 and len(engine.queued) == 2 and t.used["host"] == 0
    assert t.evict_device(4) == 2 and t.counters["dropped_device"] == 2  # the two with no copy coming
    for key in [k for k in states if k not in t]:
        del states[key]
    _settle(t, engine)
    assert t.used["host"] == 2 and t.counters["host_copies"] == 2 and t.slots_moving() == 0
    assert t.evict_device(4) == 2 and t.used["device"] == 0 and len(fake.free_slots) == 7
    assert t.counters["demoted_device"] == 2

    for i in range(4, 8):  # four more: the host share overflows to disk, written in the background
        slot = int(fake.alloc(1)[0])
        fake.buf[slot] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        key = bytes([i]) * 16
        states[key] = fake.buf[slot].clone()
        assert t.take(key, 10 * (i + 1), 10 * i, slot)
        _settle(t, engine)
    assert t.evict_device(8) == 4 and t.counters["dropped_device"] == 2 and t.counters["demoted_device"] == 6
    assert t.bytes_in("host") == 2 * n <= t.host_bytes and t.bytes_in("disk") == 4 * n
    assert t.counters["demoted_host"] >= 4 and t.counters["disk_writes"] == 4
    assert {t.tier_of(k) for k in states} == {"host", "disk"}
    dst = int(fake.alloc(1)[0])
    for key, want in states.items():
        tier = t.tier_of(key)
        fake.buf[dst] = 0
        if tier == "disk":  # read on the engine first
            assert t.restore(key, dst) is None and t.fetch(key) == PENDING and engine.run() >= 1
        assert t.fetch(key) == READY
        assert t.restore(key, dst) == tier and torch.equal(fake.buf[dst], want), tier
        t.pump()
    files = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) == t.used["disk"] >= 2

    again = _tiers(fake, _Engine(), tmp_path, 2 * n + n // 2, n)  # a restart: the files are found
    assert again.counters["disk_found_at_start"] == len(files) and again.used["host"] == 0
    on_disk = [k for k in states if k in again]
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    assert {again.fetch(k) for k in on_disk} == {PENDING}
    engine2 = again.submit.__self__  # type: ignore[attr-defined]
    engine2.run()
    served = [again.fetch(k) and again.restore(k, dst) for k in on_disk]
    assert served.count(None) == 1 and again.counters["disk_corrupt"] == 1, served
    assert served.count("disk") == len(on_disk) - 1
    assert not any(tmp_path.rglob("*.tmp*"))


def test_a_copy_in_flight_serves_hits_and_a_failed_copy_loses_nothing(tmp_path):
    """A demotion in flight: its slot is neither evictable nor freed, and a hit meanwhile is served
    from it; the copy failing leaves the state on the device. A host -> disk write in flight: a hit
    is served from the host copy it writes; the write failing leaves the host copy (no file). A disk
    read failing drops the snapshot (the hit recomputes), never serves wrong bytes."""
    import torch

    from sgl_hicache.sglang.kinds.mamba.mamba_snapshots import PENDING, SUFFIX

    n = 32
    fake = _FakeStates(6, n)
    engine = _Engine()
    t = _tiers(fake, engine, tmp_path, n, n)  # room for one host copy
    a, b = b"a" * 16, b"b" * 16
    slot = int(fake.alloc(1)[0])
    fake.buf[slot] = torch.arange(n, dtype=torch.uint8)
    want_a = fake.buf[slot].clone()
    assert t.take(a, 20, 0, slot)
    dst = int(fake.alloc(1)[0])
    assert t.slots_moving() == 1 and t.evict_device(1) == 0 and t.used["device"] == 1
    assert t.restore(a, dst) == "device" and torch.equal(fake.buf[dst], want_a)
    engine.run(fail=True)
    t.poll()
    assert t.counters["demote_failed"] == 1 and t.tier_of(a) == "device" and t.slots_moving() == 0
    t.pump()  # tried again at the next step
    _settle(t, engine)
    assert t.tier_of(a) == "device" and t.used["host"] == 1

    slot_b = int(fake.alloc(1)[0])
    fake.buf[slot_b] = 7
    assert t.take(b, 30, 0, slot_b)  # no host room: a's host copy is written to disk to make some
    assert t.evict_device(1) == 1 and t.counters["demoted_device"] == 1  # a's slot: clean
    assert t.tier_of(a) == "host" and len(engine.queued) == 1
    fake.buf[dst] = 0
    assert t.restore(a, dst) == "host" and torch.equal(fake.buf[dst], want_a)  # from the copy being written
    engine.run(fail=True)
    t.pump()
    assert t.counters["disk_write_failed"] == 1 and t.tier_of(a) == "host" and not any(tmp_path.rglob(f"*{SUFFIX}"))
    _settle(t, engine)
    assert t.tier_of(a) == "disk" and t.entries[b].host is not None and t.counters["disk_writes"] == 1

    t.evict_device(1)
    assert t.fetch(a) == PENDING
    engine.run(fail=True)  # the file cannot be read: the snapshot is dropped, the hit recomputes
    assert t.fetch(a) is None and a not in t and t.counters["disk_read_failed"] == 1
    assert t.restore(a, dst) is None and not any(tmp_path.rglob(f"*{SUFFIX}"))


def test_hybrid_outputs_equal_scratch_from_every_tier_and_after_a_restart(start_server, workdir):
    every_tier(start_server, workdir, {"P": HIT, "R": HIT + 1, "S": HIT + 2}, MAMBA_SLOTS)


def every_tier(start_server, workdir: Path, hits: dict[str, int], slots: int, flood_tokens: int = 120) -> None:
    """The phases of the module docstring on one model's servers (`start_server(name, disk)`): P, R
    and S are prompts of `hits[name] + TAIL` tokens whose state snapshot at depth `hits[name]` is left
    by their scratch run (or by a finished request of their first `hits[name]` tokens). The depths
    are distinct and no flood request leaves a snapshot at one: they name the snapshot files apart
    (the file header's depth). `slots`: the server's mamba slots; `flood_tokens`: the flood prompts'
    length (their snapshots must rank above P's, or the first flood leaves P's on the device)."""
    from sgl_hicache.sglang.kinds.mamba.mamba_snapshots import SUFFIX, decode_header, encode_file

    disk = workdir / "disk"
    srv = start_server("first", disk)
    st = _states(srv)
    assert st["config"]["pool_kind"] == "mamba", st["config"]
    size = st["mamba_states"]["snapshot_bytes"]
    # P is served from every tier; R's and S's snapshots are altered on disk before the restart
    prompts = {name: _prompt(seed, hits[name] + TAIL) for name, seed in (("P", 1), ("R", 2), ("S", 3))}
    hit = hits["P"]
    ref = {}

    def scratch(name: str) -> None:
        out, d0, lp = _gen_lp(srv, prompts[name], 0)  # from scratch: the reference
        assert sum(d0.values()) == 0, d0
        ref[name] = (out, lp)
        # finished: its state at the hit point is kept
        srv.generate(prompts[name][: hits[name]], max_new_tokens=1, ignore_eos=True)

    scratch("P")
    P = prompts["P"]
    out_dev, d1, lp_dev = _gen_lp(srv, P, hit)
    assert d1["device"] == hit, d1
    assert _restored(srv) == {"device": 1, "host": 0, "disk": 0}
    scratch("R")
    scratch("S")

    _flood(srv, 2, 4, flood_tokens)  # the snapshots leave the mamba slots (demoted), P's pages the device
    m = _states(srv)["mamba_states"]
    print(f"\nafter the first flood: {m}")
    assert m["demoted_device"] > 0 and m["dropped_device"] == 0 and m["device_snapshots"] <= slots, m
    out_host, d2, lp_host = _gen_lp(srv, P, hit)
    assert d2["device"] == 0 and d2["host"] == hit and d2["storage"] == 0, d2
    assert _restored(srv) == {"device": 1, "host": 1, "disk": 0}

    _flood(srv, 3, 14, flood_tokens)  # P's pages and the snapshots leave the host for disk
    m = _states(srv)["mamba_states"]
    assert m["demoted_host"] > 0 and m["host_bytes"] <= m["host_budget_bytes"], m
    assert m["disk_bytes"] == (m["disk_writes"] - m["disk_deleted"]) * size <= m["disk_budget_bytes"], m
    out_disk, d3, lp_disk = _gen_lp(srv, P, hit)
    assert d3["storage"] == hit, d3
    assert _restored(srv) == {"device": 1, "host": 1, "disk": 1}

    out_ref, lp_ref = ref["P"]
    assert out_ref == out_dev == out_host == out_disk, (out_ref, out_dev, out_host, out_disk)
    diffs = {n: _logprob_diff(lp_ref, lp) for n, lp in (("device", lp_dev), ("host", lp_host), ("disk", lp_disk))}
    print(f"\nQwen3-Next logprob |diff| vs scratch: {diffs}")
    assert all(d <= LOGPROB_TOL for d in diffs.values()), diffs
    pool = _states(srv)["pool"]
    assert pool["request_held_tokens"] == 0 and pool["check"] == "ok", pool
    _no_scheduler_io(srv, "state:device->state:host", "state:host->state:disk", "state:disk->state:host")
    srv.stop()

    files = {decode_header(f.read_bytes())[0]: f for f in disk.rglob(f"*{SUFFIX}")}
    assert set(hits.values()) <= set(files), sorted(files)
    # R's snapshot rewritten with another valid state (digest included): the forward must read it
    original = files[hits["R"]].read_bytes()
    depth, ancestor, n, _ = decode_header(original)
    payload = bytearray(original[-n:])
    for i in range(0, n, 64):
        payload[i] ^= 0x10
    files[hits["R"]].write_bytes(encode_file(depth, ancestor, bytes(payload)))
    # S's snapshot with one payload byte flipped (its digest now fails): refused, S recomputed
    raw = bytearray(files[hits["S"]].read_bytes())
    raw[-3] ^= 0xFF
    files[hits["S"]].write_bytes(bytes(raw))

    again = start_server("restart", disk)
    out, d, lp = _gen_lp(again, P, hit)
    assert d["storage"] > 0 and d["device"] == 0, d
    assert _restored(again)["disk"] == 1
    assert out == out_ref, (out, out_ref)
    diff = _logprob_diff(lp_ref, lp)
    print(f"Qwen3-Next logprob |diff| after the restart: {diff}")
    assert diff <= LOGPROB_TOL, diff

    _, d_r, lp_r = _gen_lp(again, prompts["R"], hits["R"])
    assert d_r["storage"] > 0 and _restored(again)["disk"] == 2, d_r
    moved = _logprob_diff(ref["R"][1], lp_r)
    print(f"Qwen3-Next logprob |diff| from an altered snapshot: {moved}")
    assert moved > 1000 * LOGPROB_TOL, moved

    out_s, d_s, lp_s = _gen_lp(again, prompts["S"], hits["S"])
    m = _states(again)["mamba_states"]
    assert m["disk_corrupt"] == 1 and m["restored_disk"] == 2, m
    assert sum(d_s.values()) == 0, d_s
    assert out_s == ref["S"][0] and _logprob_diff(ref["S"][1], lp_s) <= LOGPROB_TOL
    _no_scheduler_io(again, "state:disk->state:host")
