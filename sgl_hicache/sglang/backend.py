"""`TieredRadixCache`: SGLang 0.5.23's tree cache, backed by `sgl_hicache.cache.TieredCache`.

Selected with `--radix-cache-backend sgl_hicache` (registered by `plugin.register`). One tree core: every
method here translates SGLang's calls (docs/sglang-integration.md) into `TieredCache` calls; the tree,
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
  the tree's pages and moves its lock.
- `evict`: `TieredCache.evict(DEVICE)`: leaf-first, clean before dirty, coldest first; it never
  copies or waits (`eviction_demotes`, default `none`: a dirty page is dropped and counted). The
  background write-back watermark, topped up once per step by `after_batch_formed`, keeps at least
  one step's allocation of evictable pages clean ahead of it (docs/sglang-backend.md).

Tensor parallelism (`--tp N`): every rank runs this cache on its own KV-head shard, with its own host
buffer and disk directory; the ranks agree on every local fact once per scheduler step
(`rank_consensus.py`), so their trees and answers stay equal.

Not supported (the factory refuses them with a clear error): PP > 1, DP attention and `--dp-size > 1`
in one server (run one server per replica instead, docs/sglang-backend.md), `--enable-hierarchical-cache`
(SGLang's own HiCache), hybrid SWA/Mamba/DSA models, MLA / quantised KV pools, EAGLE (bigram keys).
Requests with a LoRA `extra_key` or a `cache_salt` are served without the cache (a miss, never stored).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

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

from ..cache import PrefixMatch
from ..cache import TieredCache
from ..config import CacheConfig, default_disk_dir
from ..assemble import build_cache, build_controller
from ..controller import Admission, Ticket
from ..hashing import Namespace
from ..stats import prometheus_text
from ..tiers.base import DEVICE, DISK, HOST, TIERS
from ..transfer.engine import TransferEngine
from ..transfer.executors import ThreadExecutor
from .call_timer import CallTimer, IOGuard
from .device_pool import SGLangDevicePool
from .layer_loads import LayerLoads
from .rank_consensus import RankConsensus, inject_read_faults, step_hook_installed, tree_digest
from .settings import BackendSettings, load_settings, unknown_env

logger = logging.getLogger(__name__)

BACKEND_NAME = "sgl_hicache"
_MAX_REQ_STATES = 65536


def _frees_batched(method):
    """Run a scheduler call with the device pool's frees batched into one allocator call (its
    evictions free node by node; see `SGLangDevicePool.deferred_frees`)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        pool = getattr(self, "device_pool", None)
        if pool is None:
            return method(self, *args, **kwargs)
        with pool.deferred_frees():
            return method(self, *args, **kwargs)

    return call


@dataclass(eq=False)
class _ReqState:
    """What the backend remembers of a request between scheduling rounds: the controller's ticket
    (made at the first match) and the last match SGLang was given."""

    created: float
    ticket: Ticket | None = None
    last_match: PrefixMatch | None = None


@dataclass
class BackendCounters:
    """Figures of the SGLang path that `CacheStats` does not keep."""

    matches: int = 0
    prefetch_jobs: int = 0
    prefetch_tokens: int = 0
    load_backs: int = 0
    load_back_tokens: int = 0
    load_back_declined: int = 0  # promised tokens could not all be brought up: recomputed
    load_back_retries: int = 0  # init_load_back answered "not yet" (prefetch in flight)
    load_back_timeouts: int = 0
    load_back_seconds: float = 0.0
    checkpoints: int = 0
    duplicate_pages_freed: int = 0
    evict_calls: int = 0
    evicted_tokens: int = 0
    uncacheable_requests: int = 0  # extra_key / cache_salt / bigram: served without the cache
    admission_skips: int = 0  # a waiting request skipped while the requests behind it were admitted
    prefetch_yields: int = 0  # waiting requests' prefetch jobs ended so a request short of device room fits
    evict_short: int = 0  # evictions that freed fewer pages than asked (never waited for a copy in flight)
    extra: dict = field(default_factory=dict)


