"""Re-warm at start: a restarted cache brings the prefixes its re-warm record names (what the
previous process used most and most recently) from the disk tier up to host, in the background,
into free host pages only, at the lowest transfer priority. One implementation for both engines.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from pathlib import Path

from ..cache import TieredCache
from ..cache.rewarm_record import load_record, record_path, save_record
from ..tiers.base import DISK, HOST
from ..transfer.executors import Executor
from ..transfer.ops import PromotionJob

log = logging.getLogger(__name__)

REWARM = "rewarm"  # the transfer kind (lowest priority; `CacheStats.prefetch["rewarm"]` counts its pages)


class Rewarm:
    """Brings the recorded prefixes disk -> host, one job at a time, while host has free pages.

    Contract:
    - `step()` (call it every engine step; it never waits) applies what landed, then plans the next
      recorded path: its disk pages are adopted into the tree (`cache.match`, no recency or traffic
      counted) and copied to host with `plan_promotion(kind="rewarm", target=HOST, evict=False)`:
      free host pages only, never an eviction. It stops for good when host has no free page, or the
      record is exhausted.
    - Its copies run at the lowest priority (behind demand loads, prefetches and write-back in the
      embedded engine; as speculative work, only while no demand is queued, in the threaded one);
      a demand load that needs a page still on its way takes it over (`RequestController.load`).
    - What it brought and what of that requests used: `cache.stats.prefetch["rewarm"]`
      (promoted / used / wasted tokens); `counters()` its own progress.
    - `shutdown()` cancels and releases the job in flight.
    """

    def __init__(self, cache: TieredCache, executor: Executor, paths: list[array], max_jobs: int = 1) -> None:
        self.cache = cache
        self.executor = executor
        self.paths = list(reversed(paths))  # popped from the end: most valuable first
        self.max_jobs = max_jobs
        self.jobs: list[PromotionJob] = []
        self.recorded_paths = len(paths)
        self.paths_done = 0
        self.stopped = "" if paths else "no record"

    @property
    def active(self) -> bool:
        return bool(self.jobs) or not self.stopped

    def step(self) -> None:
        if self.jobs:
            self.executor.poll()
            keep: list[PromotionJob] = []
            for job in self.jobs:
                if self.cache.advance(job):
                    self.cache.release(job)
                else:
                    keep.append(job)
            self.jobs = keep
        while not self.stopped and len(self.jobs) < self.max_jobs:
            if not self.paths:
                self.stopped = "record done"
                break
            if self.cache.stores[HOST].free_pages <= 0:
                self.stopped = "host full"
                break
            tokens = self.paths.pop()
            self.paths_done += 1
            m = self.cache.match(tokens, touch=False)
            if not m.disk_tokens:
                continue  # on host already, or no longer on disk
            planned = self.cache.plan_promotion(m, REWARM, HOST, evict=False)
            if planned is None:
                continue
            self.executor.submit_job(planned)
            self.jobs.append(planned)

    def shutdown(self) -> None:
        for job in self.jobs:
            self.executor.cancel(job.ops())
            self.cache.release(job)
        self.jobs = []
        self.stopped = self.stopped or "shut down"

    def counters(self) -> dict[str, object]:
        """Its progress: paths recorded and tried, why it stopped ("" while running)."""
        return {"recorded_paths": self.recorded_paths, "paths_done": self.paths_done, "stopped": self.stopped}


def rewarm_record_path(cache: TieredCache) -> Path | None:
    """Where `cache`'s re-warm record lives: None without a disk tier in a directory."""
    disk_dir = cache.config.disk_dir
    if not cache.has_tier(DISK) or not cache.has_tier(HOST) or disk_dir is None:
        return None
    return record_path(disk_dir, cache.tree.namespace)


def start_rewarm(cache: TieredCache, executor: Executor) -> Rewarm | None:
    """The re-warm of a cache that starts on a disk directory with a record; None when there is
    nothing to do (no disk or host tier, no record)."""
    path = rewarm_record_path(cache)
    paths = load_record(path) if path is not None else []
    if not paths:
        return None
    log.info("re-warm: %d recorded prefixes to bring from disk to host (%s)", len(paths), path)
    return Rewarm(cache, executor, paths)


def save_rewarm(cache: TieredCache) -> bool:
    """Record what `cache` used most, within its host tier's size, for the next process on its disk
    directory. False when there is no disk directory or it cannot be written."""
    path = rewarm_record_path(cache)
    if path is None:
        return False
    return save_record(path, cache.hottest_paths(cache.stores[HOST].capacity_pages))


class RewarmRecorder:
    """Saves the record every `every_s` seconds of `clock` (so a stop without `save_rewarm`, a crash
    or a killed process, loses at most that much), from `tick()`, which the engine calls every step.

    Contract: `tick()` reads the clock and, at most once per `every_s`, chooses the paths
    (`TieredCache.hottest_paths`, on the caller's thread: the tree is the caller's) and hands them to
    `write(path, paths)` (default: `save_record`, inline; the SGLang backend passes
    `RecordWriter.submit`, which writes on a thread of its own), unless they equal the last ones
    handed over. `saved` counts the records handed over."""

    def __init__(
        self,
        cache: TieredCache,
        every_s: float,
        clock: Callable[[], float],
        write: Callable[[Path, list[array]], object] = save_record,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"re-warm: the record interval must be > 0 s, got {every_s}")
        self.cache = cache
        self.every_s = every_s
        self.clock = clock
        self.write = write
        self.next_at = clock() + every_s
        self.path = rewarm_record_path(cache)
        self.saved = 0
        self._last: list[array] | None = None

    def tick(self) -> None:
        now = self.clock()
        if now < self.next_at or self.path is None:
            return
        self.next_at = now + self.every_s
        paths = self.cache.hottest_paths(self.cache.stores[HOST].capacity_pages)
        if paths == self._last:
            return  # nothing changed since the last record
        self._last = paths
        self.write(self.path, paths)
        self.saved += 1


__all__ = ["REWARM", "Rewarm", "RewarmRecorder", "rewarm_record_path", "save_rewarm", "start_rewarm"]
