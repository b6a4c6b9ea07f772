"""What the SGLang backend shows of itself: the stats snapshot, the pool accounting, the tree text, the
Prometheus export and the thread that publishes them.

- `stats_snapshot(cache, exact)`: everything `sgl-hicache stats` shows (the core's snapshot plus the
  backend's counters, config, TP figures, call timings; with `exact` the pool accounting and tree view).
- `pool_accounting(cache)`: the pools' free counts against the tree's (scheduler thread only).
- `tree_text(tree, page_size)`: the tree, one node a line.
- `BackendCounters`: the SGLang path's figures that `CacheStats` does not keep (the stats show them).
- `StatsPublisher`: a daemon thread writing the stats file (and `<file>.prom`) and feeding
  `PromExport`, our figures in SGLang's Prometheus registry.
- `write_atomic(path, text)`: write a file so a reader never sees half of it.

Nothing here changes the cache; the stats file and Prometheus figures are read-only views.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..stats import prometheus_text
from ..tiers.base import DEVICE, DISK, HOST, TIERS
from ..tree.radix import RadixTree

if TYPE_CHECKING:
    from ..cache import TieredCache
    from ..client.backend_settings import BackendSettings
    from ..config import CacheConfig
    from ..control.lifecycle import RequestController
    from ..policy.admission import PrefillCost, PrefillCostFit
    from .debug.call_timer import CallTimer, IOGuard
    from .device_pool import SGLangDevicePool
    from .hints.hint_server import HintListener
    from .hints.request_hints import RequestHints
    from .kinds.mamba.mamba_snapshots import SnapshotTiers
    from .layer_loads import LayerLoads
    from .parallel.data_parallel import DPPlacement
    from .parallel.rank_consensus import RankConsensus
    from .req_states import RequestStates
    from .rewarm_calls import ServerRewarm

logger = logging.getLogger(__name__)


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
    admission_holds: int = 0  # a new request held a round (`admission_hold`)
    prefetch_yields: int = 0  # waiting requests' prefetch jobs ended so a request short of device room fits
    evict_short: int = 0  # evictions that freed fewer pages than asked (never waited for a copy in flight)
    extra: dict = field(default_factory=dict)


def tree_text(tree: RadixTree, page_size: int, max_nodes: int = 200) -> str:
    """The tree, one node a line: tiers ([DHK] = device, host, disk), tokens, locks, hits."""
    lines: list[str] = []
    stack = [(c, 1) for c in reversed(list(tree.root.children.values()))]
    while stack and len(lines) < max_nodes:
        node, depth = stack.pop()
        tiers = "".join(c if node.in_tier(t) else "-" for t, c in zip(TIERS, "DHK"))
        lines.append(
            f"{'  ' * depth}[{tiers}] {node.num_pages * page_size} tok lock={node.lock_ref} hits={node.hit_count}"
        )
        stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
    if stack:
        lines.append(f"... ({tree.node_count - len(lines)} more nodes)")
    lines.append(
        f"#tokens device={tree.pages[DEVICE] * page_size} host={tree.pages[HOST] * page_size} "
        f"disk={tree.pages[DISK] * page_size}"
    )
    return "\n".join(lines)


def pool_accounting(rc: CacheViews) -> dict[str, Any]:
    """The pools' free counts against the tree's (in the scheduler thread, for exact figures).

    `request_held_tokens` are the device tokens neither free nor the cache's: the KV of running
    requests. Once the server is idle it must be 0, and `check` says every tier's accounting holds."""
    for op in rc.controller.writeback:  # background disk writes are short: finish them for exact figures
        op.executed.wait(timeout=10)
    if rc.layer_loads is not None:
        if rc.consensus is None:
            rc.layer_loads.finish_all()
        else:  # this may run on one rank only: unlocking stays with the agreed step
            rc.layer_loads.synchronize()
    rc.controller.pump_writeback(start_new=False)
    ps = rc.page_size
    cache = rc.cache
    alloc_free = int(rc.token_to_kv_pool_allocator.available_size())
    pool = rc.device_pool.pool_pages * ps
    owned = rc.device_pool.used_pages * ps
    out: dict[str, Any] = {
        "page_size": ps,
        "device_pool_tokens": pool,
        "device_free_tokens": alloc_free,
        "device_cache_owned_tokens": owned,
        "device_tree_tokens": cache.tree.pages[DEVICE] * ps,
        "request_held_tokens": pool - alloc_free - owned,
        "host_used_tokens": cache.stores[HOST].used_pages * ps if HOST in cache.stores else 0,
        "host_tree_tokens": cache.tree.pages[HOST] * ps,
        "disk_stored_tokens": (cache.stores[DISK].stored_pages if DISK in cache.stores else 0) * ps,
        "disk_tree_tokens": cache.tree.pages[DISK] * ps,
        "evictable_tokens": rc.evictable_size(),
        "protected_tokens": rc.protected_size(),
        "waiting_states": len(rc.req_states),
        "inflight_prefetch_jobs": len(rc.req_states.prefetching()),
    }
    if rc.transfers_in_flight():
        out["check"] = "skipped: transfers in flight"
    else:
        try:
            cache.check()
            out["check"] = "ok"
        except AssertionError as e:
            out["check"] = f"failed: {e}"
    return out


