"""The calls our own scheduler hooks make on the SGLang backend, once per admission or step.

SGLang's `BasePrefixCache` API is translated in `backend.py`; these four methods are what the hooks
this package installs on SGLang's scheduler call (`scheduler_hooks.py`: admission and batch forming;
`rank_consensus.install_step_hook`: the TP ranks' per-step agreement). `TieredRadixCache` inherits
them from `StepCalls`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..policy.admission import PrefillCost, PrefillCostFit
from ..policy.hint_rules import HintError
from ..tiers.base import HOST
from .device_pool import frees_batched
from .parallel.rank_consensus import GatedExecutor, tree_digest

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..cache import TieredCache
    from ..client.backend_settings import BackendSettings
    from ..client.debug_settings import DebugSettings
    from ..control.lifecycle import RequestController
    from .export import BackendCounters
    from .hints.hint_server import HintListener
    from .kinds.mamba.mamba_snapshots import SnapshotTiers
    from .layer_loads import LayerLoads
    from .parallel.rank_consensus import RankConsensus
    from .req_states import RequestStates
    from .rewarm_calls import ServerRewarm


class StepCalls:
    """Mixin of `TieredRadixCache`: the entry points of our scheduler hooks (module docstring). Each
    does nothing when the cache is disabled; the TP ones do nothing at TP = 1."""

    disable: bool
    page_size: int
    settings: BackendSettings
    debug: DebugSettings
    consensus: RankConsensus | None
    cache: TieredCache
    controller: RequestController
    layer_loads: LayerLoads | None
    req_states: RequestStates
    counters: BackendCounters
    hint_listener: HintListener | None
    rewarm: ServerRewarm
    snapshots: SnapshotTiers | None
    _vocab_size: int | None
    prefill_cost_fit: PrefillCostFit
    hint_tokens: int = 0  # tokens the applied hints acted on
    hint_error: str | None = None  # the last refused hint's reason

    def prefill_cost(self) -> PrefillCost | None:
        """The prefill cost admission weighs (`scheduler_hooks.hold_new`): this rank's fit at TP = 1;
        at TP >= 2 the one the ranks agreed at this step (`RankConsensus.prefill_cost`), so every
        rank holds the same requests. None until measured."""
        if self.consensus is not None:
            return self.consensus.prefill_cost
        return self.prefill_cost_fit.cost()

    def yield_to_demand(self, req: Any, short_tokens: int) -> int:
        """Demand preempts prefetch, with the embedded engine's rule (`RequestController.yield_to_demand`
        decides): `req` was refused for want of `short_tokens` device tokens, and the prefetch jobs of
        the other waiting requests lock their paths' device pages; the jobs holding pages it lacks end
        (the back of the queue first; none when ending all would not make room). Called by
        `scheduler_hooks.keep_admitting`, which then retries the request once. Nothing with TP >= 2
        (the ranks would have to agree on it first: not built) or without a shortfall. Returns the
        number of jobs ended."""
        if self.disable or short_tokens <= 0 or self.consensus is not None:
            return 0
        mine = self.req_states.get(getattr(req, "rid", None))
        tickets = [st.ticket for st in self.req_states.prefetching() if st is not mine and st.ticket is not None]
        if not tickets:
            return 0
        ended = self.controller.yield_to_demand(tickets, -(-int(short_tokens) // self.page_size))
        self.counters.prefetch_yields += ended
        return ended

    @frees_batched
    def before_batch_formed(self) -> None:
        """Once per scheduling step, before SGLang forms the prefill batch
        (`scheduler_hooks.record_landed_copies`): apply the queued client hints; record the
        speculative promotions (predictions, hint prefetches) and background copies that landed (their
        pages are host hits, or clean and evictable, for this admission, not only once the next
        request arrives); start none, except the re-warm's next copy (`ServerRewarm.step`, which also
        keeps its record). Nothing at TP >= 2 (there the ranks agree on the outcomes
        first, `sgl_hicache_on_step`)."""
        if self.disable:
            return
        if self.snapshots is not None:
            self.snapshots.poll()  # landed state copies: clean slots and DRAM copies for this admission
        if self.consensus is not None:
            return
        if self.hint_listener is not None:
            self.apply_hints(self.hint_listener.drain())
        self.rewarm.step()  # the re-warm's next copy, and its record every rewarm_interval_s
        if self.controller.predicted:
            self.controller.advance_predictions()
        if self.controller.writeback:
            self.controller.pump_writeback(start_new=False)
        else:
            self.controller.hints.expire()  # retentions end on time or use while the server idles too

    def transfers_in_flight(self) -> bool:
        """A layer-wise load, a background copy or a prefetch job is still moving pages."""
        if self.layer_loads is not None and self.layer_loads.inflight:
            return True
        return self.controller.inflight() or bool(self.req_states.prefetching())

    def _maybe_check(self) -> None:
        """With `check_invariants`, verify the tree and every store's accounting (skipped while a
        prefetch is in flight: its destination pages are allocated but not yet in the tree)."""
        if self.debug.check_invariants and not self.transfers_in_flight():
            self.cache.check()

    def start_hint_api(self) -> None:
        """Serve the hint API when `hint_port` is set (idempotent)."""
        if self.hint_listener is None and self.settings.hint_port is not None and not self.disable:
            from .hints.hint_server import HintListener

            cache = self.cache
            host = cache.stores[HOST].capacity_pages * cache.page_size if cache.has_tier(HOST) else None
            self.hint_listener = HintListener(
                self.settings.hint_port,
                self.settings.hint_host,
                status=self.hint_status,
                vocab_size=self._vocab_size,
                limits=self.controller.hints.limits,
                page_size=cache.page_size,
                host_tokens=host,
            )
            logger.info("sgl_hicache: hint API on http://%s:%d/hints", self.settings.hint_host, self.hint_listener.port)

    def stop_hint_api(self) -> None:
        if self.hint_listener is not None:
            self.hint_listener.close()
            self.hint_listener = None

    def apply_hints(self, hints: list) -> None:
        """Client hints queued by the hint API, applied through the controller's `HintDesk` on this
        (the scheduler) thread: plans and enqueues only. A hint that cannot run is counted, its
        reason kept for `GET /hints`; it never stops the step."""
        desk = self.controller.hints
        for hint in hints:
            try:
                self.hint_tokens += desk.apply(hint, self.tree_keys(hint.input_ids))  # type: ignore[attr-defined]
            except HintError as e:  # counted by the desk
                self.hint_error = f"{hint.action}: {e}"

    def hint_status(self) -> dict:
        """What `GET /hints` reports (read from the listener's thread: counters only)."""
        desk = self.controller.hints
        return {
            "applied": dict(desk.counts),
            "acted_tokens": self.hint_tokens,
            "rejected": desk.rejected,
            "pins": desk.pins,
            "pinned_tokens": desk.pinned_tokens,
            "last_error": self.hint_error,
        }

    @frees_batched
    def after_batch_formed(self, admitted: Sequence[Any] = ()) -> None:
        """Once per scheduling step, after SGLang formed (and allocated) the prefill batch
        (`scheduler_hooks.set_consumer_index`): the batch's requests (`admitted`) left the queue
        (`RequestController.admitted`: their queueing delay); record finished layer-wise loads and
        background copies and start new write-back. Not in `match_prefix`: a copy started there pins
        the coldest device nodes while the admission round that counted them as evictable is still
        allocating."""
        if self.disable:
            return
        for req in admitted:
            st = self.req_states.get(getattr(req, "rid", None))
            if st is not None and st.ticket is not None:
                self.controller.admitted(st.ticket)
        if self.layer_loads is not None:
            self.layer_loads.reap()
        # TP >= 2: new copies start in sgl_hicache_after_step, on every rank at the same point
        self.controller.pump_writeback(start_new=self.consensus is None)
        if self.snapshots is not None:
            self.snapshots.pump()  # host copies of the state snapshots that found no room at commit

    def sgl_hicache_on_step(self) -> None:
        """Once per scheduler step on every rank (rank_consensus.install_step_hook): with TP >= 2,
        agree on the background transfers' outcomes and on which waiting requests give up, then
        record the finished write-backs. Nothing at TP=1."""
        c = self.consensus
        if c is None or self.disable:
            return
        ops = list(self.controller.writeback)
        for job in self.controller.predicted:
            ops += job.ops()
        if c.replicated:  # cancelled copies into the shared tiers: freed only once every rank stopped them
            for job in self.controller.dropped:
                ops += job.ops()
            ops += self.cache.orphans
        now = time.monotonic()
        flags = []
        for st in self.req_states.prefetching():
            job = st.ticket.job  # type: ignore[union-attr, assignment]  # prefetching(): each has a ticket and a job
            ops += job.ops()
            budget = self.settings.load_timeout_s - (now - st.created)
            flags.append((st.ticket, self.controller.executor.eta(job) > budget))
        loads = self.layer_loads
        ex = self.controller.executor
        rate = ex.local_link_tokens_per_s("disk->host") if isinstance(ex, GatedExecutor) else 0.0
        agreed_loads = c.step(
            ops,
            flags,
            digest=lambda: tree_digest(self.cache, (len(self.req_states),), host_handles=c.replicated),
            layer_loads=(loads.queued, loads.done_prefix()) if loads is not None else (0, 0),
            disk_read_tokens_per_s=rate,
            prefill_cost=self.prefill_cost_fit.cost(),
        )
        if loads is not None:
            loads.reap_agreed(agreed_loads)
        if self.controller.predicted:  # outcomes agreed above: every rank records the same landed promotions
            self.controller.advance_predictions()
        self.controller.pump_writeback(start_new=False)

    def sgl_hicache_after_step(self) -> None:
        """After the scheduler chose its batch (and evicted for it), on every rank: with TP >= 2, start
        the next background write-back batch here, so it copies during the forward pass and is agreed
        at the next step rather than pinning the coldest pages through this step's evictions."""
        if self.consensus is not None and not self.disable:
            self.controller.pump_writeback()


__all__ = ["StepCalls"]
