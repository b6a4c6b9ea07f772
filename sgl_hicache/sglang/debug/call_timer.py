"""Time spent on SGLang's scheduler thread inside each cache call, and a guard that catches I/O there.

`CallTimer.instrument(cache, names)` wraps the named methods of one cache object (on the instance:
the class and SGLang are untouched) so that every call records its wall time and the scheduler
thread's CPU time in it. `snapshot()` gives, per call name, `count`, `total_s`, `mean_us`, `p50_us`,
`p99_us`, `max_us` (wall) and `cpu_p50_us`, `cpu_p99_us`, `cpu_max_us`; percentiles are over the last
`window` calls of that name (max and count over all of them). Wall minus CPU is time the thread was
not running: waiting for the GIL (another thread of the process) or for a core (another process).
Recording is two clock pairs and two appends, about a microsecond, so it stays on by default.

`IOGuard` (a test and diagnosis aid, off by default: setting `check_scheduler_io`) counts what must
never run on the scheduler thread while it is inside one of those calls: a copy of bytes between tiers
(any of `TieredCache.handlers`, inline or chunked), a disk page write, a `time.sleep`, and a wait on a
`threading.Event` that was not set yet (except a new thread's start-up handshake). `snapshot()` gives
those counts (copies also per link, `copy_by_link`; the state snapshots' movers of a hybrid model
are in that table too, `mamba_moves`), plus `copy_elsewhere` / `disk_write_elsewhere`: the same seen on other threads (the
transfer engine's; copies also per link, `copy_elsewhere_by_link`), which show the guard is watching. Layer-wise loads run outside the handlers, on
their own worker: they are not copies made by the scheduler thread. The patches are process-wide (`time.sleep`, `threading.Event.wait`)
but cost one thread-local read outside instrumented calls.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Any

# the calls SGLang 0.5.23's scheduler makes into a radix cache (`BasePrefixCache`), except the O(1)
# size getters it polls thousands of times a second, plus our per-step hook (`scheduler_hooks`)
SCHEDULER_CALLS = (
    "match_prefix",
    "init_load_back",
    "checkpoint",
    "insert",
    "evict",
    "inc_lock_ref",
    "dec_lock_ref",
    "on_release",
    "release_aborted_request",
    "touch_prefix",
    "path_device_indices",
    "cache_finished_req",
    "cache_unfinished_req",
    "before_batch_formed",
    "after_batch_formed",
)

_tls = threading.local()  # .depth: how many instrumented calls the current thread is inside


def in_scheduler_call() -> bool:
    """Whether the current thread is inside an instrumented cache call."""
    return getattr(_tls, "depth", 0) > 0


class _Series:
    __slots__ = ("count", "total", "max", "ring", "pos", "window")

    def __init__(self, window: int) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.ring = array("d")
        self.pos = 0
        self.window = window

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds
        if len(self.ring) < self.window:
            self.ring.append(seconds)
        else:
            self.ring[self.pos] = seconds
            self.pos = (self.pos + 1) % self.window

    def summary(self) -> dict[str, float]:
        values = sorted(self.ring)  # a copy: the scheduler may append meanwhile
        n = len(values)

        def pct(q: float) -> float:
            return values[min(n - 1, int(q * n))] * 1e6 if n else 0.0

        return {
            "count": self.count,
            "total_s": round(self.total, 6),
            "mean_us": round(self.total / self.count * 1e6, 2) if self.count else 0.0,
            "p50_us": round(pct(0.50), 2),
            "p99_us": round(pct(0.99), 2),
            "max_us": round(self.max * 1e6, 2),
        }


class CallTimer:
    """Per-call wall time of the wrapped methods (module docstring). Appends come from one thread
    (SGLang's scheduler); `snapshot` may run on another (the stats publisher)."""

    def __init__(self, window: int = 65536) -> None:
        self.window = window
        self.series: dict[str, _Series] = {}
        self.cpu_series: dict[str, _Series] = {}

    def record(self, name: str, seconds: float, cpu_seconds: float | None = None) -> None:
        for table, value in ((self.series, seconds), (self.cpu_series, cpu_seconds)):
            if value is None:
                continue
            s = table.get(name)
            if s is None:
                s = table[name] = _Series(self.window)
            s.add(value)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        record, clock, cpu_clock = self.record, time.perf_counter, time.thread_time

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            _tls.depth = getattr(_tls, "depth", 0) + 1
            t0, c0 = clock(), cpu_clock()
            try:
                return fn(*args, **kwargs)
            finally:
                record(name, clock() - t0, cpu_clock() - c0)
                _tls.depth -= 1

        return timed

    def instrument(self, obj: object, names: Iterable[str] = SCHEDULER_CALLS) -> CallTimer:
        """Wrap `obj`'s methods `names` (those it has) on the instance."""
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, self.wrap(name, fn))
        return self

    def snapshot(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, s in sorted(self.series.items()):
            out[name] = s.summary()
            cpu = self.cpu_series.get(name)
            if cpu is not None:
                c = cpu.summary()
                out[name].update(cpu_p50_us=c["p50_us"], cpu_p99_us=c["p99_us"], cpu_max_us=c["max_us"])
        return out


class IOGuard:
    """Counts I/O and waits made inside instrumented calls (module docstring). One per process."""

    KINDS = ("copy", "disk_write", "sleep", "event_wait")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.KINDS, 0)
        self.elsewhere: dict[str, int] = {}  # copies and disk writes on other threads: the guard is watching
        self.links: dict[str, int] = {}  # scheduler-thread copies per link ("device->host": eviction demotion)
        self.links_elsewhere: dict[str, int] = {}  # the same on other threads
        self.where: dict[str, str] = {}  # kind -> the first offending call's stack summary
        self._installed = False

    def _hit(self, kind: str) -> None:
        self.counts[kind] += 1
        if kind not in self.where:
            import traceback

            self.where[kind] = "".join(traceback.format_stack(limit=12)[:-2])

    def install(self, cache: Any) -> IOGuard:
        """Watch `cache` (a `TieredCache`): its link handlers (every copy between tiers), its disk
        store's writes, and the process's `time.sleep` / `threading.Event.wait`."""
        for (src, dst), handler in list(cache.handlers.items()):  # every byte copy between tiers, any caller
            cache.handlers[(src, dst)] = self._watch("copy", handler, f"{src}->{dst}")
        disk = cache.stores.get("disk")
        if disk is not None:
            for name in ("write", "write_from"):  # every way a page reaches the disk
                fn = getattr(disk, name, None)
                if callable(fn):
                    setattr(disk, name, self._watch("disk_write", fn))
        if not IOGuard._process_patched:
            IOGuard._process_patched = True
            sleep, wait = time.sleep, threading.Event.wait

            def guarded_sleep(seconds: float) -> None:
                if in_scheduler_call() and _ACTIVE:
                    for g in _ACTIVE:
                        g._hit("sleep")
                return sleep(seconds)

            thread_start = threading.Thread.start.__code__

            def guarded_wait(ev: threading.Event, timeout: float | None = None) -> bool:
                # (a thread's start waits for its bootstrap: not I/O; the engine starts once)
                if _ACTIVE and in_scheduler_call() and not ev.is_set() and sys._getframe(1).f_code is not thread_start:
                    for g in _ACTIVE:
                        g._hit("event_wait")
                return wait(ev, timeout)

            time.sleep = guarded_sleep  # type: ignore[assignment]
            threading.Event.wait = guarded_wait  # type: ignore[assignment]
        _ACTIVE.append(self)
        return self

    _process_patched = False

    def _watch(self, kind: str, fn: Callable[..., Any], link: str | None = None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if in_scheduler_call():
                self._hit(kind)
                if link is not None:
                    self.links[link] = self.links.get(link, 0) + 1
            else:
                self.elsewhere[kind] = self.elsewhere.get(kind, 0) + 1
                if link is not None:
                    self.links_elsewhere[link] = self.links_elsewhere.get(link, 0) + 1
            return fn(*args, **kwargs)

        return watched

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.counts,
            "copy_by_link": dict(self.links),
            "copy_elsewhere_by_link": dict(self.links_elsewhere),
            **{f"{k}_elsewhere": v for k, v in self.elsewhere.items()},
            "first_offender": dict(self.where),
        }


_ACTIVE: list[IOGuard] = []

__all__ = ["CallTimer", "IOGuard", "SCHEDULER_CALLS", "in_scheduler_call"]