def stats_snapshot(rc: CacheViews, exact: bool = False) -> dict[str, Any]:
    """Everything `sgl-hicache stats` shows: the cache snapshot, backend counters, config,
    and (with `exact`, only from the scheduler thread) the pool accounting and the tree view."""
    cache, config = rc.cache, rc.config
    snap = cache.snapshot()
    wb = rc.controller.writeback_counters
    backend = {k: v for k, v in vars(rc.counters).items() if k != "extra"}
    backend["load_back_declined_by_reason"] = dict(rc.counters.extra)
    backend.update(
        writeback_pages=wb.host_pages,
        device_writeback_pages=wb.device_pages,
        device_writeback_cancelled_pages=wb.device_cancelled_pages,
    )
    cost = rc.prefill_cost()
    backend["prefill_cost"] = {
        "steps_timed": rc.prefill_cost_fit.steps,
        "fixed_s": cost.fixed_s if cost else None,
        "per_token_s": cost.per_token_s if cost else None,
        "per_pair_s": cost.per_pair_s if cost else None,
    }
    snap["backend"] = backend
    snap["speculation"] = rc.controller.speculation.counters()
    snap["rewarm"] = rc.rewarm.counters()  # re-warm at start: its progress and records (rewarm_calls.py)
    snap["agent_hints"] = {**rc.controller.hints.summary(), "requests": rc.request_hints.status()}
    snap["config"] = {
        "page_size": rc.page_size,
        "device_tokens": rc.device_pool.pool_pages * rc.page_size,
        "host_tokens": config.host_tokens,
        "disk_tokens": config.disk_tokens,
        "disk_dir": str(config.disk_dir) if config.disk_dir else None,
        "write_policy": config.write_policy,
        "disk_write_policy": config.disk_write_policy,
        "eviction_policy": config.eviction_policy,
        "predictor": config.predictor,
        "prefetch": rc.settings.prefetch,
        "layerwise_loads": rc.layer_loads is not None,
        "skip_waiting_admission": rc.settings.skip_waiting_admission,
        "admission_hold": rc.settings.admission_hold,
        "rewarm": rc.settings.rewarm,
        "namespace": cache.namespace.description,
        "pool_kind": rc.device_pool.adapter.kind,  # the device-pool adapter serving SGLang's pool (mha, mla)
        "store": config.store_url,
    }
    if rc.placement.data_parallel:
        backend["dp"] = rc.placement.describe()
    if rc.consensus is not None:
        backend["tp"] = {"size": rc.consensus.size, "rank": rc.consensus.rank, **vars(rc.consensus.counts)}
    if rc.hint_listener is not None:  # the hint API: where it listens (the replayer finds it here) and its counters
        snap["hints"] = {"port": rc.hint_listener.port, "host": rc.settings.hint_host, **rc.hint_status()}
    if rc.snapshots is not None:  # hybrid Mamba: the state snapshots per tier and where hits restored them from
        snap["mamba_states"] = rc.snapshots.stats()
    snap["bandwidth_bytes_per_s"] = cache.meter.snapshot()
    if rc.call_timer is not None:
        snap["scheduler_calls"] = rc.call_timer.snapshot()
    if rc.layer_loads is not None:
        snap["layer_loads"] = rc.layer_loads.snapshot()
    if rc.io_guard is not None:
        snap["scheduler_io"] = rc.io_guard.snapshot()
    snap["time"] = time.time()
    snap["pid"] = os.getpid()
    if exact:
        snap["pool"] = pool_accounting(rc)
        snap["tree_text"] = rc.tree_text()
        try:
            from ..tree.view import largest_subtrees

            snap["tree"] = largest_subtrees(cache.tree, config.page_bytes, now=cache.clock())
        except ImportError:
            pass
    return snap


