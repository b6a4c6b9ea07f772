"""Executors: what runs the transfer ops the cache planned. The controller plans; an executor moves
the bytes; finished work comes back as data on the ops themselves (`op.executed`, `op.error`),
which the controller applies with `TieredCache.advance` / `complete` on its own thread. No
executor calls back into the cache's bookkeeping.

- `ThreadExecutor`: real bytes on worker threads (the SGLang server on any machine), over the
  priority `TransferEngine`.
- `VirtualExecutor`: the same ops for the embedded engine: each link is a FIFO pipe in virtual
  time at a bandwidth the caller gives (the cost model); an op's bytes are really copied when its
  virtual finish time is reached.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..tiers.base import DEVICE, DISK, HOST
from .handlers import CopyLinks, execute
from .ops import Cancelled, PromotionJob, TransferOp

if TYPE_CHECKING:
    from .engine import TransferEngine


@dataclass(frozen=True)
class LoadTime:
    """Seconds a demand load costs the step that needs it: `blocking` must pass before the forward
    can start (disk reads land in host first); `overlapped` runs layer by layer beside it."""

    blocking: float = 0.0
    overlapped: float = 0.0


class Executor(ABC):
    """Moves the bytes of prepared ops. Contract:
    - `submit_job(job)` queues a promotion's ops (a stage's ops in order); `submit_ops(ops, kind)`
      queues independent ops (background write-back). Both return at once.
    - `poll()` makes progress that is due (virtual time); a no-op where threads do the work.
    - `eta(job)` estimates the seconds until every op of the job has executed (0 when done).
    - `cancel(ops)` stops ops not yet copied; each ends with `executed` set (`Cancelled` unless it
      had finished). The caller completes them in the cache.
    - `run_now(job)` executes a job's ops inline (a demand load) and says what it cost.
    - `expedite(ops, max_wait_s)`: a demand load needs nodes other jobs' ops are still bringing up:
      finish now those that land within `max_wait_s` (sooner than recomputing them), a queue
      prefetch at demand priority, where the executor can without waiting on the caller's thread;
      returns the seconds the demand load must block for them (the base class: nothing).
    Every op given to an executor ends with `executed` set, unless the executor is stopped first.
    """

    @abstractmethod
    def submit_job(self, job: PromotionJob, speculative: bool = False) -> None: ...

    @abstractmethod
    def submit_ops(self, ops: Sequence[TransferOp], kind: str = "backup") -> None: ...

    def poll(self) -> None:
        return None

    @abstractmethod
    def eta(self, job: PromotionJob) -> float: ...

    @abstractmethod
    def cancel(self, ops: Iterable[TransferOp]) -> None: ...

    @abstractmethod
    def run_now(self, job: PromotionJob) -> LoadTime: ...

    def expedite(self, ops: Sequence[TransferOp], max_wait_s: float = math.inf) -> float:
        return 0.0

    def read_eta(self, tokens: int) -> float:
        """Seconds from now until a demand read of `tokens` disk -> host would land (0 where the
        executor cannot tell: the server never reads disk at admission)."""
        return 0.0

    def link_tokens_per_s(self, link: str) -> float:
        """Tokens per second `link` moves (0 where the executor cannot tell)."""
        return 0.0

    def ops_eta(self, ops: Sequence[TransferOp]) -> float:
        """Seconds from now until every op of `ops` (queued already) has executed (0 where the
        executor cannot tell)."""
        return 0.0

    def stop(self) -> None:
        return None


class LayerSink(Protocol):
    """Where a `ThreadExecutor` hands host -> device demand loads to be copied layer by layer
    (`sglang.layer_loads.LayerLoads`): `queue(ops)` starts them and marks them executed."""

    def queue(self, ops: Sequence[TransferOp]) -> None: ...


class ThreadExecutor(Executor):
    """Real copies on the `TransferEngine`'s worker threads, started on first use. With `layers`, a
    demand load's host -> device ops are queued there (layer by layer, off the calling thread)
    instead of copied inline by `run_now`."""

    def __init__(
        self, links: CopyLinks, engine: TransferEngine, layers: LayerSink | None = None, bytes_per_token: int = 0
    ) -> None:
        self.links = links
        self.engine = engine
        self.layers = layers
        self.bytes_per_token = bytes_per_token  # of the KV the links move (sizes `link_tokens_per_s`)

    def submit_job(self, job: PromotionJob, speculative: bool = False) -> None:
        self.engine.start().submit(job)  # the job's kind sets its priority (predict below demand)

    def submit_ops(self, ops: Sequence[TransferOp], kind: str = "backup") -> None:
        self.engine.start().submit_ops(ops, kind=kind)

    def eta(self, job: PromotionJob) -> float:
        return sum(self.links.meter.seconds_for(link, n) for link, n in job.remaining_bytes().items())

    def link_tokens_per_s(self, link: str) -> float:
        """The link's measured rate, in tokens of `bytes_per_token` (0 until one is given)."""
        return self.links.meter.estimate(link) / self.bytes_per_token if self.bytes_per_token else 0.0

    def cancel(self, ops: Iterable[TransferOp]) -> None:
        self.engine.cancel(ops)

    def run_now(self, job: PromotionJob) -> LoadTime:
        layered = []
        for st in job.stages:
            for op in st.ops:
                if op.executed.is_set():
                    continue
                if self.layers is not None and (op.src, op.dst) == (HOST, DEVICE):
                    layered.append(op)
                else:
                    execute(op, self.links.handlers)
        if layered:
            self.layers.queue(layered)  # type: ignore[union-attr]
        return LoadTime()

    def stop(self) -> None:
        self.engine.stop()


