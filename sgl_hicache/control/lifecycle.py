"""THE request lifecycle, written once, for the SGLang backend and the embedded engine alike:

    arrive (match, predict) -> prefetch (disk -> host while the request waits) -> admit (ready,
    wait, or recompute) -> load (lower tiers -> device) -> account (hits per tier) ->
    write-back (background copies one tier down) -> predictions advanced

The controller plans; an `Executor` moves the bytes (threads in the server, virtual time in the
embedded engine); results come back as data on the ops and are applied here. The two engines
differ only in their executor and in how they turn an `Admission` into scheduling (the server
answers "retry", the embedded engine stalls its step): never in a policy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

from ..cache import PrefixMatch, TieredCache
from ..config import DEFAULT_POLICY
from ..policy.guard import QueueDelay
from ..policy.predictor import Predictor
from ..policy.writeback_choice import (
    EvictionRate,
    host_pages_before_fresh_copy,
    selective_write_through_due,
    watermark_pages,
)
from ..policy.yielding import yield_plan
from ..tiers.base import DEVICE, DISK, HOST
from ..transfer.executors import Executor, LoadTime
from ..transfer.ops import PromotionJob, TransferOp
from ..tree.node import TreeNode
from .hint_desk import HintDesk
from .rewarm import Rewarm
from .speculative_prefetch import Speculation


def _host_copies_in_flight(m: PrefixMatch) -> list[TransferOp]:
    """The copies on their way to host of `m`'s nodes held in no upper tier, in path order."""
    nodes = [n for n in m.path if n.device is None and n.host is None and HOST in n.incoming]
    return [cast(TransferOp, n.incoming[HOST]) for n in nodes]  # the tree files the cache's ops


class Admission(enum.Enum):
    """What admission decides for a request whose prefetch may still be in flight."""

    READY = "ready"  # nothing in flight: load and go
    WAIT = "wait"  # in flight, and waiting is estimated cheaper than recomputing
    RECOMPUTE = "recompute"  # in flight, the rest was cancelled: the request recomputes it


@dataclass(eq=False)
class Ticket:
    """One request as the controller follows it from arrival to admission.

    `disk_start` / `disk_end` is the token range that was on disk only at the request's first
    match: those tokens count as disk hits even when a prefetch brought them to host before the
    request was scheduled (hits are attributed to where the request found them)."""

    tokens: Sequence[int]
    disk_start: int = 0
    disk_end: int = 0
    job: PromotionJob | None = None
    prefetched_disk_tokens: int = 0  # tokens its own prefetch brought up from disk
    waited: bool = False
    arrived_s: float | None = None  # the controller's clock at arrival (for the queueing delay)


@dataclass
class WritebackCounters:
    """Background write-back figures (pages planned per link, and device copies an eviction had to
    cancel because it needed those pages first)."""

    device_pages: int = 0
    host_pages: int = 0
    device_cancelled_pages: int = 0


@dataclass
class ControllerSettings:
    """The lifecycle's knobs, shared by both engines (the server reads them from its settings, the
    embedded engine from its policy)."""

    prefetch: bool = DEFAULT_POLICY.prefetch
    device_writeback_clean_fraction: float = DEFAULT_POLICY.device_writeback_clean_fraction
    writeback_clean_fraction: float = DEFAULT_POLICY.writeback_clean_fraction
    writeback_batch_pages: int = DEFAULT_POLICY.writeback_batch_pages
    writeback_interval_s: float = 0.02
    max_predicted_jobs: int = 8
    # how far ahead of its use a prediction is made: with the disk -> host link's rate it sizes the
    # predictor's budget (what can land in time); 0 keeps the predictor's own budget
    predictor_lead_s: float = 2.0
    # speculative promotions (predictions, hint prefetches) that land on host are carried on to the
    # device into free pages, leaving this share of the device tier free (1.0: never carried)
    device_headroom: float = 0.1
    # the server's own retentions, learned from each conversation's past pauses (`HintDesk.committed`)
    learn_returns: bool = DEFAULT_POLICY.learn_returns