class CacheViews:
    """Mixin of `TieredRadixCache`: the read-only views of the cache that the stats, the Prometheus
    text and SGLang's `pretty_print` show (the functions above do the work). The annotations name
    what those read of the backend (none is set here)."""

    cache: TieredCache
    config: CacheConfig
    page_size: int
    settings: BackendSettings
    controller: RequestController
    counters: BackendCounters
    device_pool: SGLangDevicePool
    token_to_kv_pool_allocator: Any  # SGLang's
    layer_loads: LayerLoads | None
    consensus: RankConsensus | None
    placement: DPPlacement
    req_states: RequestStates
    request_hints: RequestHints
    hint_listener: HintListener | None
    snapshots: SnapshotTiers | None
    rewarm: ServerRewarm
    prefill_cost_fit: PrefillCostFit
    call_timer: CallTimer | None
    io_guard: IOGuard | None
    evictable_size: Callable[[], int]
    protected_size: Callable[[], int]
    transfers_in_flight: Callable[[], bool]
    prefill_cost: Callable[[], PrefillCost | None]
    hint_status: Callable[[], dict]

    def pretty_print(self) -> None:
        print(self.tree_text())

    def tree_text(self, max_nodes: int = 200) -> str:
        """The tree, one node a line (`export.tree_text`)."""
        return tree_text(self.cache.tree, self.page_size, max_nodes)

    def pool_accounting(self) -> dict[str, Any]:
        """The pools' free counts against the tree's (`export.pool_accounting`; scheduler thread)."""
        return pool_accounting(self)

    def stats(self, exact: bool = False) -> dict[str, Any]:
        """Everything `sgl-hicache stats` shows (`export.stats_snapshot`; `exact` only from the
        scheduler thread: it adds the pool accounting and the tree view)."""
        return stats_snapshot(self, exact)

    def prometheus(self) -> str:
        """The cache's figures as Prometheus text."""
        return prometheus_text(self.cache.snapshot(), self.cache.stored_pages(), self.page_size)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename, so a reader
    sees the old file or the new one, never a part."""
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


class StatsPublisher:
    """A daemon thread of the scheduler process: every `interval` seconds it writes the stats JSON
    (plus Prometheus text next to it, `<file>.prom`) atomically, and, with `--enable-metrics`,
    publishes our figures through SGLang's Prometheus registry (multiprocess mode), so they appear on
    SGLang's own `/metrics`. Started by `TieredRadixCache.start`, stopped (after one last publish) by
    `TieredRadixCache.shutdown`. A failed publish is logged, never raised."""

    def __init__(
        self,
        cache: CacheViews,
        path: str | None,
        interval: float,
        prometheus: bool,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.cache = cache
        self.path = Path(path).expanduser() if path else None
        self.interval = interval
        self.prom = PromExport(cache.config.page_size, labels) if prometheus else None
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


def _counter_metric(name: str, doc: str, *labels: str) -> Any:
    from prometheus_client import Counter

    return Counter(name, doc, list(labels))


def _gauge_metric(name: str, doc: str, *labels: str) -> Any:
    from prometheus_client import Gauge

    return Gauge(name, doc, list(labels), multiprocess_mode="mostrecent")


class PromExport:
    """Our counters and gauges in SGLang's Prometheus registry (the scheduler process writes them to
    SGLang's multiprocess directory; SGLang's HTTP `/metrics` exports them). Counters are fed by the
    difference to the last snapshot. SGLang's own `sglang:cached_tokens_total{cache_source}` is not
    duplicated: SGLang already counts it from `cached_tokens_details`. One per process (the
    registry refuses a second metric of the same name). `labels` go on every series: under data
    parallelism `dp_rank`, so the DP ranks' scheduler processes publish apart."""

    def __init__(self, page_size: int, labels: dict[str, str] | None = None) -> None:
        self.page_size = page_size
        self.fixed = dict(labels or {})  # on every series: this process's DP rank under data parallelism
        self.last: dict[tuple, float] = {}
        _counter, _gauge = self._with_fixed(_counter_metric), self._with_fixed(_gauge_metric)
        self.counters = {
            "hit_tokens": _counter("sgl_hicache_hit_tokens", "Prompt tokens served per tier (sgl_hicache)", "tier"),
            "miss_tokens": _counter("sgl_hicache_miss_tokens", "Prompt tokens computed (sgl_hicache)"),
            "requests": _counter("sgl_hicache_requests", "Requests recorded by sgl_hicache"),
            "evicted_tokens": _counter("sgl_hicache_evicted_tokens", "Tokens that left a tier", "tier"),
            "demoted_tokens": _counter(
                "sgl_hicache_demoted_tokens", "Tokens copied down from a tier on eviction", "tier"
            ),
            "promoted_tokens": _counter("sgl_hicache_promoted_tokens", "Tokens copied up into a tier", "tier"),
            "bytes_moved": _counter("sgl_hicache_bytes_moved", "Bytes copied per link", "link"),
            "prefetch": _counter(
                "sgl_hicache_prefetch_tokens", "Prefetch / prediction tokens by outcome", "kind", "outcome"
            ),
            "store": _counter("sgl_hicache_store", "Shared store tier events (docs/store.md)", "event"),
        }
        self.gauges = {
            "stored_tokens": _gauge("sgl_hicache_stored_tokens", "Tokens resident per tier", "tier"),
            "capacity_tokens": _gauge("sgl_hicache_capacity_tokens", "Capacity per tier", "tier"),
            "call_seconds": _gauge(
                "sgl_hicache_scheduler_call_seconds",
                "Wall time of a cache call on the scheduler thread",
                "call",
                "quantile",
            ),
        }

    def _with_fixed(self, make: Any) -> Any:
        return lambda name, doc, *labels: make(name, doc, *labels, *self.fixed)

    def _inc(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        delta = value - self.last.get(key, 0.0)
        if delta > 0:
            c = self.counters[name]
            labels.update(self.fixed)
            (c.labels(**labels) if labels else c).inc(delta)
        self.last[key] = value

    def _gauge(self, name: str, **labels: str) -> Any:
        return self.gauges[name].labels(**labels, **self.fixed)

    def update(self, snap: dict[str, Any]) -> None:
        """Bring the registry up to `snap` (a `stats_snapshot`)."""
        for t in TIERS:
            label = snap.get("lower_tier", t) if t == DISK else t  # the lower slot is named by what holds it
            for name in ("hit_tokens", "evicted_tokens", "demoted_tokens", "promoted_tokens"):
                self._inc(name, snap[name][t], tier=label)
            self._gauge("stored_tokens", tier=label).set(snap["stored_tokens"][t])
            self._gauge("capacity_tokens", tier=label).set(snap["capacity_tokens"][t])
        for event, v in (snap.get("store") or {}).items():
            if isinstance(v, int) and not isinstance(v, bool) and event != "tracked_pages":
                self._inc("store", v, event=event)
        self._inc("miss_tokens", snap["miss_tokens"])
        self._inc("requests", snap["requests"])
        for call, d in (snap.get("scheduler_calls") or {}).items():
            for q in ("p50", "p99", "max"):
                self._gauge("call_seconds", call=call, quantile=q).set(d[f"{q}_us"] / 1e6)
        for link, v in snap["bytes_moved"].items():
            self._inc("bytes_moved", v, link=link)
        for kind, d in snap["prefetch"].items():
            for outcome in ("promoted_tokens", "used_tokens", "wasted_tokens"):
                self._inc("prefetch", d[outcome], kind=kind, outcome=outcome.replace("_tokens", ""))


__all__ = ["PromExport", "StatsPublisher", "pool_accounting", "stats_snapshot", "tree_text", "write_atomic"]