class VirtualPipes:
    """Each link is a pipe in virtual time; disk reads and writes share one pipe, the disk.
    `seconds(link, tokens)` is the caller's cost model.

    Three priorities, as in the threaded `TransferEngine`:
    - `schedule` (demand loads and write-back, `backup=True` for the latter) is FIFO among itself
      and ignores queued low-priority work;
    - `schedule_speculative` (a prediction's copies) queues behind the demand loads and the earlier
      speculative copies, and ahead of write-back: write-back queued that would still run after it
      starts is pushed back by its duration;
    - `schedule_low` (the queue prefetch) goes behind everything.
    A copy that goes ahead of queued work pushes that work back by its own duration and tells
    `on_preempt(pipe, start, duration, backup)` (`backup`: write-back was pushed too), so that the
    owner of those copies can move their finish times. Every copy pays its link time: nothing runs free."""

    _PIPES: ClassVar[dict[str, str]] = {"disk->host": "disk", "host->disk": "disk"}

    def __init__(self, seconds: Callable[[str, int], float]) -> None:
        self.seconds = seconds
        self.busy_until: dict[str, float] = {}  # every copy, low priority included
        self.high_until: dict[str, float] = {}  # demand, speculative and write-back copies
        self.ahead_until: dict[str, float] = {}  # demand and speculative copies (what a speculative copy queues behind)
        self.on_preempt: Callable[[str, float, float, bool], None] | None = None

    def pipe(self, link: str) -> str:
        return self._PIPES.get(link, link)

    def schedule(self, link: str, tokens: int, earliest: float, backup: bool = False) -> float:
        """A normal-priority copy: after the normal copies queued, ahead of queued low-priority ones."""
        pipe = self.pipe(link)
        start = max(earliest, self.high_until.get(pipe, 0.0))
        duration = self.seconds(link, tokens)
        finish = start + duration
        self.high_until[pipe] = finish
        if not backup:
            self.ahead_until[pipe] = finish
        tail = self.busy_until.get(pipe, 0.0)
        if tail > start:  # low-priority work was queued: it waits for this copy
            self.busy_until[pipe] = tail + duration
            if self.on_preempt is not None:
                self.on_preempt(pipe, start, duration, False)
        else:
            self.busy_until[pipe] = finish
        return finish

    def schedule_speculative(self, link: str, tokens: int, earliest: float) -> float:
        """A speculative copy: after the demand and speculative copies queued, ahead of queued
        write-back and low-priority copies (which it pushes back)."""
        pipe = self.pipe(link)
        start = max(earliest, self.ahead_until.get(pipe, 0.0))
        duration = self.seconds(link, tokens)
        finish = start + duration
        self.ahead_until[pipe] = finish
        high = self.high_until.get(pipe, 0.0)
        tail = self.busy_until.get(pipe, 0.0)
        self.high_until[pipe] = high + duration if high > start else finish
        self.busy_until[pipe] = tail + duration if tail > start else finish
        if tail > start and self.on_preempt is not None:
            self.on_preempt(pipe, start, duration, True)
        return finish

    def schedule_low(self, link: str, tokens: int, earliest: float) -> float:
        """A low-priority copy: after everything queued on its pipe."""
        pipe = self.pipe(link)
        finish = max(earliest, self.busy_until.get(pipe, 0.0)) + self.seconds(link, tokens)
        self.busy_until[pipe] = finish
        return finish

    def tokens_per_s(self, link: str, tokens: int = 1 << 16) -> float:
        """The link's rate (tokens per second) for a copy of `tokens`."""
        seconds = self.seconds(link, tokens)
        return tokens / seconds if seconds > 0 else 0.0