class RequestController:
    """The request lifecycle over one `TieredCache` and one `Executor` (module docstring).

    Contract:
    - Not thread-safe by itself: one thread (SGLang's scheduler, or the embedded engine's loop)
      calls it; executor threads only set `executed` on ops.
    - Nothing here waits on I/O: `admit` decides and returns; waiting is the caller's choice
      (`VirtualExecutor.finish_all` in the embedded engine, a retry in the server).
    - Every job it starts is released by `drop`, `admit`+`account`, or `shutdown`.
    """

    def __init__(
        self,
        cache: TieredCache,
        executor: Executor,
        predictor: Predictor,
        settings: ControllerSettings,
        clock: Callable[[], float],
    ) -> None:
        self.cache = cache
        self.executor = executor
        self.settings = settings
        self.clock = clock
        self.writeback: list[TransferOp] = []
        self.dropped: list[PromotionJob] = []  # cancelled jobs waiting for a running copy to end
        self._writeback_at = -float("inf")
        self.writeback_counters = WritebackCounters()
        self.eviction_rates = {DEVICE: EvictionRate(), HOST: EvictionRate()}
        # how fast the host pages evicted before a fresh copy grow (+) or shrink (-), pages/s
        self.free_drop_trend = EvictionRate()
        self._round_started: float | None = None
        self._round_seconds = 0.0
        self._committed_seen = (0, 0)
        self.queue_delay = QueueDelay()  # first match -> admission (`admitted`)
        # predictions and hint prefetches (`speculation.py`), and client hints (`hint_desk.py`)
        self.speculation = Speculation(
            cache,
            executor,
            predictor,
            settings,
            clock,
            self.queue_delay,
            self.eviction_rates[HOST],
            self.free_drop_trend,
        )
        self.hints = HintDesk(cache, self.speculation, clock, self.eviction_rates, learn_returns=settings.learn_returns)
        self.prefetch_skipped = 0  # queue prefetches the guard refused (no room to spare on host)
        self.preempted_prefetches = 0  # queued requests' prefetch jobs ended for a demand (yield_to_demand)
        self.disk_reads_recomputed = 0  # disk-only tokens recomputed: reading them would land later (read_or_recompute)
        # re-warm at start (`rewarm.py`): set by the engine when the disk tier has a record
        self.rewarm: Rewarm | None = None

    # ---- arrival and prefetch ----------------------------------------------------------------
    def arrive(self, tokens: Sequence[int]) -> tuple[Ticket, PrefixMatch]:
        """First sight of a request: match (counting its traffic, once), remember its disk range, predict."""
        m = self.cache.match(tokens, count=True)
        self.hints.arrived(m.path)
        ticket = Ticket(tokens, disk_start=m.device_tokens + m.host_tokens, disk_end=m.tokens, arrived_s=self.clock())
        if self.speculation.predictor.name != "none":
            self.predict(m)
        return ticket, m

    def prefetch(self, ticket: Ticket, match: PrefixMatch | None = None, head: bool = True) -> bool:
        """Start moving the disk-only part of the request's match up to host. True if a job started.
        `head`: the request is the next to be scheduled (the guard lets it alone use the whole host
        tier); an adapter that cannot see the queue (the SGLang backend) leaves it True."""
        if not self.settings.prefetch or ticket.job is not None:
            return False
        m = match if match is not None else self.cache.match(ticket.tokens, touch=False)
        if not m.disk_tokens:
            return False
        # a prefetch holds its host pages until its request is scheduled: only while the tier has room
        # to spare for that (the guard) may it start, else the demand load does it at schedule time
        if not self.speculation.guard.prefetch_fits(
            self.cache.tree.protected[HOST],
            m.lower_tier_tokens // self.cache.page_size,
            self.cache.stores[HOST].capacity_pages,
            head=head,
        ):
            self.prefetch_skipped += 1
            return False
        job = self.cache.plan_promotion(m, "prefetch", target=HOST)
        if job is None:
            return False
        ticket.job = job
        self.executor.submit_job(job)
        return True

    def poll(self, ticket: Ticket) -> bool:
        """Apply what has arrived of the request's prefetch; True once nothing is in flight (the
        finished job keeps its path locked until `release`, so what it brought up stays)."""
        job = ticket.job
        if job is None:
            return True
        self.executor.poll()
        return self.cache.advance(job)

    def release(self, ticket: Ticket) -> None:
        """End the request's prefetch job (cancelling what has not arrived) and unlock its path."""
        job = ticket.job
        if job is None:
            return
        ticket.prefetched_disk_tokens += self._brought_from_disk(job)
        self.cache.release(job)
        ticket.job = None

    def _brought_from_disk(self, job: PromotionJob | None) -> int:
        """Tokens a finished part of `job` read from disk that are not on the device yet."""
        if job is None:
            return 0
        return (
            sum(
                st.node.num_pages
                for st in job.stages[: job.applied]
                if st.ops and st.ops[0].src == DISK and st.node.device is None
            )
            * self.cache.page_size
        )

    def drop(self, ticket: Ticket) -> None:
        """The request went away (or will recompute): cancel and release its prefetch. Never waits:
        a copy already running keeps its job (pages allocated, path locked) until it ends; a later
        `pump_writeback` releases it."""
        job = ticket.job
        if job is None:
            return
        self.executor.cancel(job.ops())
        if all(op.stopped for op in job.ops()):
            self.cache.cancel(job)
            self.release(ticket)
            return
        ticket.prefetched_disk_tokens += self._brought_from_disk(job)
        ticket.job = None
        self.dropped.append(job)

    def yield_to_demand(self, tickets: Sequence[Ticket], short_pages: int) -> int:
        """Demand preempts prefetch, as little as it must: a request being scheduled is `short_pages`
        device pages short of fitting (beyond the free and evictable ones), and the prefetch jobs of
        `tickets` (requests still queued, front of the queue first) may hold some of the device pages
        it needs locked along their paths (a job locks its whole path, the device-resident prefix
        included). `yield_plan` picks the jobs to end; each ends now: what has landed stays cached,
        unlocked; what has not is cancelled. When ending every job would not make the request fit,
        none is ended (their prefetches would be lost for nothing). Returns the number of jobs ended
        (`preempted_prefetches` counts them all)."""
        chosen = self.yield_plan(tickets, short_pages)
        for ticket in chosen:
            if self.poll(ticket):
                self.release(ticket)
            else:
                self.drop(ticket)
        self.preempted_prefetches += len(chosen)
        return len(chosen)

    @staticmethod
    def yield_plan(tickets: Sequence[Ticket], short_pages: int) -> list[Ticket]:
        """Which prefetch jobs `yield_to_demand` ends (`policy/yielding.py`: a pure decision)."""
        return yield_plan(tickets, short_pages)

    def _reap_dropped(self, wait: bool = False) -> None:
        keep = []
        for job in self.dropped:
            if wait:
                for op in job.ops():
                    op.executed.wait(timeout=60)
            if all(op.stopped for op in job.ops()):
                self.cache.cancel(job)
                self.cache.release(job)
            else:
                keep.append(job)
        self.dropped = keep

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, ticket: Ticket, recompute_seconds: float) -> tuple[Admission, float]:
        """Decide, without waiting, what to do with a request being scheduled: READY when nothing is
        in flight; WAIT (with the estimated seconds) when the rest of its prefetch should land
        before recomputing it would finish; otherwise the rest is cancelled: RECOMPUTE."""
        if self.poll(ticket):
            if ticket.waited:
                self.cache.stats.add("loads_waited")
                ticket.waited = False
            return Admission.READY, 0.0
        eta = self.executor.eta(ticket.job)  # type: ignore[arg-type]
        if eta <= recompute_seconds:
            ticket.waited = True
            return Admission.WAIT, eta
        self.drop(ticket)
        self.cache.stats.add("loads_recomputed")
        return Admission.RECOMPUTE, 0.0

    def admitted(self, ticket: Ticket) -> None:
        """The request left the queue: its delay since its first match feeds `queue_delay`, once."""
        if ticket.arrived_s is not None:
            self.queue_delay.add(self.clock() - ticket.arrived_s)
            ticket.arrived_s = None

    def pending_tokens(self, ticket: Ticket) -> int:
        """Tokens of the request's prefetch not applied yet (what recomputing would cost)."""
        job = ticket.job
        if job is None:
            return 0
        return sum(st.node.num_pages for st in job.stages[job.applied :]) * self.cache.page_size

    # ---- load and accounting -----------------------------------------------------------------
    def read_or_recompute(self, m: PrefixMatch, recompute_s: float) -> PrefixMatch:
        """Whether a request being admitted reads the disk-only part of its match `m` on demand: only
        when the read lands (`Executor.read_eta`, behind the disk's queued writes) before recomputing
        that part would finish (`recompute_s`). Otherwise `m` is cut where the disk part begins and the
        request recomputes it (the server never reads disk at admission; a disk busy with write-back
        made a 1,536-token read wait 42 s where recomputing took 0.07 s). `disk_reads_recomputed`
        counts the tokens. Nodes another job (a prediction) is already bringing up are not read again:
        they land when their copies do (`Executor.ops_eta`)."""
        if not m.disk_tokens:
            return m
        inflight = _host_copies_in_flight(m)
        rest = m.disk_tokens - sum(op.node.num_pages for op in inflight) * self.cache.page_size
        eta = max(self.executor.ops_eta(inflight), self.executor.read_eta(rest) if rest > 0 else 0.0)
        if eta <= recompute_s:
            return m
        self.disk_reads_recomputed += m.disk_tokens
        return m.head(m.device_tokens + m.host_tokens)

    def load(
        self, tokens: Sequence[int], m: PrefixMatch, recompute_s: float = float("inf")
    ) -> tuple[PrefixMatch, LoadTime]:
        """Bring the lower-tier part of `m` (the match of `tokens`) to the device: a demand load,
        inline on the executor. Copies other jobs have in flight on the path are waited for when
        they land within `recompute_s` (what recomputing that part would cost); past them the load
        stops. Returns the match taken afresh and what the load cost."""
        if not m.lower_tier_tokens:
            return m, LoadTime()
        cost = LoadTime()
        # nodes another job is still bringing to host would stop the demand load there (the rest
        # recomputed): demand preempts prefetch, so those copies go first when that is cheaper
        inflight = _host_copies_in_flight(m)
        if inflight:
            cost = LoadTime(self.executor.expedite(inflight, recompute_s))
            for op in inflight:  # path order, and only under a parent already on host (prefix closure)
                parent = self.cache.tx.parts(op)[0].parent  # above the parts split off while it ran
                if not op.settled or parent is None or not (parent.is_root or parent.host is not None):
                    break
                self.cache.complete(op)
        job = self.cache.plan_promotion(m, "demand")
        if job is not None:
            ran = self.executor.run_now(job)
            cost = LoadTime(max(cost.blocking, ran.blocking), ran.overlapped)
            self.cache.advance(job)
            self.cache.release(job)
        return self.cache.match(tokens, touch=False), cost

    def attribute(self, ticket: Ticket | None, m: PrefixMatch) -> tuple[int, int, int]:
        """(device, host, disk) hit tokens of a request admitted with match `m`: the lower-tier part
        counts as disk where it was disk-only at the request's first match, or is disk-only now."""
        dev, total = m.device_tokens, m.tokens
        disk_from = dev + m.host_tokens  # disk-only now
        if ticket is not None and ticket.disk_end > ticket.disk_start:
            disk_from = min(disk_from, ticket.disk_start)
        disk = max(0, total - max(dev, disk_from))
        return dev, total - dev - disk, disk

    def account(
        self, ticket: Ticket | None, prompt_tokens: int, m: PrefixMatch, hit_tokens: int | None = None
    ) -> tuple[int, int, int]:
        """Count one admitted request's hits (the match taken before its load). `hit_tokens` caps
        the hit where the engine served less than the match (a recomputed tail). Returns the
        (device, host, disk) split."""
        if hit_tokens is not None and hit_tokens < m.tokens:
            m = m.head(hit_tokens)
        dev, host, disk = self.attribute(ticket, m)
        self.speculation.shadow.observe(m.path, self.clock())  # an admitted request uses the shadow picks on its path
        covered = (
            min(ticket.prefetched_disk_tokens + self._brought_from_disk(ticket.job), disk) if ticket is not None else 0
        )
        self.cache.record_request(
            prompt_tokens,
            PrefixMatch(m.path, dev, host, disk, m.device_handles, m.last_node, m.last_device_node),
            covered_by_prefetch=covered,
        )
        return dev, host, disk

    # ---- prediction (`speculation.py`) ---------------------------------------------------------
    def predict(self, m: PrefixMatch) -> None:
        """Bring likely nodes (the predictor's choice) disk -> host ahead of their use (`Speculation.predict`)."""
        self.speculation.predict(m)

    def advance_predictions(self) -> None:
        self.speculation.advance()
        if self.rewarm is not None:
            self.rewarm.step()

    @property
    def predicted(self) -> list[PromotionJob]:
        """The speculative jobs in flight (`Speculation.predicted`)."""
        return self.speculation.predicted

    # ---- background write-back ---------------------------------------------------------------
    def pump_writeback(self, start_new: bool = True) -> bool:
        """Keep a watermark of clean evictable pages in the device tier (also on host) and in the host
        tier (also on disk): `device_writeback_clean_fraction` / `writeback_clean_fraction` of the
        tier; the coldest dirty pages are copied in the background,
        so that evictions are drops. Records finished copies; plans a new round at most every
        `writeback_interval_s`, while earlier rounds (and `commit`'s copies) may still be in flight.
        Returns whether anything changed."""
        self.executor.poll()
        changed = False
        self.hints.expire()
        self.cache.reap_orphans()
        if self.dropped:
            self._reap_dropped()
        if self.writeback:
            done = [op for op in self.writeback if op.settled]
            for op in done:
                self.cache.complete(op)
            self.writeback = [op for op in self.writeback if not op.applied]
            changed = bool(done)
            if not self.writeback and self._round_started is not None:
                self._round_seconds = self.clock() - self._round_started  # how long a round took to land
                self._round_started = None
        now = self.clock()
        if not start_new:
            return changed
        # write-through copies what was committed (or landed on host) since the last round at once;
        # a watermark round waits `writeback_interval_s` (it only tops up what evictions used)
        fresh = self._write_through_due()
        if not fresh and now - self._writeback_at < self.settings.writeback_interval_s:
            return changed
        # a round may start while earlier ones are in flight (planning skips the pages on their
        # way): with one round at a time, the children of a path whose copy was in flight, and
        # everything committed meanwhile, waited a whole round and were evicted dirty first
        self._writeback_at = now
        self._committed_seen = (self.cache.committed_pages, self.cache.landed_copies)
        ops = self._plan_copies_down(now)
        self._submit(ops)
        return changed or bool(ops)

    def _write_through_due(self) -> bool:
        """New pages were committed (or landed on host) since the last round, under a write-through
        policy."""
        config = self.cache.config
        through = config.write_policy != "write_back" or config.disk_write_policy == "write_through"
        return through and (self.cache.committed_pages, self.cache.landed_copies) != self._committed_seen

    def _submit(self, ops: list[TransferOp]) -> None:
        if not ops:
            return
        if not self.writeback:
            self._round_started = self.clock()
        self.writeback += ops
        self.executor.submit_ops(ops, kind="backup")

    def finished(self, path: Sequence[TreeNode], ending: str | None = None) -> None:
        """A request ended along `path` (root first), its output ending in `ending` (`records.ENDS_IN`,
        None: unknown). Where `learn_returns`, its conversation is retained for the pause its history
        after that ending predicts (`HintDesk.committed`)."""
        self.hints.committed(path, ending)

    def commit(self, path: Sequence[TreeNode]) -> int:
        """Write-through at commit (`write_policy=write_through`): a request's newly committed device
        pages (`path`, root first) get their host copies started now, on the transfer threads, so that
        they are clean by the time they are evictable. Only plans and enqueues (O(path)); the copies
        land in a later `pump_writeback`. Returns the pages planned."""
        cache = self.cache
        if cache.config.write_policy != "write_through" or not cache.has_tier(HOST) or not cache.has_tier(DEVICE):
            return 0
        ops = cache.plan_write_through(DEVICE, HOST, list(path), self.settings.writeback_batch_pages)
        pages = sum(len(op.dst_handles) for op in ops)
        self.writeback_counters.device_pages += pages
        self._submit(ops)
        return pages

    def _plan_copies_down(self, now: float) -> list[TransferOp]:
        """This round's background copies one tier down: write-through of committed device pages
        (`write_policy`), then each link's watermark of clean evictable pages, sized from the
        fraction and from the tier's measured eviction rate over the time a round takes to land."""
        cache, s = self.cache, self.settings
        config = cache.config
        ops: list[TransferOp] = []
        horizon = 2 * s.writeback_interval_s + self._round_seconds
        for src, dst, fraction in (
            (DEVICE, HOST, s.device_writeback_clean_fraction),
            (HOST, DISK, s.writeback_clean_fraction),
        ):
            store = cache.stores.get(src)
            if store is None or dst not in cache.stores:
                continue
            cap = store.capacity_pages
            rate = self.eviction_rates[src].update(now, cache.stats.evicted_tokens[src] // cache.page_size)
            if src == HOST:
                self.free_drop_trend.update(now, host_pages_before_fresh_copy(cache.tree, config))
            only = None
            if src == DEVICE and config.write_policy == "write_through":
                target = cap  # every committed page: copied at commit, whatever the watermark
            elif src == HOST and config.disk_write_policy == "write_through":
                target = cap
            else:
                target = watermark_pages(cap, fraction, rate, horizon)
            if src == DEVICE and config.write_policy == "write_through_selective":
                only = partial(selective_write_through_due, config)
                target = cap
            if target <= 0:
                continue
            planned = cache.plan_writeback(src, dst, target, max_pages=s.writeback_batch_pages, only=only)
            pages = sum(len(op.dst_handles) for op in planned)
            if src == DEVICE:
                self.writeback_counters.device_pages += pages
            else:
                self.writeback_counters.host_pages += pages
            ops += planned
        return ops

    def cancel_device_writeback(self) -> None:
        """Stop the device -> host copies not started yet and record them, so their device pages are
        evictable again. Never waits: a copy already running keeps its pages pinned until it ends
        (recorded by a later `pump_writeback`)."""
        ops = [op for op in self.writeback if op.src == DEVICE]
        self.executor.cancel(ops)
        for op in ops:
            if op.executed.is_set() and op.cancelled and op.error is not None:
                self.writeback_counters.device_cancelled_pages += len(op.dst_handles)
        self.pump_writeback(start_new=False)

    def inflight(self) -> bool:
        rewarming = self.rewarm is not None and bool(self.rewarm.jobs)
        return (
            bool(self.predicted) or bool(self.writeback) or bool(self.dropped) or bool(self.cache.orphans) or rewarming
        )

    def shutdown(self) -> None:
        """Cancel and release everything in flight (tickets are dropped by their owner); end every pin."""
        self.hints.shutdown()
        self.speculation.shutdown()
        if self.rewarm is not None:
            self.rewarm.shutdown()
        self._reap_dropped(wait=True)
        self.executor.cancel(self.writeback)
        for op in self.writeback + self.cache.orphans:
            op.executed.wait(timeout=60)
        for op in self.writeback:
            self.cache.complete(op)
        self.writeback = []
        self.cache.reap_orphans()
