"""Speculative promotions: a predictor's picks and the clients' hint prefetches brought disk ->
host ahead of their use, and carried on host -> device where the device has free pages nobody needs
(`carry`). One implementation for both engines; the controller owns one `Speculation` and hands it
what it reads (`RequestController.speculation`); the client hints (`hint_desk.py`) submit their
prefetches through it, under the same guard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..cache import PrefixMatch, TieredCache
from ..policy.guard import PromotionGuard, QueueDelay
from ..policy.predictor import Predictor
from ..policy.promotion import device_room_pages
from ..policy.shadow import ShadowBets
from ..policy.writeback_choice import (
    EvictionRate,
    fresh_copy_stay_s,
    host_pages_before_fresh_copy,
)
from ..tiers.base import DEVICE, HOST
from ..transfer.executors import Executor
from ..transfer.ops import PromotionJob
from ..tree.node import TreeNode


class SpeculationSettings(Protocol):
    """What `Speculation` reads of the lifecycle settings (`controller.ControllerSettings`)."""

    max_predicted_jobs: int
    predictor_lead_s: float
    device_headroom: float


class Speculation:
    """The speculative jobs in flight and the guard that judges them.

    Dependencies (explicit): the `cache` it plans on, the `executor` that runs the copies, the
    `predictor`, the lifecycle `settings` (`max_predicted_jobs`, `predictor_lead_s`), the `clock`,
    and three measurements the controller keeps: the requests' `queue_delay`, and the host tier's
    eviction rate (`host_evictions`) and free-drop trend (`free_drop_trend`).

    Contract:
    - `predict(m)` plans and submits (never waits); `advance()` applies what landed and releases
      finished jobs, and carries the paths that landed on host on to the device (`carry`);
      `shutdown()` cancels and releases every job.
    - `carry(node)` copies `node`'s path host -> device (off the caller's thread, like every
      speculative copy) only into free device pages beyond `device_room_pages` (what the running
      requests need, `device_reserve()`, and `device_headroom` of the tier): it never evicts, and the
      pages it fills are clean and evictable once they land.
    - `submit(job, trigger)` is the one way a speculative job starts (predictions and hints alike):
      it tags the pages it brings with `trigger` (the guard judges each trigger by them) and
      charges them to `planned[trigger]`.
    - `predicted` holds the jobs in flight; at most `max_predicted_jobs`.
    """

    def __init__(
        self,
        cache: TieredCache,
        executor: Executor,
        predictor: Predictor,
        settings: SpeculationSettings,
        clock: Callable[[], float],
        queue_delay: QueueDelay,
        host_evictions: EvictionRate,
        free_drop_trend: EvictionRate,
    ) -> None:
        self.cache = cache
        self.executor = executor
        self.predictor = predictor
        self.settings = settings
        self.clock = clock
        self.queue_delay = queue_delay
        self.host_evictions = host_evictions
        self.free_drop_trend = free_drop_trend
        self.predicted: list[PromotionJob] = []
        self.planned: dict[str, int] = {}  # tokens of speculative copies planned, per guard trigger
        self.guard = PromotionGuard()
        self.shadow = ShadowBets()  # a trigger's picks judged without copies, until it is proven
        # device pages the running requests still need (the engine's measurement; the embedded
        # engine allocates a request's output pages at admission, so none there)
        self.device_reserve: Callable[[], int] = lambda: 0
        self.carried_tokens = 0  # tokens carried host -> device (`carry`)

    # ---- the predictor's picks ------------------------------------------------------------------
    def predict(self, m: PrefixMatch) -> None:
        """Bring likely nodes (the predictor's choice) disk -> host ahead of their use; at most
        `max_predicted_jobs` in flight, at most `prediction_budget()` tokens per call, and with the
        request's own disk path no more host pages than a queue prefetch may hold (`host_room`).
        Into free host pages only, unless the predictor may evict (`Predictor.may_evict`), and then
        only over host pages that rank below the one it brings (never a device page, never a locked
        or pinned one). A prediction of a node's head splits the node there. Promoted nodes are
        fresh (their recency is the prediction's time), so eviction keeps them for their lead window
        instead of taking them first. The guard stops it while the recent precision of its
        predictions is too low, and while requests queue longer than the lead
        (`PromotionGuard.lead_pays`: their own queue prefetch brings what a prediction would, in
        time), and while the host tier would evict the copies before their lead ends
        (`host_stay_s`, `PromotionGuard.outlives_lead`). A trigger with no record makes shadow bets
        instead of copies until its record is made (`shadowed`). The oracle (`knows_future`) is
        exempt from the host room, the stay test and the shadow phase."""
        cache, settings = self.cache, self.settings
        self.advance()
        if len(self.predicted) >= settings.max_predicted_jobs or not cache.has_tier(HOST):
            return
        if not self.guard.lead_pays(self.queue_delay.seconds, settings.predictor_lead_s):
            return
        now = self.clock()
        trigger = self.trigger_of(m.last_node)
        # a pick below the match point brings the arriving request's own disk-only path with it (prefix
        # closure): those tokens come out of the budget, and out of a probe's size
        own = m.disk_tokens
        budget = self.prediction_budget()
        if budget is not None:
            budget -= own
        if not self.predictor.knows_future:
            room = self.host_room(own)
            budget = room if budget is None else min(budget, room)
        if budget is not None and budget < cache.page_size:
            return  # its own path alone fills the lead window, or the host room a prefetch may take
        picks = [
            p
            for p in self.predictor.predict(m.last_node, now, budget)
            if p.node.parent is not None and p.node.host is None and p.node.device is None
        ]
        if not picks:
            return
        stay_s = self.host_stay_s()
        if self.shadowed(trigger, picks, own, now, stay_s):
            return
        if not self.predictor.knows_future and not self.guard.outlives_lead(stay_s, settings.predictor_lead_s):
            return  # the host tier would evict the copies before the request they are for arrives
        cap = self.admit(trigger)  # one decision per call: its picks are one bet, bounded by the budget
        if cap is None or (cap and own + cache.page_size > cap):
            return  # refused, or a probe that would be a bet: its own path is more than a probe may bring
        for pred in picks:
            node = pred.node
            if node.host is not None or node.device is not None:
                continue  # an earlier pick's path brought it
            pages = pred.pages
            if cap:  # a probe: one small prediction, the head of the node at most
                pages = max(1, min(pages or node.num_pages, (cap - own) // cache.page_size))
            if pages is not None and 0 < pages < node.num_pages:
                head = cache.split_head(node, pages)
                if head is node:
                    continue  # it cannot be split now: the whole node would overrun the budget
                node = head
            job = self.promote_fresh(node, now, self.predictor.may_evict)
            if job is not None:
                # the guard judges the trigger by every page it brings, the arriving request's own path
                # down to the pick included: a request far back in a long queue may not use its path
                # before it is evicted again (an agentic replay at 0.3x its working set: 223k of 282k
                # tokens so brought were wasted, unjudged, and pushed out pages others needed)
                self.submit(job, trigger)
                if cap or len(self.predicted) >= settings.max_predicted_jobs:
                    return

    def submit(self, job: PromotionJob, trigger: str) -> int:
        """Start a speculative `job` for `trigger`: the pages it brings (not those another job
        brings) are tagged and charged to the trigger. Returns the tokens it brings."""
        brought = [st.node for st in job.stages if st.ops]
        for n in brought:
            n.prefetch_trigger = trigger
        tokens = sum(n.num_pages for n in brought) * self.cache.page_size
        self.planned[trigger] = self.planned.get(trigger, 0) + tokens
        self.executor.submit_job(job, speculative=True)
        self.predicted.append(job)
        return tokens

    def advance(self) -> None:
        """Apply what has landed of the jobs in flight; release the finished ones, and carry the
        paths that landed on host on to the device where it has room (`carry`)."""
        self.executor.poll()
        keep = []
        landed = []
        for job in self.predicted:
            if self.cache.advance(job):
                self.cache.release(job)
                if job.target == HOST and not job.failed:
                    landed.append(job.anchor)
            else:
                keep.append(job)
        self.predicted = keep
        for node in landed:
            if node.parent is not None:
                self.carry(node)

    def carry(self, node: TreeNode) -> int:
        """Copy the cached head of `node`'s path (down to its first disk-only node) host -> device,
        as a speculative job, into free device pages only: as many of its nodes, root first, as
        `device_room_pages` allows. It never evicts (displacing clean device pages that rank below
        the path was measured to cost more than it brings: `docs/agent-hints.md`). Returns the
        tokens planned (0: nothing to carry, or no room)."""
        cache = self.cache
        if not cache.has_tier(DEVICE) or not cache.has_tier(HOST) or self.settings.device_headroom >= 1:
            return 0
        store = cache.stores[DEVICE]
        left = device_room_pages(
            store.free_pages, store.capacity_pages, self.device_reserve(), self.settings.device_headroom
        )
        path: list[TreeNode] = []
        for n in node.path_from_root():
            if n.device is None:
                if n.host is None or DEVICE in n.incoming:
                    break  # disk-only (or on its way already): the rest stays where it is
                left -= n.num_pages
                if left < 0:
                    break
            path.append(n)
        if not any(n.device is None for n in path):
            return 0
        job = cache.plan_promotion(path, kind="promote", target=DEVICE, evict=False)
        if job is None:
            return 0
        tokens = sum(len(op.dst_handles) for op in job.ops()) * cache.page_size
        self.carried_tokens += tokens
        self.executor.submit_job(job, speculative=True)
        self.predicted.append(job)
        return tokens

    def shutdown(self) -> None:
        """Cancel and release every job in flight."""
        for job in self.predicted:
            self.executor.cancel(job.ops())
            self.cache.release(job)
        self.predicted = []

    def counters(self) -> dict[str, object]:
        """Why predictions were or were not made: the guard's refusals by reason (`guard_stopped`:
        low precision; `queue_deep`: requests queue longer than the lead; `short_stay`: the host
        would evict the copies first), each trigger's shadow record, and the measured queue delay.
        What the server's stats (`speculation`) and the engine's benchmarks report."""
        return {
            "guard_stopped": self.guard.stopped,
            "queue_deep": self.guard.queue_deep,
            "short_stay": self.guard.short_stay,
            "shadow": self.shadow.summary(),
            "queue_delay_s": self.queue_delay.seconds,
            "carried_tokens": self.carried_tokens,
        }

    # ---- decisions --------------------------------------------------------------------------------
    def shadowed(self, trigger: str, picks: list, own: int, now: float, stay_s: float) -> bool:
        """Whether `trigger` is still unproven: then `picks` are written down as a shadow bet (open
        for the tree's traffic half-life, the time scale of the predictor's own evidence), each with
        the time its copy would land at the earliest (`Executor.read_eta`: behind the disk's queued
        demand work and `own` tokens of the request's own path) and the time the host tier would
        have evicted it again (`stay_s` after the prediction, which is its last use), instead of
        copied. It goes live, for good, once its shadow record passes `PromotionGuard.proven`."""
        shadow = self.shadow
        if trigger in shadow.live or self.predictor.knows_future:
            return False
        if self.guard.proven(shadow.used[trigger], shadow.wasted[trigger], shadow.judged[trigger]):
            shadow.live.add(trigger)
            return False
        ps = self.cache.page_size
        book, queued = [], own  # the copies queue on the link: the arriving request's own path first
        for p in picks:
            tokens = (p.pages or p.node.num_pages) * ps
            queued += tokens
            ready_s = now + self.executor.read_eta(queued)
            book.append((p.node, tokens, ready_s, max(ready_s, now + stay_s)))
        shadow.bet(trigger, book, now, self.cache.tree.half_life.value)
        return True

    def host_stay_s(self) -> float:
        """How long a page brought to host now stays there (`policy/writeback.fresh_copy_stay_s`):
        as long as the pool of pages host eviction takes before it lasts, from its size and its
        measured trend. Not the tier's capacity over its eviction rate: host eviction takes a
        prediction's pages (on disk, not on the device: a free drop) before the copies of device
        pages, so where the host holds few free drops a prediction is the next page it evicts (an
        agentic replay at 0.2x its working set: evicted 0.1 s after it landed, where capacity /
        rate read 3.6 s)."""
        return fresh_copy_stay_s(
            host_pages_before_fresh_copy(self.cache.tree, self.cache.config),
            self.free_drop_trend.rate,
            self.host_evictions.rate,
            self.settings.predictor_lead_s,
        )

    def trigger_of(self, start: TreeNode) -> str:
        """The class of prediction the guard judges on its own: the predictor, and how many children
        the node it walks from has (one: a session's head; a few: branches; many: a shared prompt),
        so that a pattern that misses (a shared prompt's children) never stops one that hits."""
        n = len(start.children)
        fanout = "1" if n <= 1 else "2-4" if n <= 4 else "5+"
        return f"{self.predictor.name}/{fanout}"

    def prediction_budget(self) -> int | None:
        """Tokens a prediction may bring: lead time x the disk -> host link's rate (None: unknown,
        the predictor's own budget)."""
        rate = self.executor.link_tokens_per_s("disk->host")
        lead = self.settings.predictor_lead_s
        return int(lead * rate) if rate > 0 and lead > 0 else None

    def host_room(self, own: int) -> int:
        """Tokens a prediction may place on host below the arriving request's own disk path (`own`
        tokens): what a queue prefetch of a request not at the head of the queue may hold with it
        (`PromotionGuard.prefetch_room`), negative when `own` alone is more. A prediction is a
        speculative prefetch and gets no room a demand prefetch would be refused: an agentic replay
        at 0.2x its working set brought a 13k-token path, then a 14.6k-token branch, into a
        16k-token host."""
        ps = self.cache.page_size
        pages = self.guard.prefetch_room(self.cache.tree.protected[HOST], self.cache.stores[HOST].capacity_pages)
        return (pages - -(-own // ps)) * ps

    def promote_fresh(self, node: TreeNode, now: float, may_evict: bool) -> PromotionJob | None:
        """Plan `node`'s path disk -> host as a prediction, with the path's recency set to `now` (as
        the request it is brought for will set it); evicting host pages only where every page to go
        ranks below it. (Recency only grows: eviction orders keep their keys monotonic, so it stays
        even when nothing could be planned, as a match's touch would.)"""
        path = node.path_from_root()
        for n in path:
            n.last_access = max(n.last_access, now)
        self.cache.tree.touched()
        evict = may_evict and self.worth_room(node)
        return self.cache.plan_promotion(path, kind="predict", target=HOST, evict=evict)

    def worth_room(self, node: TreeNode) -> bool:
        """Whether making host room for `node`'s path pushes out only pages ranked below it, each
        with its copy below (a guess never loses data: a dirty page would be dropped or written)."""
        cache = self.cache
        host = cache.stores[HOST]
        need = sum(n.num_pages for n in node.path_from_root() if n.host is None and n.device is None) - host.free_pages
        leaves = (n for n in cache.tree.tier_leaves(HOST) if n.evictable)
        return self.guard.worth_evicting(
            leaves, need, node, cache.priority, clean=lambda n: n.disk is not None or n.device is not None
        )

    def admit(self, trigger: str) -> int | None:
        """The guard's word on one call's promotions for `trigger` (`PromotionGuard.admit`). A page
        planned and not used yet counts against its trigger until it is: a host tier holds pages for
        minutes before evicting them (and copies take a while to land), and waiting for that let
        misses run on."""
        used = self.cache.stats.triggers[trigger]["used_tokens"]
        return self.guard.admit(used, max(0, self.planned.get(trigger, 0) - used), trigger=trigger)
