"""Re-warm at start: a restarted embedded engine brings the prefixes the stopped one used to host
before requests ask; its copies are counted (brought, used) and never evict."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

from sgl_hicache.cache.rewarm_record import load_record, record_path, save_record
from sgl_hicache.replay.trace import Request
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig
from sgl_hicache.tiers.base import DISK, HOST

PAGE = 16
PREFIX = 256
SESSIONS = 6


def prefixes() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 50_000) for _ in range(PREFIX)] for _ in range(SESSIONS)]


def requests(ps: list[list[int]], tag: int, start: float) -> list[Request]:
    return [
        Request(f"{tag}.{i}", f"s{i}", start + 0.5 * i, array("q", p + [tag + i] * PAGE), 4, 0)
        for i, p in enumerate(ps)
    ]


def engine(d: Path, rewarm: bool, host_sessions: int = SESSIONS) -> EmbeddedEngine:
    return EmbeddedEngine(
        EngineConfig(
            policy="demote",
            model=get_model("llama3-8b"),
            hardware=get_hardware("h200"),
            device_tokens=2 * (PREFIX + 4 * PAGE),
            host_tokens=host_sessions * (PREFIX + 4 * PAGE),
            disk_tokens=4 * SESSIONS * (PREFIX + 4 * PAGE),
            page_size=PAGE,
            disk_dir=d,
            concurrency=None,
            rewarm=rewarm,
        )
    )


def served(d: Path, rewarm: bool, ps: list[list[int]], host_sessions: int = SESSIONS) -> EmbeddedEngine:
    e = engine(d, rewarm, host_sessions)
    e.run(requests(ps, 2000, 1.0))
    return e


def stopped(d: Path, ps: list[list[int]]) -> None:
    e = engine(d, rewarm=True)
    e.run(requests(ps, 1000, 0.0))
    e.close()


def test_a_restart_with_rewarm_serves_from_host_what_the_stopped_engine_used(tmp_path: Path) -> None:
    ps = prefixes()
    stopped(tmp_path, ps)
    paths = load_record(record_path(tmp_path, engine(tmp_path, False).cache.tree.namespace))
    assert paths and all(len(p) % PAGE == 0 for p in paths)
    e = served(tmp_path, True, ps)
    snap = e.cache.stats.snapshot()
    rw = snap["prefetch"]["rewarm"]
    assert snap["hit_tokens"][DISK] == 0 and snap["hit_tokens"][HOST] >= (SESSIONS - 1) * PREFIX
    assert rw["promoted_tokens"] >= rw["used_tokens"] >= snap["hit_tokens"][HOST]
    e.cache.check()


def test_without_rewarm_the_same_restart_reads_disk(tmp_path: Path) -> None:
    ps = prefixes()
    stopped(tmp_path, ps)
    snap = served(tmp_path, False, ps).cache.stats.snapshot()
    assert snap["hit_tokens"][DISK] >= (SESSIONS - 1) * PREFIX and snap["hit_tokens"][HOST] == 0
    assert snap["prefetch"]["rewarm"]["promoted_tokens"] == 0


def test_rewarm_fills_free_host_pages_only(tmp_path: Path) -> None:
    ps = prefixes()
    stopped(tmp_path, ps)
    e = engine(tmp_path, True, host_sessions=2)  # a smaller host than the record was made for
    e.begin([])
    rw = e.controller.rewarm
    assert rw is not None
    while rw.active:
        e.now += 1.0
        rw.step()
    assert rw.stopped in ("host full", "record done")
    assert e.cache.tree.pages[HOST] > 0
    assert e.cache.stats.snapshot()["evicted_tokens"][HOST] == 0
    assert e.cache.tree.pages[HOST] <= e.cache.stores[HOST].capacity_pages
    e.cache.check()


def test_a_record_that_is_not_one_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / ".shared" / "x.rewarm"
    assert save_record(path, [array("q", range(32))])
    assert [list(p) for p in load_record(path)] == [list(range(32))]
    path.write_bytes(path.read_bytes()[:-9])  # truncated
    assert load_record(path) == []
    path.write_bytes(b"SGLHRWRM\x02\x00\x00\x00\x01\x00\x00\x00")  # another version
    assert load_record(path) == []
    assert load_record(tmp_path / "absent.rewarm") == []