class TieredRadixCache(BasePrefixCache):
    """SGLang `BasePrefixCache` over one `TieredCache` (see the module docstring)."""

    def __init__(self, params, settings: BackendSettings | None = None, *, architecture: str = "llama", model_salt: str = "", server_port: int | None = None,
                 consensus: RankConsensus | None = None) -> None:
        self.settings = settings or load_settings()
        self.consensus = consensus  # TP >= 2: agreement with the other ranks (rank_consensus.py)
        clock = consensus.clock if consensus is not None else time.monotonic
        self.disable = bool(params.disable)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.is_eagle = bool(getattr(params, "is_eagle", False))
        self.sliding_window_size = getattr(params, "sliding_window_size", None)
        self.kv_events = None
        if self.is_eagle:
            raise ValueError("sgl_hicache: EAGLE speculative decoding (bigram radix keys) is not supported")
        self.device_pool = SGLangDevicePool(self.token_to_kv_pool_allocator, architecture=architecture)
        self.device = self.device_pool.device
        layout = self.device_pool.layout
        s = self.settings
        device_tokens = self.device_pool.pool_pages * self.page_size
        host_tokens = s.host_tokens_for(device_tokens)
        salt = ";".join(x for x in (model_salt, s.tenant_salt, consensus.salt if consensus is not None else "") if x)
        namespace = Namespace.for_model(layout, self.page_size, salt)
        disk_tokens = s.disk_tokens_for(layout.bytes_per_token) if host_tokens >= self.page_size and not s.store else 0
        disk_dir = None
        if disk_tokens >= self.page_size:
            disk_dir = Path(s.disk_dir).expanduser() if s.disk_dir else default_disk_dir() / namespace.root.hex()[:16]
            if consensus is not None:
                disk_dir = consensus.rank_dir(disk_dir)  # each rank's shard of every page in its own files
        else:
            disk_tokens = 0
        policy = s.tiering(getattr(params, "eviction_policy", None))
        eviction = policy.eviction_policy
        self.config = CacheConfig(
            layout=layout,
            device_tokens=device_tokens,
            host_tokens=host_tokens,
            disk_tokens=disk_tokens,
            page_size=self.page_size,
            disk_dir=disk_dir,
            eviction_policy=eviction,
            write_policy=s.write_policy,
            write_through_threshold=s.write_through_threshold,
            disk_write_policy=s.disk_write_policy,
            predictor=s.predictor,
            tenant_salt=salt,
            disk_fsync=s.disk_fsync,
            eviction_demotes=s.eviction_demotes,
            store_url=s.store if host_tokens >= self.page_size else None,
            store_min_hits=s.store_min_hits,
        )
        self.cache = build_cache(self.config, device=self.device_pool, clock=clock)
        if s.fault_disk_read_file and DISK in self.cache.stores:
            inject_read_faults(self.cache.stores[DISK], consensus.rank if consensus is not None else 0, s.fault_disk_read_file)
        if consensus is not None:
            consensus.start(self.cache)  # a collective: every rank builds its cache at the same point
        self.engine = TransferEngine(self.cache, workers=s.transfer_workers)  # started on first use
        # host -> device loads queued layer by layer, waited for by SGLang's KV pool (factory registers it).
        # TP >= 2: a load's nodes unlock only once every rank reported it done (sgl_hicache_on_step)
        self.layer_loads = (LayerLoads(self.cache, agreed=consensus is not None)
                            if s.layerwise_loads and HOST in self.cache.stores else None)
        self.deferred_rid: str | None = None  # the request init_load_back last answered "retry" (scheduler_hooks)
        executor = ThreadExecutor(self.cache, self.engine, layers=self.layer_loads)
        self.controller = build_controller(self.cache, consensus.gate(executor) if consensus is not None else executor, policy, clock)
        self.counters = BackendCounters()
        self.server_port = server_port
        self._states: OrderedDict[str, _ReqState] = OrderedDict()
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._publisher: _StatsPublisher | None = None
        self._metrics_enabled = bool(getattr(params, "enable_metrics", False))
        if self._metrics_enabled:
            self.init_metrics_collector()
        self.call_timer = CallTimer().instrument(self) if s.time_calls else None
        self.io_guard = IOGuard().install(self.cache) if s.check_scheduler_io else None
        logger.info(
            "sgl_hicache: device %d tokens (SGLang pool), host %d tokens, disk %d tokens at %s, page %d, write %s, disk write %s, eviction %s, predictor %s, prefetch %s",
            device_tokens, host_tokens, disk_tokens, disk_dir, self.page_size, s.write_policy, s.disk_write_policy, eviction, s.predictor, s.prefetch,
        )

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def root_node(self):
        return self.cache.tree.root

    def start(self) -> "TieredRadixCache":
        """Start the stats publisher (the transfer engine starts on first use)."""
        if self._publisher is None and (self.settings.stats_file or self._metrics_enabled):
            self._publisher = _StatsPublisher(self, self.settings.stats_file, self.settings.stats_interval_s, prometheus=self._metrics_enabled)
            self._publisher.start()
        return self

    def shutdown(self) -> None:
        """Stop the publisher and the transfer engine; in-flight promotions are cancelled."""
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None
        self._drop_all_jobs()
        self.engine.stop()
        if self.layer_loads is not None:
            self.layer_loads.finish_all()
        close = getattr(self.cache.stores.get(DISK), "close", None)  # the shared store's connections
        if close is not None:
            close()

    def _drop_all_jobs(self) -> None:
        for st in list(self._states.values()):
            self._drop_job(st)
        self._states.clear()
        self.controller.shutdown()

    def _drop_job(self, st: _ReqState) -> None:
        if st.ticket is not None:
            self.controller.drop(st.ticket)  # cancels what has not arrived; waits for running copies
            if self.consensus is not None:
                self.consensus.forget(st.ticket)

    # ---- BasePrefixCache: abstract -------------------------------------------------------
    def reset(self) -> None:
        """SGLang's flush: forget the device and host copies (disk files stay, for a restart)."""
        self._drop_all_jobs()
        self.engine.stop()
        if self.layer_loads is not None:
            self.layer_loads.finish_all()  # no copy may land in a slot after the flush frees it
        self.cache.reset()
        self.device_pool.reset_accounting()

    def _empty_match(self) -> MatchResult:
        root = self.cache.tree.root
        return MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)

    @staticmethod
    def _cacheable(key) -> bool:
        return not (getattr(key, "is_bigram", False) or key.extra_key or key.cache_salt)

    def _state(self, req) -> _ReqState | None:
        if req is None:
            return None
        rid = req.rid
        st = self._states.get(rid)
        if st is None:
            st = _ReqState(created=time.monotonic())
            self._states[rid] = st
            if len(self._states) > _MAX_REQ_STATES:  # requests SGLang never released: forget the oldest
                _, old = self._states.popitem(last=False)
                self._drop_job(old)
        return st

    @_frees_batched
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if self.disable or len(key) == 0:
            return self._empty_match()
        if not self._cacheable(key):
            return self._empty_match()
        tokens = key.raw_token_ids()
        aligned = len(tokens) - len(tokens) % self.page_size
        if aligned == 0:
            return self._empty_match()
        st = self._state(params.req)
        self.counters.matches += 1
        if self.layer_loads is not None:
            self.layer_loads.reap()
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
        if not self.settings.prefetch and m.disk_tokens:
            # without prefetch nothing brings disk pages up off the scheduler thread: do not promise them
            m = m.head(m.device_tokens + m.host_tokens)
        if st is not None:
            st.last_match = m
        self._maybe_check()
        return MatchResult(
            device_prefix_len=m.device_tokens,
            last_device_node=m.last_device_node,
            last_host_node=m.last_node,
            best_match_node=m.last_node,
            host_hit_length=m.lower_tier_tokens,
        )

    @_frees_batched
    def init_load_back(self, params: InitLoadBackParams) -> Optional[tuple[int, Any]]:
        req = params.req
        promised = int(params.host_hit_length)
        node = params.best_match_node
        st = self._states.get(req.rid) if req is not None else None
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
        tokens = req.full_untruncated_fill_ids[:target]
        m = self.cache.match(tokens, touch=False)
        if m.tokens != target or m.last_node is not node or m.device_tokens != prefix or m.disk_tokens:
            # the tree changed since the match (a page went missing on disk), or pages are still on
            # disk only (reading them here would block the scheduler): recompute
            self.counters.load_back_declined += 1
            why = ("disk_only" if m.disk_tokens and m.tokens == target else "device_grew" if m.device_tokens > prefix
                   else "path_changed")
            self.counters.extra[why] = self.counters.extra.get(why, 0) + 1
            if ticket is not None:
                self.controller.release(ticket)
            return fallback
        m2, _ = self.controller.load(tokens, m)
        if ticket is not None:
            self.controller.release(ticket)
        self.counters.load_back_seconds += time.perf_counter() - t0
        if m2.device_tokens != target:
            self.counters.load_back_declined += 1
            self.cache.stats.add("loads_recomputed")
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

    def yield_to_demand(self, req, short_tokens: int) -> int:
        """Demand preempts prefetch, with the embedded engine's rule (`RequestController.yield_to_demand`
        decides): `req` was refused for want of `short_tokens` device tokens, and the prefetch jobs of
        the other waiting requests lock their paths' device pages; the jobs holding pages it lacks end
        (the back of the queue first; none when ending all would not make room). Called by
        `scheduler_hooks.keep_admitting`, which then retries the request once. Nothing with TP >= 2
        (the ranks would have to agree on it first: not built) or without a shortfall. Returns the
        number of jobs ended."""
        if self.disable or short_tokens <= 0 or self.consensus is not None:
            return 0
        rid = getattr(req, "rid", None)
        tickets = [st.ticket for r, st in self._states.items() if r != rid and st.ticket is not None and st.ticket.job is not None]
        if not tickets:
            return 0
        ended = self.controller.yield_to_demand(tickets, -(-int(short_tokens) // self.page_size))
        self.counters.prefetch_yields += ended
        return ended

    @_frees_batched
    def after_batch_formed(self) -> None:
        """Once per scheduling step, after SGLang formed (and allocated) the prefill batch
        (`scheduler_hooks.set_consumer_index`): record finished layer-wise loads and background copies
        and start new write-back. Not in `match_prefix`: a copy started there pins the coldest device
        nodes while the admission round that counted them as evictable is still allocating."""
        if self.disable:
            return
        if self.layer_loads is not None:
            self.layer_loads.reap()
        # TP >= 2: new copies start in sgl_hicache_after_step, on every rank at the same point
        self.controller.pump_writeback(start_new=self.consensus is None)

    def load_back_is_cache_owned(self) -> bool:
        return True

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        if self.disable or req.skip_radix_cache_insert:
            return
        if req.extra_key or req.cache_salt:
            self.counters.uncacheable_requests += 1
            return
        ps = self.page_size
        token_ids = req.full_untruncated_fill_ids[:up_to]
        aligned = len(token_ids) - len(token_ids) % ps
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
            logger.error("sgl_hicache: request %s: tree device path %d shorter than its protected prefix %d", req.rid, d, protected)
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
        self._maybe_check()

    def insert(self, params: InsertParams) -> InsertResult:
        """Direct insert (SGLang 0.5.23's scheduler does not call it; `checkpoint` is the path).
        The caller keeps the pages the tree did not take, as with SGLang's RadixCache: it frees
        `value[:prefix_len]` (duplicates) and the tree owns the rest it adopted."""
        if self.disable or params.key is None or not self._cacheable(params.key):
            return InsertResult(prefix_len=0)
        tokens = params.key.raw_token_ids()
        aligned = len(tokens) - len(tokens) % self.page_size
        if aligned == 0 or params.value is None:
            return InsertResult(prefix_len=0)
        pages = self.device_pool.pages_of(params.value[:aligned].to(torch.int64))
        r = self.cache.insert(tokens[:aligned], pages, from_allocate_device=False)
        self.device_pool.adopt(r.adopted_pages)
        return InsertResult(prefix_len=r.prefix_tokens, total_len=aligned, last_device_node=r.last_node)

    @_frees_batched
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        t0 = time.perf_counter()
        pages = -(-int(params.num_tokens) // self.page_size)
        if self.layer_loads is not None:
            self.layer_loads.reap()  # finished layer-wise loads unpin their nodes
        # record finished background copies (their pages become free drops), but start none here:
        # a new copy pins the coldest nodes, exactly the ones this eviction is about to free, and the
        # scheduler sized its allocation from evictable_size() before calling
        self.controller.pump_writeback(start_new=False)
        freed = self.cache.evict(DEVICE, pages) * self.page_size
        if freed < params.num_tokens and any(op.src == DEVICE for op in self.controller.writeback):
            # the scheduler counted on pages a background copy holds (it never counts them:
            # write-back locks its path, so evictable_size() leaves them out; kept as a guard): stop
            # the copies not started yet, never wait for a running one
            self.controller.cancel_device_writeback()
            freed += self.cache.evict(DEVICE, pages - freed // self.page_size) * self.page_size
        if freed < params.num_tokens:
            self.counters.evict_short += 1  # SGLang's allocation may then fail: counted, never waited for
        self.counters.evict_calls += 1
        self.counters.evicted_tokens += freed
        self.update_eviction_metrics(freed, t0)
        self._maybe_check()
        return EvictResult(num_tokens_evicted=freed)

    def inc_lock_ref(self, node) -> IncLockRefResult:
        if self.disable or node is None:
            return IncLockRefResult(delta=0)
        delta = 0
        n = node
        while n is not None and not n.is_root:
            if n.lock_ref == 0 and n.device is not None:
                delta -= n.num_pages * self.page_size
            n = n.parent
        self.cache.lock(node)
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        if self.disable or node is None:
            return DecLockRefResult(delta=0)
        delta = 0
        n = node
        while n is not None and not n.is_root:
            if n.lock_ref == 1 and n.device is not None:
                delta += n.num_pages * self.page_size
            n = n.parent
        self.cache.unlock(node)
        return DecLockRefResult(delta=delta)

    # ---- BasePrefixCache: the rest the scheduler uses --------------------------------------
    def path_device_indices(self, node) -> torch.Tensor:
        pages: list[int] = []
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
        tokens = key.raw_token_ids()
        aligned = len(tokens) - len(tokens) % self.page_size
        if aligned:
            self.cache.match(tokens[:aligned], touch=True)

    def evictable_size(self) -> int:
        """Device tokens the tree could free now: unlocked and unpinned (the scheduler polls this
        thousands of times per second; the tree keeps the figure on every lock, pin and residency
        change, so this is O(1)). Pinned pages (a background copy or a prefetch reads them) count as
        protected: SGLang's idle check wants free + evictable + protected == the pool."""
        return self.cache.tree.evictable_pages(DEVICE) * self.page_size

    def protected_size(self) -> int:
        return self.cache.tree.protected[DEVICE] * self.page_size

    full_evictable_size = evictable_size
    full_protected_size = protected_size

    def total_size(self) -> int:
        return self.cache.tree.pages[DEVICE] * self.page_size

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def on_release(self, req, *, checkpointed: bool) -> None:
        st = self._states.pop(req.rid, None)
        if st is not None:
            self._drop_job(st)
        if getattr(req, "_sgl_hicache_recorded", False) or not getattr(req, "_cache_breakdown_computed", False):
            return
        try:
            req._sgl_hicache_recorded = True
        except AttributeError:
            pass
        self._record(req, st)

    def _record(self, req, st: _ReqState | None) -> None:
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
        st = self._states.pop(handle.rid, None)
        if st is not None:
            self._drop_job(st)

    def sgl_hicache_on_step(self) -> None:
        """Once per scheduler step on every rank (rank_consensus.install_step_hook): with TP >= 2,
        agree on the background transfers' outcomes and on which waiting requests give up, then
        record the finished write-backs. Nothing at TP=1."""
        c = self.consensus
        if c is None or self.disable:
            return
        waiting = [(st.ticket, st) for st in self._states.values() if st.ticket is not None and st.ticket.job is not None]
        ops = list(self.controller.writeback)
        for job in self.controller.predicted:
            ops += job.ops()
        now = time.monotonic()
        flags = []
        for ticket, st in waiting:
            ops += ticket.job.ops()  # type: ignore[union-attr]
            budget = self.settings.load_timeout_s - (now - st.created)
            flags.append((ticket, self.controller.executor.eta(ticket.job) > budget))  # type: ignore[arg-type]
        loads = self.layer_loads
        agreed_loads = c.step(ops, flags, digest=lambda: tree_digest(self.cache, (len(self._states),)),
                              layer_loads=(loads.queued, loads.done_prefix()) if loads is not None else (0, 0))
        if loads is not None:
            loads.reap_agreed(agreed_loads)
        self.controller.pump_writeback(start_new=False)

    def sgl_hicache_after_step(self) -> None:
        """After the scheduler chose its batch (and evicted for it), on every rank: with TP >= 2, start
        the next background write-back batch here, so it copies during the forward pass and is agreed
        at the next step rather than pinning the coldest pages through this step's evictions."""
        if self.consensus is not None and not self.disable:
            self.controller.pump_writeback()

    def pretty_print(self) -> None:
        print(self.tree_text())

    def tree_text(self, max_nodes: int = 200) -> str:
        """The tree, one node a line: tiers ([DHK] = device, host, disk), tokens, locks, hits."""
        lines = []
        stack = [(c, 1) for c in reversed(list(self.cache.tree.root.children.values()))]
        while stack and len(lines) < max_nodes:
            node, depth = stack.pop()
            tiers = "".join(c if node.in_tier(t) else "-" for t, c in zip(TIERS, "DHK"))
            lines.append(f"{'  ' * depth}[{tiers}] {node.num_pages * self.page_size} tok lock={node.lock_ref} hits={node.hit_count}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        if stack:
            lines.append(f"... ({self.cache.tree.node_count - len(lines)} more nodes)")
        lines.append(f"#tokens device={self.cache.tree.pages[DEVICE] * self.page_size} host={self.cache.tree.pages[HOST] * self.page_size} disk={self.cache.tree.pages[DISK] * self.page_size}")
        return "\n".join(lines)

    # ---- checks and stats ----------------------------------------------------------------
    def _inflight(self) -> bool:
        if self.layer_loads is not None and self.layer_loads.inflight:
            return True
        return self.controller.inflight() or any(s.ticket is not None and s.ticket.job is not None for s in self._states.values())

    def _maybe_check(self) -> None:
        """With `check_invariants`, verify the tree and every store's accounting (skipped while a
        prefetch is in flight: its destination pages are allocated but not yet in the tree)."""
        if self.settings.check_invariants and not self._inflight():
            self.cache.check()

    def pool_accounting(self) -> dict:
        """The pools' free counts against the tree's (in the scheduler thread, for exact figures).

        `request_held_tokens` are the device tokens neither free nor the cache's: the KV of running
        requests. Once the server is idle it must be 0, and `ok` says every tier's accounting holds."""
        for op in self.controller.writeback:  # background disk writes are short: finish them for exact figures
            op.executed.wait(timeout=10)
        if self.layer_loads is not None:
            if self.consensus is None:
                self.layer_loads.finish_all()
            else:  # this may run on one rank only: unlocking stays with the agreed step
                self.layer_loads.synchronize()
        self.controller.pump_writeback(start_new=False)
        ps = self.page_size
        alloc_free = int(self.token_to_kv_pool_allocator.available_size())
        pool = self.device_pool.pool_pages * ps
        owned = self.device_pool.used_pages * ps
        out = {
            "page_size": ps,
            "device_pool_tokens": pool,
            "device_free_tokens": alloc_free,
            "device_cache_owned_tokens": owned,
            "device_tree_tokens": self.cache.tree.pages[DEVICE] * ps,
            "request_held_tokens": pool - alloc_free - owned,
            "host_used_tokens": self.cache.stores[HOST].used_pages * ps if HOST in self.cache.stores else 0,
            "host_tree_tokens": self.cache.tree.pages[HOST] * ps,
            "disk_stored_tokens": (self.cache.stores[DISK].stored_pages if DISK in self.cache.stores else 0) * ps,
            "disk_tree_tokens": self.cache.tree.pages[DISK] * ps,
            "evictable_tokens": self.evictable_size(),
            "protected_tokens": self.protected_size(),
            "waiting_states": len(self._states),
            "inflight_prefetch_jobs": sum(1 for s in self._states.values() if s.ticket is not None and s.ticket.job is not None),
        }
        if self._inflight():
            out["check"] = "skipped: transfers in flight"
        else:
            try:
                self.cache.check()
                out["check"] = "ok"
            except AssertionError as e:
                out["check"] = f"failed: {e}"
        return out

    def stats(self, exact: bool = False) -> dict:
        """Everything `sgl-hicache stats` shows: the cache snapshot, backend counters, config,
        and (with `exact`, only from the scheduler thread) the pool accounting and the tree view."""
        snap = self.cache.snapshot()
        wb = self.controller.writeback_counters
        snap["backend"] = {k: v for k, v in vars(self.counters).items() if k != "extra"}
        snap["backend"]["load_back_declined_by_reason"] = dict(self.counters.extra)
        snap["backend"].update(writeback_pages=wb.host_pages, device_writeback_pages=wb.device_pages,
                               device_writeback_cancelled_pages=wb.device_cancelled_pages)
        snap["config"] = {
            "page_size": self.page_size,
            "device_tokens": self.device_pool.pool_pages * self.page_size,
            "host_tokens": self.config.host_tokens,
            "disk_tokens": self.config.disk_tokens,
            "disk_dir": str(self.config.disk_dir) if self.config.disk_dir else None,
            "write_policy": self.config.write_policy,
            "disk_write_policy": self.config.disk_write_policy,
            "eviction_policy": self.config.eviction_policy,
            "predictor": self.config.predictor,
            "prefetch": self.settings.prefetch,
            "layerwise_loads": self.layer_loads is not None,
            "skip_waiting_admission": self.settings.skip_waiting_admission,
            "namespace": self.cache.namespace.description,
            "store": self.config.store_url,
        }
        if self.consensus is not None:
            snap["backend"]["tp"] = {"size": self.consensus.size, "rank": self.consensus.rank, **vars(self.consensus.counts)}
        snap["bandwidth_bytes_per_s"] = self.cache.meter.snapshot()
        if self.call_timer is not None:
            snap["scheduler_calls"] = self.call_timer.snapshot()
        if self.layer_loads is not None:
            snap["layer_loads"] = self.layer_loads.snapshot()
        if self.io_guard is not None:
            snap["scheduler_io"] = self.io_guard.snapshot()
        snap["time"] = time.time()
        snap["pid"] = os.getpid()
        if exact:
            snap["pool"] = self.pool_accounting()
            snap["tree_text"] = self.tree_text()
            try:
                from ..tree.view import largest_subtrees

                snap["tree"] = largest_subtrees(self.cache.tree, self.config.page_bytes, now=self.cache.clock())
            except ImportError:
                pass
        return snap

    def prometheus(self) -> str:
        snap = self.cache.snapshot()
        return prometheus_text(snap, self.cache.stored_pages(), self.page_size)


class _StatsPublisher:
    """A daemon thread of the scheduler process: every `interval` seconds it writes the stats JSON
    (plus Prometheus text next to it, `<file>.prom`) atomically, and, with `--enable-metrics`,
    publishes our figures through SGLang's Prometheus registry (multiprocess mode), so they appear on
    SGLang's own `/metrics`. Started by the factory, stopped by `TieredRadixCache.shutdown`."""

    def __init__(self, cache: TieredRadixCache, path: str | None, interval: float, prometheus: bool) -> None:
        self.cache = cache
        self.path = Path(path).expanduser() if path else None
        self.interval = interval
        self.prom = _PromExport(cache.config.page_size) if prometheus else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sgl-hicache-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.publish()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def publish(self) -> None:
        try:
            snap = self.cache.stats(exact=False)
            if self.path is not None:
                write_atomic(self.path, json.dumps(snap, indent=1, sort_keys=True))
                write_atomic(self.path.with_suffix(self.path.suffix + ".prom"), prometheus_text(snap))
            if self.prom is not None:
                self.prom.update(snap)
        except Exception:  # stats must never take the scheduler down
            logger.exception("sgl_hicache: publishing stats failed")


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class _PromExport:
    """Our counters and gauges in SGLang's Prometheus registry (the scheduler process writes them to
    SGLang's multiprocess directory; SGLang's HTTP `/metrics` exports them). Counters are fed by the
    difference to the last snapshot. SGLang's own `sglang:cached_tokens_total{cache_source}` is not
    duplicated: SGLang already counts it from `cached_tokens_details`."""

    def __init__(self, page_size: int) -> None:
        from prometheus_client import Counter, Gauge

        self.page_size = page_size
        self.last: dict[tuple, float] = {}
        self.counters = {
            "hit_tokens": Counter("sgl_hicache_hit_tokens", "Prompt tokens served per tier (sgl_hicache)", ["tier"]),
            "miss_tokens": Counter("sgl_hicache_miss_tokens", "Prompt tokens computed (sgl_hicache)"),
            "requests": Counter("sgl_hicache_requests", "Requests recorded by sgl_hicache"),
            "evicted_tokens": Counter("sgl_hicache_evicted_tokens", "Tokens that left a tier", ["tier"]),
            "demoted_tokens": Counter("sgl_hicache_demoted_tokens", "Tokens copied down from a tier on eviction", ["tier"]),
            "promoted_tokens": Counter("sgl_hicache_promoted_tokens", "Tokens copied up into a tier", ["tier"]),
            "bytes_moved": Counter("sgl_hicache_bytes_moved", "Bytes copied per link", ["link"]),
            "prefetch": Counter("sgl_hicache_prefetch_tokens", "Prefetch / prediction tokens by outcome", ["kind", "outcome"]),
            "store": Counter("sgl_hicache_store", "Shared store tier events (docs/store.md)", ["event"]),
        }
        self.gauges = {
            "stored_tokens": Gauge("sgl_hicache_stored_tokens", "Tokens resident per tier", ["tier"], multiprocess_mode="mostrecent"),
            "capacity_tokens": Gauge("sgl_hicache_capacity_tokens", "Capacity per tier", ["tier"], multiprocess_mode="mostrecent"),
            "call_seconds": Gauge("sgl_hicache_scheduler_call_seconds", "Wall time of a cache call on the scheduler thread",
                                  ["call", "quantile"], multiprocess_mode="mostrecent"),
        }

    def _inc(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        delta = value - self.last.get(key, 0.0)
        if delta > 0:
            c = self.counters[name]
            (c.labels(**labels) if labels else c).inc(delta)
        self.last[key] = value

    def update(self, snap: dict) -> None:
        for t in TIERS:
            label = snap.get("lower_tier", t) if t == DISK else t  # the lower slot is named by what holds it
            for name in ("hit_tokens", "evicted_tokens", "demoted_tokens", "promoted_tokens"):
                self._inc(name, snap[name][t], tier=label)
            self.gauges["stored_tokens"].labels(tier=label).set(snap["stored_tokens"][t])
            self.gauges["capacity_tokens"].labels(tier=label).set(snap["capacity_tokens"][t])
        for event, v in (snap.get("store") or {}).items():
            if isinstance(v, int) and not isinstance(v, bool) and event != "tracked_pages":
                self._inc("store", v, event=event)
        self._inc("miss_tokens", snap["miss_tokens"])
        self._inc("requests", snap["requests"])
        for call, d in (snap.get("scheduler_calls") or {}).items():
            for q in ("p50", "p99", "max"):
                self.gauges["call_seconds"].labels(call=call, quantile=q).set(d[f"{q}_us"] / 1e6)
        for link, v in snap["bytes_moved"].items():
            self._inc("bytes_moved", v, link=link)
        for kind, d in snap["prefetch"].items():
            for outcome in ("promoted_tokens", "used_tokens", "wasted_tokens"):
                self._inc("prefetch", d[outcome], kind=kind, outcome=outcome.replace("_tokens", ""))


# ---- factory -----------------------------------------------------------------------------
def _model_salt(server_args) -> str:
    path = str(getattr(server_args, "model_path", "") or "")
    if path and os.path.isdir(path):
        path = os.path.realpath(path)
    parts = [f"model={path}"]
    for name in ("revision", "load_format", "quantization", "kv_cache_dtype"):
        v = getattr(server_args, name, None)
        if v not in (None, "", "auto"):
            parts.append(f"{name}={v}")
    return ";".join(parts)


def factory(ctx) -> TieredRadixCache:
    """`register_radix_cache_backend` factory: validates what we support and builds the cache."""
    problems = []
    if ctx.enable_hierarchical_cache:
        problems.append("--enable-hierarchical-cache (SGLang's own HiCache) cannot be combined with it; drop that flag")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or getattr(ctx, "is_dsa", False):
        problems.append("hybrid SWA / Mamba / DSA models are not supported")
    sa = ctx.server_args
    if getattr(sa, "enable_dp_attention", False):
        problems.append("DP attention (--enable-dp-attention) is not supported: its attention-DP ranks schedule "
                        "different requests, so one tree cannot be agreed across the TP group; use --tp alone")
    if (getattr(sa, "dp_size", 1) or 1) > 1:
        problems.append(f"dp_size={sa.dp_size} in one server is not supported: run one server per replica "
                        "(--tp N each) behind a router, sharing SGLHICACHE_DISK_DIR (docs/sglang-backend.md)")
    if (getattr(sa, "pp_size", 1) or 1) > 1:
        problems.append(f"pp_size={sa.pp_size} (pipeline parallelism) is not supported")
    if problems:
        raise ValueError("--radix-cache-backend sgl_hicache: " + "; ".join(problems))
    settings = load_settings()
    consensus = None
    tp = int(ctx.tp_size or 1)
    if tp > 1:
        group = ctx.params.tp_cache_group or getattr(ctx.tp_group, "cpu_group", None)
        if group is None:
            raise ValueError(f"--radix-cache-backend sgl_hicache: tp_size={tp} but SGLang gave the cache no TP group")
        if not step_hook_installed():
            raise ValueError(f"--radix-cache-backend sgl_hicache: tp_size={tp} needs the per-step hook on the scheduler, "
                             "which the sgl_hicache plugin did not install (see the log); run with --tp 1")
        consensus = RankConsensus(group, int(ctx.tp_rank), tp, check=settings.consensus_check)
    for var in unknown_env():
        logger.warning("sgl_hicache: ignoring unknown environment variable %s", var)
    arch = "llama"
    try:
        archs = getattr(ctx.model_config.hf_config, "architectures", None) or []
        if archs:
            arch = str(archs[0])
    except Exception:
        pass
    cache = TieredRadixCache(ctx.params, settings, architecture=arch, model_salt=_model_salt(sa), server_port=getattr(sa, "port", None),
                             consensus=consensus)
    if cache.layer_loads is not None:
        cache.layer_loads.forward_stream = getattr(getattr(ctx.tp_worker, "model_runner", None), "forward_stream", None)
        # SGLang's supported seam for layer-wise loads (mem_cache/registry.py does the same for its
        # unified-cache linker): the KV pool calls wait_until(layer) before reading a layer, and the
        # TP worker sets the consumer from batch.hicache_consumer_index (scheduler_hooks sets it)
        ctx.params.token_to_kv_pool_allocator.get_kvcache().register_layer_transfer_counter(cache.layer_loads)
        ctx.tp_worker.register_hicache_layer_transfer_counter(cache.layer_loads)
    return cache.start()