class VirtualExecutor(Executor):
    """The embedded engine's executor: ops finish at virtual times on `VirtualPipes`, and their bytes
    are copied (really, through the stores) when `poll()` sees the clock pass that time.
    `executed_bytes[link]` counts what it copied, so the engine can tell these copies from the ones
    the cache made inline."""

    def __init__(self, links: CopyLinks, pipes: VirtualPipes, clock: Callable[[], float], page_size: int) -> None:
        self.links = links
        self.pipes = pipes
        self.clock = clock
        self.page_size = page_size
        self.finish: dict[int, float] = {}  # id(op) -> virtual finish time
        self._ops: dict[int, TransferOp] = {}
        self.executed_bytes: dict[str, int] = {}
        self._low: dict[int, str] = {}  # id(op) -> pipe, for queue-prefetch copies (low priority)
        self._backup: dict[int, str] = {}  # id(op) -> pipe, for write-back copies (a speculative copy goes first)
        pipes.on_preempt = self._preempted

    def _tokens(self, op: TransferOp) -> int:
        return len(op.dst_handles) * self.page_size

    def submit_job(self, job: PromotionJob, speculative: bool = False) -> None:
        """Queue a job's copies. A queue prefetch (`job.kind == "prefetch"`) has low priority: demand
        loads and write-back go ahead of it (as in `TransferEngine`), so it never delays them; a re-warm
        at start (`job.kind == "rewarm"`) likewise. A
        speculative copy (a prediction) pays its link time like any other, behind the demand loads
        queued and ahead of queued write-back (`VirtualPipes.schedule_speculative`)."""
        now = self.clock()
        low = job.kind in ("prefetch", "rewarm") and not speculative
        for st in job.stages:
            t = now
            for op in st.ops:  # a stage's ops run in order (disk -> host before host -> device)
                if low:
                    t = self.pipes.schedule_low(op.link, self._tokens(op), t)
                    self._low[id(op)] = self.pipes.pipe(op.link)
                elif speculative:
                    t = self.pipes.schedule_speculative(op.link, self._tokens(op), t)
                else:
                    t = self.pipes.schedule(op.link, self._tokens(op), t)
                self._track(op, t)

    def _preempted(self, pipe: str, start: float, duration: float, backup: bool = False) -> None:
        """A copy went ahead of queued ones on `pipe` (low-priority ones; with `backup`, write-back
        too): those still running after `start` finish `duration` later."""
        for queued in (self._low, self._backup) if backup else (self._low,):
            for key, p in queued.items():
                if p == pipe and self.finish.get(key, -math.inf) > start:
                    self.finish[key] += duration

    def submit_ops(self, ops: Sequence[TransferOp], kind: str = "backup") -> None:
        now = self.clock()
        backup = kind != "demand"
        for op in ops:
            self._track(op, self.pipes.schedule(op.link, self._tokens(op), now, backup=backup))
            if backup:
                self._backup[id(op)] = self.pipes.pipe(op.link)

    def link_tokens_per_s(self, link: str) -> float:
        return self.pipes.tokens_per_s(link)

    def _track(self, op: TransferOp, finish: float) -> None:
        op.submitted = True
        self.finish[id(op)] = finish
        self._ops[id(op)] = op

    def poll(self) -> None:
        if not self._ops:
            return  # (the engine polls several times a step; most steps have nothing in flight)
        now = self.clock()
        finish = self.finish
        due = [op for key, op in self._ops.items() if finish[key] <= now]
        if len(due) > 1:
            due.sort(key=lambda o: finish[id(o)])
        for op in due:
            self._execute(op)

    def _execute(self, op: TransferOp) -> None:
        self._ops.pop(id(op), None)
        self._low.pop(id(op), None)
        self._backup.pop(id(op), None)
        self.finish.pop(id(op), None)
        if not op.executed.is_set():
            execute(op, self.links.handlers)
            if op.error is None:
                self.executed_bytes[op.link] = self.executed_bytes.get(op.link, 0) + op.nbytes

    def next_event(self) -> float | None:
        """The earliest virtual time at which an op in flight finishes."""
        return min(self.finish.values()) if self.finish else None

    def eta(self, job: PromotionJob) -> float:
        return self.ops_eta(job.ops())

    def ops_eta(self, ops: Sequence[TransferOp]) -> float:
        times = [self.finish.get(id(op), math.inf) for op in ops if not op.executed.is_set()]
        return max(0.0, max(times) - self.clock()) if times else 0.0

    def expedite(self, ops: Sequence[TransferOp], max_wait_s: float = math.inf) -> float:
        """Copy now the ops still in flight that land within `max_wait_s` (a queue prefetch requeued
        at demand priority, so no later than where it was queued); the others stay queued (the demand
        load stops at them and the rest is recomputed). Returns the seconds until the last copied one
        would have landed."""
        now = self.clock()
        end = now
        for op in ops:
            if id(op) not in self._ops:
                continue
            finish = self.finish[id(op)]
            if id(op) in self._low:
                pipe = self.pipes.pipe(op.link)
                finish = min(
                    finish,
                    max(now, self.pipes.high_until.get(pipe, 0.0)) + self.pipes.seconds(op.link, self._tokens(op)),
                )
            if finish - now > max_wait_s:
                continue
            if id(op) in self._low:
                del self._low[id(op)]
                del self.finish[id(op)]  # out of the low queue before it pushes that queue back
                finish = min(finish, self.pipes.schedule(op.link, self._tokens(op), now))
            end = max(end, finish)
            self._execute(op)
        return end - now

    def read_eta(self, tokens: int) -> float:
        """A demand read queues behind the disk's normal-priority work (write-back included)."""
        now = self.clock()
        return (
            max(now, self.pipes.high_until.get(self.pipes.pipe("disk->host"), 0.0))
            + self.pipes.seconds("disk->host", tokens)
            - now
        )

    def demand_eta(self, job: PromotionJob) -> float:
        """Seconds from now until the job's copies not done yet would land if they were queued now
        as a demand load (normal priority, ahead of queued prefetches)."""
        now = self.clock()
        ends: dict[str, float] = {}
        for op in job.ops():
            if op.executed.is_set():
                continue
            pipe = self.pipes.pipe(op.link)
            start = ends.get(pipe, max(now, self.pipes.high_until.get(pipe, 0.0)))
            ends[pipe] = start + self.pipes.seconds(op.link, self._tokens(op))
        return max(ends.values(), default=now) - now

    def finish_all(self, ops: Iterable[TransferOp]) -> None:
        """Copy now the bytes of ops still in flight (the caller waited for them)."""
        for op in sorted(ops, key=lambda o: self.finish.get(id(o), 0.0)):
            if id(op) in self._ops:
                self._execute(op)

    def cancel(self, ops: Iterable[TransferOp]) -> None:

        for op in ops:
            op.cancelled = True
            self._ops.pop(id(op), None)
            self._low.pop(id(op), None)
            self._backup.pop(id(op), None)
            self.finish.pop(id(op), None)
            if not op.executed.is_set():
                op.error = Cancelled()
                op.executed.set()

    def run_now(self, job: PromotionJob) -> LoadTime:
        """A demand load at schedule time: disk reads must land in host before the forward can use
        them (they block the step); host -> device copies overlap the forward layer by layer."""
        now = self.clock()
        blocking = overlapped = 0.0
        for st in job.stages:
            for op in st.ops:
                tokens = self._tokens(op)
                if op.src == DISK:
                    blocking = max(blocking, self.pipes.schedule(op.link, tokens, now) - now)
                else:
                    overlapped += self.pipes.seconds(op.link, tokens)
                if not op.executed.is_set():
                    execute(op, self.links.handlers)
        return LoadTime(blocking, overlapped)
