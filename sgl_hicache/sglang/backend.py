"""`TieredRadixCache`: SGLang 0.5.23's tree cache, backed by `sgl_hicache.cache.TieredCache`.

Selected with `--radix-cache-backend sgl_hicache` (registered by `plugin.register`). One tree core: every
method here translates SGLang's calls (docs/internals.md) into `TieredCache` calls; the tree,
the tier residency, eviction and promotion all live in `TieredCache`.

Tiers: device = SGLang's own KV pool and allocator (`device_pool.SGLangDevicePool`), host = our DRAM
buffer, disk = our content-addressed page files (they survive a restart).

Request path:
- `match_prefix`: matches the whole prompt across tiers. SGLang gets the device part as its prefix and
  the host + disk part as `host_hit_length` (anchor `best_match_node`). On the request's first match,
  the disk-only part starts moving disk -> host on the transfer engine's threads while the request
  waits in the queue.
- `init_load_back` (admission): never waits. While the request's prefetch is in flight it answers
  "retry next round" (None; `scheduler_hooks.keep_admitting` then lets SGLang admit the requests
  behind it), or recomputes once waiting would outlast `load_timeout_s`. Then it plans host -> device
  and, with `layerwise_loads` (default), only queues the copies layer by layer (`layer_loads`): SGLang's
  KV pool waits for layer i through our layer transfer counter before the forward reads it; without it
  the copy is made inline. It loads all promised tokens or none (SGLang's contract); none means the
  request recomputes them; pages still only on disk are declined (recompute), never read here. It also
  fills `req.storage_hit_length/start` so SGLang's `cached_tokens_details` reports the part that came
  from disk as `storage`.
- `checkpoint`: inserts the request's whole pages into the tree (the tree adopts the request's device
  pages), frees the request's duplicates of pages the tree already held, repoints the request's row onto
  the tree's pages and moves its lock. Under `write_policy=write_through` (the default) it starts the
  host copies of the committed pages (`RequestController.commit`: planned and enqueued only, copied on
  the transfer threads); `before_batch_formed` records those that landed before the next admission.
- `evict`: `TieredCache.evict(DEVICE)`: leaf-first, clean before dirty, coldest first; it never
  copies or waits (`eviction_demotes`, default `none`: a dirty page is dropped and counted). The
  write-through at commit (above), and the background write-back topped up once per step by
  `after_batch_formed`, keep evictable pages clean ahead of it (docs/sglang-backend.md).

Tensor parallelism (`--tp N`): every rank runs this cache on its own KV-head shard, with its own host
buffer and disk directory; the ranks agree on every local fact once per scheduler step
(`rank_consensus.py`), so their trees and answers stay equal. Data parallelism (DP attention,
`--dp-size`): each DP rank is a tree of its own, agreeing only with its attention-TP group
(`data_parallel.py`).

Built by `factory.factory` (which refuses what is not supported: PP, SGLang's own HiCache, DSA, hybrid
Mamba variants other than `no_buffer` and `extra_buffer`) from the parts `assembly.assemble` composes; the stats it shows are put together in `export`.
Pool kinds without an adapter are refused by `pool_adapters`. Requests with a LoRA `extra_key` or a
`cache_salt` are served without the cache (a miss, never stored). Hybrid Mamba / linear-attention
models: hits only where a recurrent-state snapshot is kept, restored into the request's own slot
(`MambaCalls`, mamba_calls.py; the snapshots' tiers: mamba_snapshots.py).

Speculative decoding (EAGLE, EAGLE3, MTP; `is_eagle`): the tree is keyed by token bigrams, as SGLang's
RadixCache keys it (`tree_keys`, `speculative.bigram_keys`): position i of a request is cached under
(t[i], t[i+1]); the draft model's KV pools are tiered with the target's as further layers of each page
(`draft_pools`, `pool_adapters.DraftPoolsAdapter`).
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheRequestHandle,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)

# the core's match (`TieredCache.match`), named apart from SGLang's `MatchResult`, which this module returns
from ..cache import PrefixMatch
from ..client.backend_settings import BackendSettings, load_settings
from ..client.debug_settings import DebugSettings
from ..control.lifecycle import Admission
from ..policy.admission import PrefillCostFit
from ..tiers.base import DEVICE, DISK
from .assembly import assemble
from .coverage import PREFIX as REFUSAL_PREFIX
from .debug.call_timer import CallTimer, IOGuard
from .device_pool import frees_batched
from .export import BackendCounters, CacheViews, StatsPublisher
from .hints.hint_server import refuse_hints_at_tp
from .hints.request_hints import RequestHints
from .kinds.mamba.mamba_calls import MambaCalls, snapshots_for
from .kinds.speculative_decoding import bigram_keys
from .parallel.data_parallel import DPPlacement
from .parallel.head_shard import total_kv_heads
from .parallel.rank_consensus import RankConsensus
from .req_states import ReqState, RequestStates
from .step_calls import StepCalls

logger = logging.getLogger(__name__)

BACKEND_NAME = "sgl_hicache"


class TieredRadixCache(MambaCalls, StepCalls, CacheViews, BasePrefixCache):
    """SGLang `BasePrefixCache` over one `TieredCache` (see the module docstring).

    Contract with SGLang's scheduler (docs/internals.md): `match_prefix` returns the device
    prefix and the host + disk length it may promise; `init_load_back` loads all promised tokens or
    none, or answers None ("retry next round"); `checkpoint` hands the request's whole pages to the
    tree; `evict` frees device tokens without waiting for a copy; the size figures are O(1). SGLang
    makes every call on its scheduler thread (only `stats(exact=False)` is also read by the stats
    publisher's thread). The entry points of our own scheduler hooks come from `StepCalls`."""

    def __init__(
        self,
        params: Any,
        settings: BackendSettings | None = None,
        *,
        architecture: str = "llama",
        model_salt: str = "",
        server_port: int | None = None,
        consensus: RankConsensus | None = None,
        vocab_size: int | None = None,
        debug: DebugSettings | None = None,
        draft_pools: tuple[Any, ...] = (),
        placement: DPPlacement | None = None,
        model_config: Any = None,
    ) -> None:
        self.settings = s = settings or load_settings()
        self.debug = debug = debug if debug is not None else DebugSettings.from_env()
        self.placement = placement or DPPlacement()  # this DP rank's tree (data_parallel.py)
        refuse_hints_at_tp(s.hint_port, consensus is not None or self.placement.data_parallel, REFUSAL_PREFIX)
        self.consensus = consensus  # TP >= 2: agreement with the other ranks (rank_consensus.py)
        self.disable = bool(params.disable)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.is_eagle = bool(getattr(params, "is_eagle", False))
        self.sliding_window_size = getattr(params, "sliding_window_size", None)
        self.kv_events = None
        parts = assemble(
            params,
            s,
            architecture=architecture,
            model_salt=model_salt,
            consensus=consensus,
            placement=self.placement,
            fault_disk_read_file=debug.fault_disk_read_file,
            clock=consensus.clock if consensus is not None else time.monotonic,
            draft_pools=draft_pools,
            total_kv_heads=total_kv_heads(model_config),
        )
        self.device_pool = parts.device_pool
        self.device = self.device_pool.device
        self.config = parts.config
        self.cache = parts.cache
        self.engine = parts.engine
        self.layer_loads = parts.layer_loads
        self.controller = parts.controller
        # hybrid Mamba: the recurrent-state snapshots (mamba_calls.py); None for other models
        self.snapshots = snapshots_for(self.req_to_token_pool, self.device_pool.adapter, model_config, parts)
        self.deferred_rid: str | None = None  # the request init_load_back last answered "retry" (scheduler_hooks)
        # device tokens the running requests may still decode (scheduler_hooks.running_reserve_tokens,
        # each step): a speculative promotion to the device leaves them free (`Speculation.carry`)
        self.running_reserve_tokens = 0
        self.controller.speculation.device_reserve = lambda: -(-self.running_reserve_tokens // self.page_size)
        self.held_rids: set[str] = set()  # requests held one round by `admission_hold` (scheduler_hooks.hold_new)
        self.prefill_cost_fit = PrefillCostFit()  # this rank's prefill steps (scheduler_hooks.time_prefill)
        self.counters = BackendCounters()
        self.server_port = server_port
        self.req_states = RequestStates(self.controller, consensus)
        self.request_hints = RequestHints(self.cache, self.controller.hints)  # hints in custom_params
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._publisher: StatsPublisher | None = None
        self._metrics_enabled = bool(getattr(params, "enable_metrics", False))
        if self._metrics_enabled:
            self.init_metrics_collector()
        self.call_timer = CallTimer().instrument(self) if s.time_calls else None
        self.io_guard = IOGuard().install(self.cache) if debug.check_scheduler_io else None
        self._vocab_size = vocab_size
        self.hint_listener = None  # the hint API, started by `start` when hint_port is set (StepCalls)
        self.rewarm = parts.rewarm  # re-warm at start and its record (rewarm_calls.py)

    @property
    def root_node(self):
        return self.cache.tree.root

    def start(self) -> TieredRadixCache:
        """Start the stats publisher and the hint API (the transfer engine starts on first use)."""
        self.start_hint_api()
        if self._publisher is None and (self.settings.stats_file or self._metrics_enabled):
            path = self.settings.stats_file
            if path:  # TP / DP: TP rank 0 of DP rank 0 writes the file, every other process its own beside it
                path += self.placement.file_suffix()
            interval, labels = self.settings.stats_interval_s, self.placement.labels()
            self._publisher = StatsPublisher(self, path, interval, prometheus=self._metrics_enabled, labels=labels)
            self._publisher.start()
        return self

    def shutdown(self) -> None:
        """Stop the publisher, the hint API, the transfer engine (cancelling copies); save the re-warm record."""
        self.stop_hint_api()
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None
        self._drop_all_jobs()
        self.rewarm.stop()
        self.engine.stop()
        if self.layer_loads is not None:
            self.layer_loads.finish_all()
        close = getattr(self.cache.stores.get(DISK), "close", None)  # the shared store's connections
        if close is not None:
            close()

    def _drop_all_jobs(self) -> None:
        self.req_states.forget_all()
        self.controller.shutdown()

    # ---- BasePrefixCache: abstract -------------------------------------------------------
    def reset(self) -> None:
        """SGLang's flush: forget the device and host copies (disk files stay, for a restart)."""
        self._drop_all_jobs()
        self.engine.stop()
        if self.layer_loads is not None:
            self.layer_loads.finish_all()  # no copy may land in a slot after the flush frees it
        self.cache.reset()
        self.device_pool.reset_accounting()
        if self.snapshots is not None:
            self.snapshots.reset()

    def _empty_match(self) -> MatchResult:
        root = self.cache.tree.root
        return MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)

    @staticmethod
    def _cacheable(key) -> bool:
        return not (key.extra_key or key.cache_salt)

    def tree_keys(self, tokens):
        """The tree's key of `tokens`: the tokens, or under EAGLE their bigrams (`speculative.bigram_keys`)."""
        return bigram_keys(tokens) if self.is_eagle else tokens

    @frees_batched
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if self.disable or len(key) == 0 or not self._cacheable(key):
            return self._empty_match()
        tokens = self.tree_keys(key.raw_token_ids())
        aligned = self.cache.tree.page_aligned(tokens)
        if aligned == 0:
            return self._empty_match()
        key_at = None
        if self.snapshots is not None:  # a hit only up to a point whose recurrent state is known
            probe = self.cache.match(tokens[:aligned], touch=False, count=False)
            aligned, key_at = self._snapshot_depth(probe.path, aligned)
            if aligned == 0:
                return self._empty_match()
        st = self.req_states.track(params.req)
        self.counters.matches += 1
        if self.layer_loads is not None:
            self.layer_loads.reap()
        m: PrefixMatch
        if st is None:
            m = self.cache.match(tokens[:aligned])
        elif st.ticket is None:  # the request's first match: the controller takes it from here
            st.ticket, m = self.controller.arrive(tokens[:aligned])
            if self.controller.prefetch(st.ticket, m):
                job = st.ticket.job
                self.counters.prefetch_jobs += 1
                self.counters.prefetch_tokens += job.tokens  # type: ignore[union-attr]
        else:
            self.controller.poll(st.ticket)
            m = self.cache.match(tokens[:aligned], touch=False)
        if m.disk_tokens and (st is None or st.ticket is None or st.ticket.job is None):
            # no prefetch brings the disk part up (docs/internals.md, "Match"): promise the rest
            m = m.head(m.device_tokens + m.host_tokens)
        if st is not None:
            st.last_match = m
        self._maybe_check()
        if key_at is not None:
            return self._hybrid_match(params, m, aligned, key_at)
        return MatchResult(
            device_prefix_len=m.device_tokens,
            last_device_node=m.last_device_node,
            last_host_node=m.last_node,
            best_match_node=m.last_node,
            host_hit_length=m.lower_tier_tokens,
        )

    @frees_batched
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        req = params.req
        promised = int(params.host_hit_length)
        node = params.best_match_node
        st = self.req_states.get(req.rid) if req is not None else None
        fallback = (0, req.last_node if req is not None else self.cache.tree.root)
        if self.disable or promised <= 0 or req is None:
            return fallback
        t0 = time.perf_counter()
        ticket = st.ticket if st is not None else None
        if ticket is not None and ticket.job is not None:
            # never wait here: this is SGLang's scheduler thread. Retry next round while the rest of the
            # prefetch should land within what is left of `load_timeout_s`, else recompute it
            budget = self.settings.load_timeout_s - (time.monotonic() - st.created)  # type: ignore[union-attr]
            if self.consensus is not None:  # TP: wait or recompute as the ranks agreed at the last step
                budget = -1.0 if self.consensus.gave_up(ticket) else math.inf
            decision, _ = self.controller.admit(ticket, max(0.0, budget))
            if decision is Admission.WAIT:
                self.counters.load_back_retries += 1
                self.deferred_rid = req.rid  # scheduler_hooks.keep_admitting: skip it, admit the rest
                return None  # the disk pages are still coming: SGLang retries next round
            if decision is Admission.RECOMPUTE:
                self.counters.load_back_timeouts += 1
                return fallback
        prefix = int(req.prefix_len)
        target = prefix + promised
        tokens = self.tree_keys(req.full_untruncated_fill_ids[: target + int(self.is_eagle)])
        m = self.cache.match(tokens, touch=False)
        # hybrid Mamba: the device part of a lower-tier hit is reported as 0 (`_hybrid_match`)
        device_off = m.device_tokens < prefix if self.snapshots is not None else m.device_tokens != prefix
        if m.tokens != target or m.last_node is not node or device_off or m.disk_tokens:
            # the tree changed since the match (a page went missing on disk), or pages are still on
            # disk only (reading them here would block the scheduler): recompute
            self.counters.load_back_declined += 1
            why = (
                "disk_only"
                if m.disk_tokens and m.tokens == target
                else "device_grew"
                if m.device_tokens > prefix
                else "path_changed"
            )
            self.counters.extra[why] = self.counters.extra.get(why, 0) + 1
            if ticket is not None:
                self.controller.release(ticket)
            return fallback
        if self.snapshots is not None and not (go := self._mamba_admit(req, m.last_node.last_key, st)):
            return None if go is None else fallback  # the hit's state file is still being read, or is gone
        m2, _ = self.controller.load(tokens, m)
        if ticket is not None:
            self.controller.release(ticket)
        self.counters.load_back_seconds += time.perf_counter() - t0
        if m2.device_tokens != target:
            self.counters.load_back_declined += 1
            self.cache.stats.add("loads_recomputed")
            return fallback
        if self.snapshots is not None and self._mamba_restore(req, m2.last_node.last_key) is None:
            self.counters.load_back_declined += 1
            return fallback
        self.counters.load_backs += 1
        self.counters.load_back_tokens += promised
        # the part that was on disk at the first match is reported as SGLang's "storage" tier
        if ticket is not None and ticket.disk_end > ticket.disk_start:
            lo, hi = max(prefix, ticket.disk_start), min(target, ticket.disk_end)
            if hi > lo:
                req.storage_hit_start = lo
                req.storage_hit_length = hi - lo
        self._maybe_check()
        return promised, m2.last_node

    def load_back_is_cache_owned(self) -> bool:
        return True

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        if self.disable or req.skip_radix_cache_insert:
            return
        if req.extra_key or req.cache_salt:
            self.counters.uncacheable_requests += 1
            return
        ps = self.page_size
        token_ids = self.tree_keys(req.full_untruncated_fill_ids[:up_to])
        aligned = self.cache.tree.page_aligned(token_ids)
        protected = int(req.kv.cache_protected_len)
        if aligned <= protected:
            return
        self.counters.checkpoints += 1
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :aligned].to(torch.int64)
        mine = self.device_pool.pages_of(row)
        tokens = token_ids[:aligned]
        # the request's pages the tree adopted are the cache's now; they came from SGLang's allocator
        result = self.cache.insert(tokens, mine, from_allocate_device=False)
        self.device_pool.adopt(result.adopted_pages)
        m = self.cache.match(tokens, touch=False)
        d = m.device_tokens
        if d < protected:  # cannot happen while the request holds its lock
            logger.error(
                "sgl_hicache: request %s: tree device path %d shorter than its protected prefix %d",
                req.rid,
                d,
                protected,
            )
            return
        p0, p1 = protected // ps, d // ps
        theirs = list(m.device_handles[p0:p1])
        dups = [a for a, b in zip(mine[p0:p1], theirs) if a != b]
        if dups:
            self.token_to_kv_pool_allocator.free(self.device_pool.token_slots(dups))
            self.counters.duplicate_pages_freed += len(dups)
            self.req_to_token_pool.write(
                (req.kv.req_pool_idx, slice(protected, d)),
                self.device_pool.token_slots(theirs),
            )
        req.kv.cache_protected_len = d
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, aligned)
        new_last = m.last_device_node
        self.unlock(req.lock)
        req.lock = self.lock(new_last)
        req.last_node = new_last
        # write-through at commit: the host copies of these pages start now, on the transfer threads,
        # not at the next step's pump, which runs after the next admission has evicted them dirty
        self.controller.commit(m.path)
        self._mamba_commit(req, m.path, d, len(token_ids))  # hybrid Mamba: a state snapshot
        self._maybe_check()

    def insert(self, params: InsertParams) -> InsertResult:
        """Direct insert (SGLang 0.5.23's scheduler does not call it; `checkpoint` is the path).
        The caller keeps the pages the tree did not take, as with SGLang's RadixCache: it frees
        `value[:prefix_len]` (duplicates) and the tree owns the rest it adopted."""
        if self.disable or params.key is None or not self._cacheable(params.key):
            return InsertResult(prefix_len=0)
        tokens = self.tree_keys(params.key.raw_token_ids())
        aligned = self.cache.tree.page_aligned(tokens)
        if aligned == 0 or params.value is None:
            return InsertResult(prefix_len=0)
        pages = self.device_pool.pages_of(params.value[:aligned].to(torch.int64))
        r = self.cache.insert(tokens[:aligned], pages, from_allocate_device=False)
        self.device_pool.adopt(r.adopted_pages)
        return InsertResult(prefix_len=r.prefix_tokens, total_len=aligned, last_device_node=r.last_node)

    @frees_batched
    def evict(self, params: EvictParams) -> EvictResult:
        wanted = max(int(params.num_tokens), int(getattr(params, "swa_num_tokens", 0) or 0))  # (window rows: as many)
        states = int(getattr(params, "mamba_num", 0) or 0)
        snaps = self.snapshots if states > 0 and not self.disable else None
        freed_states = snaps.evict_device(states) if snaps is not None else 0  # clean slots first; never copies
        if self.disable or wanted <= 0:
            return EvictResult(mamba_num_evicted=freed_states)
        t0 = time.perf_counter()
        pages = -(-wanted // self.page_size)
        if self.layer_loads is not None:
            self.layer_loads.reap()  # finished layer-wise loads unpin their nodes
        # record finished background copies (their pages become free drops), but start none here:
        # a new copy pins the coldest nodes, exactly the ones this eviction is about to free, and the
        # scheduler sized its allocation from evictable_size() before calling
        self.controller.pump_writeback(start_new=False)
        freed = self.cache.evict(DEVICE, pages) * self.page_size
        if freed < wanted and any(op.src == DEVICE for op in self.controller.writeback):
            # the scheduler counted on pages a background copy holds (it never counts them:
            # write-back locks its path, so evictable_size() leaves them out; kept as a guard): stop
            # the copies not started yet, never wait for a running one
            self.controller.cancel_device_writeback()
            freed += self.cache.evict(DEVICE, pages - freed // self.page_size) * self.page_size
        if freed < wanted:
            self.counters.evict_short += 1  # SGLang's allocation may then fail: counted, never waited for
        self.counters.evict_calls += 1
        self.counters.evicted_tokens += freed
        self.update_eviction_metrics(freed, t0)
        self._maybe_check()
        return EvictResult(num_tokens_evicted=freed, mamba_num_evicted=freed_states)

    def _device_tokens_changing_lock(self, node, lock_ref: int) -> int:
        """Device tokens on `node`'s path whose lock count is `lock_ref`: those a lock (0) or an
        unlock (1) moves between evictable and protected."""
        tokens = 0
        n = node
        while n is not None and not n.is_root:
            if n.lock_ref == lock_ref and n.device is not None:
                tokens += n.num_pages * self.page_size
            n = n.parent
        return tokens

    def inc_lock_ref(self, node) -> IncLockRefResult:
        if self.disable or node is None:
            return IncLockRefResult(delta=0)
        delta = -self._device_tokens_changing_lock(node, 0)
        self.cache.lock(node)
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable or node is None:
            return DecLockRefResult(delta=0)
        delta = self._device_tokens_changing_lock(node, 1)
        self.cache.unlock(node)
        return DecLockRefResult(delta=delta)

    # ---- BasePrefixCache: the rest the scheduler uses --------------------------------------
    def path_device_indices(self, node) -> torch.Tensor:
        pages = array("q")  # the nodes' int64 arrays, joined at C speed
        if node is not None:
            for n in node.path_from_root():
                if n.device is None:
                    break
                pages.extend(n.device)
        if not pages:
            return self._empty_indices
        return self.device_pool.token_slots(pages)

    def touch_prefix(self, key) -> None:
        if self.disable or len(key) == 0 or not self._cacheable(key):
            return
        tokens = self.tree_keys(key.raw_token_ids())
        aligned = self.cache.tree.page_aligned(tokens)
        if aligned:
            self.cache.match(tokens[:aligned], touch=True, count=False)

    def evictable_size(self) -> int:
        """Device tokens the tree could free now: unlocked and unpinned (O(1): the tree keeps the figure
        on every lock, pin and residency change). Pinned pages (a background copy or a prefetch reads
        them) count as protected: SGLang's idle check wants free + evictable + protected == the pool."""
        return self.cache.tree.evictable_pages(DEVICE) * self.page_size

    def protected_size(self) -> int:
        """Locked or pinned device tokens, and copies into the device in flight (no request holds them)."""
        return (self.cache.tree.protected[DEVICE] + self.cache.tx.incoming_pages[DEVICE]) * self.page_size

    # hybrid sliding window: each tree token holds its window row too (SWAPoolAdapter): same figures
    full_evictable_size = swa_evictable_size = evictable_size
    full_protected_size = swa_protected_size = protected_size

    def total_size(self) -> int:
        return self.cache.tree.pages[DEVICE] * self.page_size

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._mamba_release(req)  # the slot a hybrid request still holds (the tree took it or not)
        self.request_hints.on_finish(req)
        if checkpointed and (node := getattr(req, "last_node", None)) is not None and node.parent is not None:
            self.controller.finished(node.path_from_root())  # its ending is not read from the output: unknown
        st = self.req_states.forget(req.rid)
        if getattr(req, "_sgl_hicache_recorded", False) or not getattr(req, "_cache_breakdown_computed", False):
            return
        try:
            req._sgl_hicache_recorded = True
        except AttributeError:
            pass
        self._record(req, st)

    def _record(self, req, st: ReqState | None) -> None:
        """Count the request's hits: SGLang's figures say how much it served from the cache; the
        controller attributes them to tiers from the request's match, as in the embedded engine."""
        prompt = req.origin_input_ids
        dev = int(getattr(req, "cached_tokens_device", 0) or 0)
        host = int(getattr(req, "cached_tokens_host", 0) or 0)
        disk = int(getattr(req, "cached_tokens_storage", 0) or 0)
        if st is None or st.last_match is None:
            self.cache.stats.record_request(len(prompt), dev, host, disk)
            return
        self.controller.account(st.ticket, len(prompt), st.last_match, hit_tokens=dev + host + disk)

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self.req_states.forget(handle.rid)
