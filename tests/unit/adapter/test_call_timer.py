"""The scheduler-thread call timer: wall time and the thread's CPU time per call, apart.

Wall minus CPU is what the thread spent not running (the GIL held by another thread of the process,
or no free core): the figure that tells a slow cache call from a starved scheduler thread."""

from __future__ import annotations

import threading
import time

from sgl_hicache.sglang.debug.call_timer import CallTimer


class _Cache:
    def match_prefix(self, seconds: float) -> None:
        time.sleep(seconds)  # waits: wall, no CPU

    def evict(self, seconds: float) -> int:
        end, n = time.thread_time() + seconds, 0
        while time.thread_time() < end:  # works: CPU ~= wall
            n += 1
        return n


def test_a_waiting_call_shows_wall_time_without_cpu_time_and_a_working_one_shows_both() -> None:
    cache = _Cache()
    timer = CallTimer().instrument(cache, ["match_prefix", "evict"])
    for _ in range(3):
        cache.match_prefix(0.03)
        assert cache.evict(0.03) > 0
    snap = timer.snapshot()
    waited, worked = snap["match_prefix"], snap["evict"]
    assert waited["count"] == worked["count"] == 3
    # one-sided bounds the semantics guarantee on any machine: a 30 ms sleep lasts at least 30 ms of
    # wall time and burns next to no CPU; a 30 ms busy loop burns at least 30 ms of CPU
    assert waited["p50_us"] >= 25_000 and waited["cpu_p99_us"] < waited["p50_us"] / 2
    assert worked["cpu_p50_us"] >= 25_000 and worked["p50_us"] >= worked["cpu_p50_us"] * 0.99


def test_cpu_time_is_the_calling_threads_only() -> None:
    """Another thread burning CPU meanwhile does not count toward the call's CPU time."""
    cache = _Cache()
    timer = CallTimer().instrument(cache, ["match_prefix"])
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=burn, daemon=True)
    t.start()
    try:
        cache.match_prefix(0.05)
    finally:
        stop.set()
        t.join()
    got = timer.snapshot()["match_prefix"]
    assert got["max_us"] >= 45_000 and got["cpu_max_us"] < got["max_us"] / 2


def test_the_io_guard_counts_disk_writes_made_through_write_from(tmp_path) -> None:
    """The host -> disk handler writes pages straight from the host's views (`write_from`), not
    through `write`: the guard must see those writes too, or a disk write on the scheduler thread
    would go uncounted (the e2e test's `disk_write_elsewhere` read 0)."""
    from conftest import make_cache, serve

    from sgl_hicache.sglang.debug.call_timer import IOGuard

    cache = make_cache(
        tmp_path, device=4, host=8, disk=32, write_policy="write_through", disk_write_policy="write_through"
    )
    guard = IOGuard().install(cache)
    serve(cache, list(range(16)))
    assert cache.stores["disk"].stored_pages > 0
    assert guard.snapshot().get("disk_write_elsewhere", 0) > 0
