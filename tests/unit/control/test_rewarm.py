"""Re-warm at start: a restarted embedded engine brings the prefixes the stopped one used to host
before requests ask; its copies are counted (brought, used) and never evict."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

from sgl_hicache.cache.rewarm_record import load_record, record_path, save_record
from sgl_hicache.control.rewarm import RewarmRecorder
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


def test_the_recorder_hands_over_a_record_once_per_interval_and_only_when_it_changed(tmp_path: Path) -> None:
    ps = prefixes()
    e = served(tmp_path, False, ps)
    now = [100.0]
    written: list[tuple[Path, list[array]]] = []
    rec = RewarmRecorder(e.cache, 10.0, lambda: now[0], write=lambda p, paths: written.append((p, paths)))
    rec.tick()
    assert written == []  # not due yet
    now[0] += 10.0
    rec.tick()
    assert len(written) == 1 and rec.saved == 1
    path, paths = written[0]
    assert path == record_path(tmp_path, e.cache.tree.namespace)
    assert paths == e.cache.hottest_paths(e.cache.stores[HOST].capacity_pages) and paths
    now[0] += 10.0
    rec.tick()
    assert len(written) == 1  # the tree did not change: nothing handed over
    e.run(requests([[7] * PREFIX], 3000, e.now + 1.0))  # a new prefix, used last
    now[0] += 10.0
    rec.tick()
    assert len(written) == 2 and list(written[1][1][0][:PREFIX]) == [7] * PREFIX


def test_the_record_writer_writes_on_its_own_thread_the_latest_record(tmp_path: Path, monkeypatch) -> None:
    import threading

    from sgl_hicache.cache import rewarm_record

    threads: list[str] = []
    real = rewarm_record.save_record

    def spy(path: Path, paths: list[array]) -> bool:
        threads.append(threading.current_thread().name)
        return real(path, paths)

    monkeypatch.setattr(rewarm_record, "save_record", spy)
    w = rewarm_record.RecordWriter()
    path = tmp_path / ".shared" / "n.rewarm"
    w.submit(path, [array("q", range(16))])
    w.submit(path, [array("q", range(32))])
    w.close()
    assert threads and threading.current_thread().name not in threads
    assert [list(p) for p in load_record(path)] == [list(range(32))]  # the latest record won
    assert w.written == len(threads) and w.failed == 0
    w.submit(path, [array("q", range(48))])  # after close: ignored
    assert [list(p) for p in load_record(path)] == [list(range(32))]


def test_the_server_rewarm_brings_the_record_to_host_and_keeps_the_next_one(tmp_path: Path) -> None:
    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.rewarm_calls import ServerRewarm

    ps = prefixes()
    stopped(tmp_path, ps)
    path = record_path(tmp_path, engine(tmp_path, False).cache.tree.namespace)
    assert path.exists()
    e = engine(tmp_path, rewarm=False)
    e.begin([])
    now = [0.0]
    srv = ServerRewarm(e.cache, e.controller, BackendSettings(rewarm_interval_s=5.0), clock=lambda: now[0])
    assert e.controller.rewarm is not None and srv.counters()["enabled"]
    while e.controller.rewarm.active:
        e.now += 1.0
        srv.step()
    c = srv.counters()
    assert c["stopped"] in ("host full", "record done") and c["jobs_in_flight"] == 0, c
    assert e.cache.tree.pages[HOST] * PAGE >= (SESSIONS - 1) * PREFIX
    assert e.cache.stats.snapshot()["prefetch"]["rewarm"]["promoted_tokens"] > 0
    path.unlink()
    now[0] = 5.0
    srv.step()  # due: the record is chosen here and written by the writer's thread
    assert srv.counters()["records_saved"] == 1
    assert srv.writer is not None
    srv.writer.close()  # waits for its write
    assert load_record(path)
    path.unlink()
    srv.stop()  # a clean stop saves one more
    recorded = load_record(path)
    assert recorded and {tuple(p[:PREFIX]) for p in recorded} <= {tuple(p) for p in ps}
    e.cache.check()


def test_the_server_rewarm_is_off_when_the_ranks_would_have_to_agree_or_the_setting_says_so(tmp_path: Path) -> None:
    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.rewarm_calls import ServerRewarm

    stopped(tmp_path, prefixes())
    for kwargs, settings, why in (
        ({"ranks_agree": True}, BackendSettings(), "TP >= 2"),
        ({}, BackendSettings(rewarm=False), "rewarm=false"),
        ({"cache_disabled": True}, BackendSettings(), "disabled"),
    ):
        e = engine(tmp_path, rewarm=False)
        srv = ServerRewarm(e.cache, e.controller, settings, **kwargs)
        srv.step()
        srv.stop()
        assert e.controller.rewarm is None and not srv.counters()["enabled"]
        assert why in srv.counters()["disabled"]
