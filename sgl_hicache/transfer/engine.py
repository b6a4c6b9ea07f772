"""The asynchronous transfer engine: worker threads that execute prepared transfers by priority.

Mechanism only: the cache plans jobs (allocations, pins, locks) and applies their results; the engine
moves bytes. Large ops are cut into page chunks so that the pages of one promotion are read from
disk by several workers at once (parallel reads are what turn a cold restore from a latency problem
into a bandwidth one); a copy between device and host memory is one torch call, cut only every
`MEMORY_CHUNK_BYTES`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..tiers.base import DEVICE, HOST, TierIOError
from .bandwidth import SpeculativePacer
from .handlers import CopyLinks
from .ops import Cancelled, PromotionJob, TransferOp
from .torch_threads import single_threaded_torch

# lower runs first: what a waiting request needs, then predictions, then backups and demotions
DEMAND, PREFETCH, PREDICT, BACKUP = 0, 0, 1, 2
DISK_BACKUP = 3  # host -> disk copies queue behind device -> host ones: those keep device evictions clean
MEMORY_TIERS = frozenset((DEVICE, HOST))
MEMORY_CHUNK_BYTES = 64 << 20  # a chunk of a device <-> host copy: a few ms of a PCIe link
PRIORITY = {
    "demand": DEMAND,
    "prefetch": PREFETCH,
    "predict": PREDICT,
    "promote": PREDICT,
    "rewarm": PREDICT,  # re-warm at start: speculative, only while no demand is queued
    "backup": BACKUP,
    "demote": BACKUP,
}


@dataclass(eq=False)
class _OpState:
    op: TransferOp
    priority: int
    chunks_left: int
    started: float = 0.0
    successors: list[TransferOp] = field(default_factory=list)


class TransferEngine:
    """Executes the ops of `PromotionJob`s on `workers` threads, in priority order.

    Contract:
    - `start()` / `stop()` are explicit; the constructor starts nothing. `stop()` finishes the copy
      each worker is in and cancels the rest (their ops end with `Cancelled`).
    - `submit(job)` queues the job's runnable ops; an op whose predecessor (disk->host before
      host->device) is still running is queued when the predecessor finishes.
    - Speculative work (`predict`) runs only while no demand or prefetch chunk is queued, at most
      `max_speculative_inflight` chunks at a time, and within `speculative_share` of the link's
      measured bandwidth (`SpeculativePacer`), so prediction never delays a waiting request nor
      saturates a link.
    - `wait(job, timeout)` blocks until every op of the job has executed; returns whether they all
      did (the caller then advances the job in the cache).
    - Handler failures are recorded on the op (`op.error`) and reported by the cache as a miss.
    """

    def __init__(
        self,
        links: CopyLinks,
        workers: int = 4,
        chunk_pages: int = 4,
        max_speculative_inflight: int = 1,
        speculative_share: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        memory_chunk_bytes: int = MEMORY_CHUNK_BYTES,
    ) -> None:
        if workers < 1 or chunk_pages < 1 or memory_chunk_bytes < 0:
            raise ValueError(
                "TransferEngine needs workers >= 1, chunk_pages >= 1 and memory_chunk_bytes >= 0, "
                f"got {workers}, {chunk_pages}, {memory_chunk_bytes}"
            )
        self.links = links
        self.workers = workers
        self.chunk_pages = chunk_pages
        self.memory_chunk_bytes = memory_chunk_bytes
        self.max_speculative_inflight = max_speculative_inflight
        self.pacer = SpeculativePacer(links.meter, share=speculative_share, clock=clock)
        self._queue: list[tuple[int, int, _OpState, int, int]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._running = False
        self._urgent_queued = 0
        self._speculative_inflight = 0
        self._states: dict[int, _OpState] = {}
        self.chunks_done = 0

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> TransferEngine:
        with self._cv:
            if self._running:
                return self
            self._running = True
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"sgl-hicache-transfer-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        with self._cv:
            self._running = False
            pending = self._queue
            self._queue = []
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads.clear()
        with self._cv:
            # a worker that finished an op while stopping queued its successor after the swap above
            pending += self._queue
            self._queue = []
            self._urgent_queued = 0
            self._speculative_inflight = 0
        for _, _, state, _, _ in pending:
            self._cancel_state(state)

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- submission ----------------------------------------------------------------------
    def submit(self, job: PromotionJob) -> PromotionJob:
        priority = PRIORITY.get(job.kind, DEMAND)
        runnable = set(map(id, job.runnable()))
        with self._cv:
            for st in job.stages:
                states = [_OpState(op, priority, 0) for op in st.ops]
                for a, b in zip(states, states[1:]):
                    a.successors.append(b.op)
                for state in states:
                    state.op.submitted = True
                    self._states[id(state.op)] = state
                for state in states:
                    if id(state.op) in runnable:
                        self._enqueue(state)
            self._cv.notify_all()
        return job

    def submit_ops(self, ops: Iterable[TransferOp], kind: str = "backup") -> None:
        """Queue independent prepared ops (backups, demotions); the caller completes them."""
        with self._cv:
            for op in ops:
                priority = PRIORITY.get(kind, BACKUP)
                if priority == BACKUP and op.src != "device":
                    priority = DISK_BACKUP
                state = _OpState(op, priority, 0)
                op.submitted = True
                self._states[id(op)] = state
                self._enqueue(state)
            self._cv.notify_all()

    def cancel(self, ops: Iterable[TransferOp]) -> None:
        """Cancel prepared ops: their queued chunks are dropped now, so an op no worker has started
        ends at once; a chunk a worker is copying finishes first. Every op given ends with `executed`
        set and `Cancelled` (unless it had already finished), a never-submitted op included; the
        caller completes it in the cache. Works on a stopped engine too."""
        ops = list(ops)
        ids = {id(op) for op in ops}
        with self._cv:
            for op in ops:
                op.cancelled = True
            keep = []
            for item in self._queue:
                queued = item[2]
                if id(queued.op) in ids:
                    queued.chunks_left -= 1
                    if queued.priority <= PREFETCH:
                        self._urgent_queued -= 1
                else:
                    keep.append(item)
            if len(keep) != len(self._queue):
                heapq.heapify(keep)
                self._queue = keep
            for op in ops:
                state = self._states.get(id(op))
                if state is not None:
                    if state.chunks_left == 0:
                        self._cancel_state(state, locked=True)
                elif not op.executed.is_set():  # prepared but never submitted: nothing will run it
                    op.error = Cancelled()
                    op.executed.set()
            self._cv.notify_all()

    def _chunk_pages_of(self, op: TransferOp) -> int:
        """Pages per chunk of `op`: `chunk_pages` on a link with a disk (or store) end, where parallel
        per-page reads pay; a copy between memories is one torch call per chunk, so it is cut only
        every `memory_chunk_bytes` (smaller chunks add only the workers' Python work, which holds the
        GIL the scheduler thread waits for)."""
        n = len(op.dst_handles)
        if op.src not in MEMORY_TIERS or op.dst not in MEMORY_TIERS or not n:
            return self.chunk_pages
        return max(self.chunk_pages, self.memory_chunk_bytes * n // max(1, op.nbytes))

    def _enqueue(self, state: _OpState) -> None:
        n = len(state.op.dst_handles)
        step = self._chunk_pages_of(state.op)
        chunks = [(i, min(n, i + step)) for i in range(0, n, step)] or [(0, 0)]
        state.chunks_left = len(chunks)
        for start, stop in chunks:
            heapq.heappush(self._queue, (state.priority, next(self._seq), state, start, stop))
            if state.priority <= PREFETCH:
                self._urgent_queued += 1

    def wait(self, job: PromotionJob, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for op in job.ops():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not op.executed.wait(remaining):
                return False
        return True

    def queued(self) -> int:
        with self._cv:
            return len(self._queue)

    # ---- workers -------------------------------------------------------------------------
    def _next(self) -> tuple[_OpState, int, int] | None:
        with self._cv:
            while True:
                if not self._running:
                    return None
                if self._queue:
                    priority, _, head, h_start, h_stop = self._queue[0]
                    speculative = priority == PREDICT
                    if not speculative or (
                        self._urgent_queued == 0
                        and self._speculative_inflight < self.max_speculative_inflight
                        and self.pacer.try_take(head.op.link, self._chunk_bytes(head.op, h_start, h_stop))
                    ):
                        _, _, state, start, stop = heapq.heappop(self._queue)
                        if state.priority <= PREFETCH:
                            self._urgent_queued -= 1
                        if speculative:
                            self._speculative_inflight += 1
                        return state, start, stop
                self._cv.wait(0.05)

    @staticmethod
    def _chunk_bytes(op: TransferOp, start: int, stop: int) -> int:
        return op.nbytes * (stop - start) // max(1, len(op.dst_handles))

    def _work(self) -> None:
        single_threaded_torch()  # our copies must not start OpenMP teams beside the forward's
        while True:
            item = self._next()
            if item is None:
                return
            state, start, stop = item
            op = state.op
            t0 = time.perf_counter()
            failure: BaseException | None = None
            if not op.cancelled and op.error is None and stop > start:
                try:
                    self.links.handlers[(op.src, op.dst)](op, start, stop)
                except (TierIOError, OSError, KeyError, ValueError, RuntimeError) as exc:
                    failure = exc
            elapsed = time.perf_counter() - t0
            if failure is None and op.error is None and not op.cancelled:
                self.links.meter.record(op.link, self._chunk_bytes(op, start, stop), elapsed)
            with self._cv:
                if failure is not None:  # under the lock: another worker may be failing a chunk of this op
                    op.record_error(failure)
                op.seconds += elapsed
                if state.priority == PREDICT:
                    self._speculative_inflight -= 1
                self.chunks_done += 1
                state.chunks_left -= 1
                if state.chunks_left > 0:
                    continue
                self._states.pop(id(op), None)
                if op.cancelled and op.error is None:
                    op.error = Cancelled()
                op.executed.set()
                for succ in state.successors:
                    succ_state = self._states.get(id(succ))
                    if succ_state is None:
                        continue
                    if op.error is not None:
                        self._cancel_state(succ_state, locked=True)
                    else:
                        self._enqueue(succ_state)
                self._cv.notify_all()

    def _cancel_state(self, state: _OpState, locked: bool = False) -> None:

        op = state.op
        op.cancelled = True
        if op.error is None:
            op.error = Cancelled()
        self._states.pop(id(op), None)
        op.executed.set()
        for succ in state.successors:
            succ_state = self._states.get(id(succ))
            if succ_state is not None:
                self._cancel_state(succ_state, locked)
