"""Per-call scheduler-thread CPU of three trees with a host tier under device-memory pressure:
sgl_hicache's `TieredCache` (device + host), SGLang's `RadixCache`, and SGLang's own HiCache tree.

    .venv-sglang/bin/python -m benchmarks.tree.hicache_peer \
        --json benchmarks/results/tree_ops_overhead/hicache_peer.json   # a few minutes here
    .venv-sglang/bin/python -m benchmarks.tree.hicache_peer --quick      # smoke, ~30 s (SGLang's import)

Workload: the prompts of `benchmarks/tree/overhead.py` (the first `--requests` lines of the Mooncake
conversation trace, `--scale` tokens per 512-token block), each cut to whole pages, served one after
the other. The device pool holds `--device-fraction` of the stream's distinct pages (at least the
longest prompt), so requests evict; evicted pages go to a host pool `--host-factor` times the device
pool, and later requests that match them load them back (host hits). Calls are timed only from the
request at which the stream's distinct pages first exceed the device pool (the same request for
every side), so the figures are the regime under pressure.

Sides, each one in the configuration its server runs:
- `sgl_hicache`: `TieredCache` + `RequestController` + `ThreadExecutor` built as the SGLang
  backend's `assembly` builds them (`assemble.build_cache` / `build_controller`, default policy:
  write-through to host at commit, copies on the backend's transfer threads (`BackendSettings.transfer_workers`), eviction drops clean pages and
  never copies), with the backend's device tier (`SGLangDevicePool`) over the same KV pool and
  allocator as the HiCache side (`sglang_pool`; the embedded engine's pool where SGLang is missing),
  its frees batched per call as the backend's scheduler calls batch them (`deferred_frees`). Per
  request: `match` (+ `record_request`), `load_back` (`promote`: the host part copied to device on
  this thread, as HiCache's side copies on CPU), `lock`, `evict` (`pump_writeback(start_new=False)`
  and `evict(DEVICE, missing pages)`, as the backend's `evict`), `alloc` (SGLang's `allocator.alloc`,
  which the server's scheduler calls itself: the same call as the HiCache side's), `insert` (the
  request's slot row to pages, `insert`, the duplicates freed to SGLang's allocator, `match(touch=False)`
  and `commit`: what the backend's `checkpoint` does), `unlock`, `step` (`pump_writeback()`: the
  backend's `after_batch_formed`). Without SGLang, over the embedded pool: `alloc` is `allocate_device`.
- `sgl_hicache_settled`: the same, but before each request every background copy lands (an untimed
  wait). On a GPU server those copies are DMA and leave the CPU to the scheduler; on a CPU-only
  machine they are memcpy on the other cores, and on 2 cores they slow the scheduler thread's own
  small torch and numpy calls (allocation most) while they run. This side is that CPU's share taken out.
- `sgl_hicache_nocopy`: the same as `sgl_hicache`, but the device <-> host byte movers do nothing (the
  tree's books, allocations and background-copy bookkeeping run as ever): the scheduler-thread cost
  without the bytes, the counterpart of `sglang_hicache_nocopy`. A host hit's load copies on the
  calling thread here; on a GPU the copy is a DMA (or, with the backend's layer-wise loads, runs on
  their worker), so this is the nearer figure for a GPU server's scheduler thread.
- `sglang_radix`: `RadixCache.create_simulated` with a mock allocator (no host tier: an evicted page
  is dropped, and the mock frees nothing: a lower bound of its cost). `match_prefix`,
  `inc_lock_ref`, `evict` (the tokens missing from the pool), `insert`, `dec_lock_ref`.
- `sglang_hicache`: what `--enable-hierarchical-cache` builds in SGLang 0.5.23
  (`mem_cache/registry.py:create_unified_radix_cache`): a `UnifiedRadixCache` (its default tree core:
  Rust where the extension loads, reported in the JSON) with `init_hicache` (a `MHATokenToKVPoolHost`
  under a `HybridCacheController`, write policy `write_through`, io backend `direct`, layout
  `layer_first`, no storage backend), over a real `MHATokenToKVPool` (1 layer, 1 head, head_dim 8) and
  its real paged allocator. `sglang_cpu_layer.patches.apply()` (the CPU test layer) is applied first, as in the CPU test server.
  Per request: `match_prefix`, `load_back` (`init_load_back` + `ready_to_load_host_cache`, when the
  match has a host hit), `inc_lock_ref`, `evict` (`evict(missing tokens)`), `alloc`
  (`allocator.alloc`), `insert` (`insert(prev_prefix_len=...)`: its write-through backup is issued
  here), `dec_lock_ref`, `step` (`check_hicache_events`: the scheduler's per-step poll).

Time is `time.thread_time()` of the calling thread: the scheduler thread's CPU only. Our write-through
copies run on the transfer engine's threads and are not counted; SGLang's HiCache issues its D->H and
H->D copies on CUDA streams from the scheduler thread, which on CPU torch (no CUDA streams) run the
copy inline: its figures include the copy of this tiny layout's bytes (a few index ops). Sides are
interleaved over `--repeats` rounds (order alternating); per call p50 / p99 / max, and per request
total, are medians over rounds with [min, max] ranges.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import platform
import statistics
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

from benchmarks.lib.trees import (
    MockAllocator,
    add_trace_args,
    add_workload_args,
    requests_with_growth,
    server_allocator,
)
from sgl_hicache.client.backend_settings import BackendSettings
from sgl_hicache.config import DEFAULT_POLICY, CacheConfig, KVLayout
from sgl_hicache.control.composition import build_cache, build_controller
from sgl_hicache.replay import load_trace
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.engine import TransferEngine
from sgl_hicache.transfer.executors import ThreadExecutor

HEAD_DIM = 8
TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM)  # the tree's CPU does not depend on KV bytes
SIDES = (
    "sgl_hicache",
    "sgl_hicache_settled",
    "sgl_hicache_nocopy",
    "sglang_radix",
    "sglang_hicache",
    "sglang_hicache_nocopy",
)
# the background copies in flight ours may fall behind by before the loop waits for the oldest
MAX_BACKLOG_OPS = 64
BACKEND_WORKERS = BackendSettings().transfer_workers  # the transfer threads the backend starts
CALLS = ("match", "load_back", "lock", "evict", "alloc", "insert", "unlock", "step")

try:  # SGLang's CPU server applies these before it builds HiCache (the CPU test layer's plugin -> patches.apply)
    from sglang_cpu_layer import patches as cpu_layer

    cpu_layer.apply()
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    SGLANG, SGLANG_ERROR = True, None
except Exception as exc:  # noqa: BLE001 - any import failure means: measure ours only
    SGLANG, SGLANG_ERROR = False, f"{type(exc).__name__}: {exc}"
QUICK_REQUESTS = 400  # the smoke: fewer requests never fill the device pool, so no host hits


class Recorder:
    """Per-call CPU samples (µs) and per-request totals, kept from request `start` on."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.i = 0
        self.samples: dict[str, array] = {c: array("d") for c in CALLS}
        self.totals = array("d")
        self.req = 0.0

    def add(self, name: str, seconds: float) -> None:
        if self.i >= self.start:
            self.samples[name].append(seconds * 1e6)
            self.req += seconds * 1e6

    def end_request(self) -> None:
        if self.i >= self.start:
            self.totals.append(self.req)
        self.req = 0.0
        self.i += 1

    def summary(self) -> dict:
        def stats(xs: array) -> dict:
            s = sorted(xs)
            if not s:
                return {"n": 0}
            return {
                "n": len(s),
                "p50": s[len(s) // 2],
                "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
                "max": s[-1],
                "mean": sum(s) / len(s),
            }

        return {"calls": {c: stats(self.samples[c]) for c in CALLS}, "per_request": stats(self.totals)}


def pool_sizes(prompts: list[array], page_size: int, fraction: float) -> tuple[int, int]:
    """(device pool pages, index of the first request after which the stream's distinct pages
    exceed it): the pool holds `fraction` of the distinct pages, and at least the longest prompt."""
    seen: set[int] = set()
    growth = []
    for p in prompts:
        h = 0
        for i in range(0, len(p), page_size):
            h = hash((h, tuple(p[i : i + page_size])))
            seen.add(h)
        growth.append(len(seen))
    pages = max(int(fraction * len(seen)), max(len(p) for p in prompts) // page_size + 2)
    start = next((i for i, g in enumerate(growth) if g > pages), len(prompts))
    return pages, start


def scale_stream(args: argparse.Namespace, page_size: int) -> tuple[list[array], int, int]:
    """(prompts, device pool pages, index of the first request timed) of `benchmarks.tree.scale`'s stream:
    the requests until `--measure-requests` past the one where the stream's new tokens outgrow the pool."""
    if args.quick:
        args.pool_tokens, args.target_nodes, args.measure_requests = 20_000, 2_000, 200
    prompts: list[array] = []
    start = None
    for prompt, inserted in requests_with_growth(args, page_size):
        if start is None and inserted > args.pool_tokens:
            start = len(prompts)
        prompts.append(prompt)
        if start is not None and len(prompts) >= start + args.measure_requests:
            break
    return prompts, args.pool_tokens // page_size, len(prompts) if start is None else start


def run_ours(
    prompts: list[array],
    page_size: int,
    pages: int,
    host_factor: int,
    start: int,
    settle: bool = False,
    copy_bytes: bool = True,
) -> dict:
    """Ours; with `settle`, every background copy lands (an untimed wait) before each request: on a GPU
    server they are DMA, beside the CPU, where on this machine they are CPU copies on the other core.
    Without `copy_bytes`, the device <-> host byte movers do nothing (the tree's books move as ever)."""
    if SGLANG:  # the backend's device tier over the KV pool and allocator HiCache's side gets
        allocator = sglang_pool(page_size, pages)
        device = SGLangDevicePool(allocator)
        batched_frees = device.deferred_frees  # as the backend's scheduler calls free (`frees_batched`)
        layout = device.layout
        pages = device.pool_pages  # (as the backend's `cache_config` reads it)
    else:  # the embedded engine's pool
        allocator, device, batched_frees, layout = None, None, contextlib.nullcontext, TINY
    cfg = CacheConfig(
        layout, device_tokens=pages * page_size, host_tokens=host_factor * pages * page_size, page_size=page_size
    )
    cache = build_cache(cfg, device=device)
    if not copy_bytes:
        for link in ((DEVICE, HOST), (HOST, DEVICE)):
            cache.handlers[link] = _no_copy
    engine = TransferEngine(cache, workers=BACKEND_WORKERS)
    controller = build_controller(cache, ThreadExecutor(cache, engine), DEFAULT_POLICY, time.monotonic)
    store = cache.stores[DEVICE]
    rec = Recorder(start)
    clock = time.thread_time
    host_hits = 0
    gc.collect()
    try:
        for tokens in prompts:
            if settle:
                for op in list(controller.writeback):
                    op.executed.wait(timeout=5)
            elif len(controller.writeback) > MAX_BACKLOG_OPS:
                # a server's forward pass gives the background copies its time; this loop gives them
                # none, and a backlog of thousands of nodes would make every write-back round scan it
                # (untimed: a wait is not scheduler CPU)
                for op in controller.writeback[: len(controller.writeback) - MAX_BACKLOG_OPS]:
                    op.executed.wait(timeout=5)
            t = clock()
            m = cache.match(tokens)
            cache.record_request(len(tokens), m)
            rec.add("match", clock() - t)
            if m.lower_tier_tokens:
                host_hits += m.lower_tier_tokens
                t = clock()
                with batched_frees():
                    m = cache.promote(m)
                rec.add("load_back", clock() - t)
            t = clock()
            cache.lock(m.last_node)
            rec.add("lock", clock() - t)
            need = len(tokens) // page_size - len(m.device_handles)
            if store.free_pages < need:
                # on a server the background host copies have a forward pass to land before the next
                # eviction; here the loop is faster than the copies on a loaded machine: wait for their
                # bytes (untimed, a wait is not scheduler CPU), so eviction demotes rather than drops
                for op in list(controller.writeback):
                    op.executed.wait(timeout=5)
                t = clock()
                with batched_frees():
                    controller.pump_writeback(start_new=False)
                    cache.evict(DEVICE, need - store.free_pages)
                rec.add("evict", clock() - t)
            if device is None:
                t = clock()
                fresh = cache.allocate_device(need)
                rec.add("alloc", clock() - t)
                if fresh is not None:
                    t = clock()
                    r = cache.insert(tokens, m.device_handles + fresh)
                    if r.duplicates:
                        cache.free_device(r.duplicates)
                    controller.commit(cache.match(tokens, touch=False).path)
                    rec.add("insert", clock() - t)
            else:  # as on the server: the scheduler allocates from SGLang's allocator, `checkpoint` inserts
                prefix_slots = device.token_slots(m.device_handles)  # (untimed, as HiCache's path_device_indices)
                t = clock()
                fresh_slots = allocator.alloc(need * page_size)
                rec.add("alloc", clock() - t)
                if fresh_slots is not None:
                    row = torch.cat([prefix_slots, fresh_slots])  # the request's row
                    t = clock()
                    r = cache.insert(tokens, device.pages_of(row), from_allocate_device=False)
                    device.adopt(r.adopted_pages)
                    if r.duplicates:
                        allocator.free(device.token_slots(r.duplicates))
                    controller.commit(cache.match(tokens, touch=False).path)
                    rec.add("insert", clock() - t)
            t = clock()
            cache.unlock(m.last_node)
            rec.add("unlock", clock() - t)
            t = clock()
            controller.pump_writeback()
            rec.add("step", clock() - t)
            rec.end_request()
        deadline = time.monotonic() + 120
        while controller.inflight() and time.monotonic() < deadline:  # land the last copies (untimed)
            time.sleep(0.01)
            controller.pump_writeback(start_new=False)
        cache.check()  # the tree's books equal every store's
    finally:
        engine.stop()
    out = rec.summary()
    out["facts"] = {
        "host_hit_tokens": host_hits,
        "evicted_tokens_device": int(cache.snapshot()["evicted_tokens"]["device"]),
        "tree_nodes": cache.tree.node_count,
    }
    return out


def _no_copy(op: object, start: int, stop: int) -> None:
    """A device <-> host byte mover that moves nothing (`sgl_hicache_nocopy`)."""


def run_radix(prompts: list[array], page_size: int, pages: int, host_factor: int, start: int) -> dict:
    cache = RadixCache.create_simulated(mock_allocator=MockAllocator(), page_size=page_size)
    keys = [RadixKey(p) for p in prompts]
    rows = [torch.arange(len(p), dtype=torch.int64) for p in prompts]  # the request's KV row (a mock)
    pool = pages * page_size
    rec = Recorder(start)
    clock = time.thread_time
    evicted = 0
    gc.collect()
    for key, row in zip(keys, rows):
        t = clock()
        m = cache.match_prefix(MatchPrefixParams(key=key))
        rec.add("match", clock() - t)
        t = clock()
        lk = cache.inc_lock_ref(m.last_device_node)
        rec.add("lock", clock() - t)
        need = len(key) - m.device_prefix_len
        held = cache.evictable_size() + cache.protected_size()
        if held + need > pool:
            t = clock()
            evicted += cache.evict(EvictParams(num_tokens=held + need - pool)).num_tokens_evicted
            rec.add("evict", clock() - t)
        t = clock()
        cache.insert(InsertParams(key=key, value=row))
        rec.add("insert", clock() - t)
        t = clock()
        cache.dec_lock_ref(m.last_device_node, lk.to_dec_params())
        rec.add("unlock", clock() - t)
        rec.end_request()
    out = rec.summary()
    out["facts"] = {"host_hit_tokens": 0, "evicted_tokens_device": evicted}
    return out


def sglang_pool(page_size: int, pages: int):
    """The KV pool (1 layer, 1 head of `HEAD_DIM`, bf16, CPU) and the allocator SGLang's server builds
    over it for a plain model (`tree_ops.server_allocator`): the device tier of both the HiCache
    side and ours."""
    return server_allocator(pages * page_size, page_size, head_dim=HEAD_DIM, dtype=torch.bfloat16)


def build_hicache(page_size: int, pages: int, host_factor: int):
    """SGLang's HiCache tree as `--enable-hierarchical-cache --hicache-io-backend direct
    --hicache-mem-layout layer_first --hicache-write-policy write_through` builds it (the scheduler's
    `create_unified_radix_cache` then `init_hicache`), over a tiny real KV pool on CPU."""
    sa = ServerArgs(
        model_path="dummy",
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=float(host_factor),
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_write_policy="write_through",
    )
    set_global_server_args_for_scheduler(sa)
    alloc = sglang_pool(page_size, pages)
    r2t = ReqToTokenPool(size=4, max_context_len=8, device="cpu", enable_memory_saver=False)  # unused here
    params = CacheInitParams(
        req_to_token_pool=r2t,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        disable=False,
        tree_components=(ComponentType.FULL,),
    )
    cache = UnifiedRadixCache(params)
    cache.init_hicache(sa, params)
    return cache, alloc


def run_hicache(prompts: list[array], page_size: int, pages: int, host_factor: int, start: int) -> dict:
    cache, alloc = build_hicache(page_size, pages, host_factor)
    keys = [RadixKey(p) for p in prompts]
    rec = Recorder(start)
    clock = time.thread_time
    host_hits = loaded = evicted = 0
    gc.collect()
    try:
        for n, key in enumerate(keys):
            t = clock()
            m = cache.match_prefix(MatchPrefixParams(key=key))
            rec.add("match", clock() - t)
            node, prefix = m.last_device_node, m.device_prefix_len
            if m.host_hit_length > 0:
                host_hits += m.host_hit_length
                req = SimpleNamespace(  # what init_load_back reads of a scheduler's Req (FULL-only tree)
                    rid=str(n),
                    last_node=node,
                    swa_host_hit_length=0,
                    mamba_host_hit_length=0,
                    kv=SimpleNamespace(mamba_pool_idx=None, req_pool_idx=None, cache_protected_len=prefix),
                )
                t = clock()
                got, node = cache.init_load_back(
                    InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req)
                )
                cache.ready_to_load_host_cache()
                rec.add("load_back", clock() - t)
                loaded += got
                prefix += got
            t = clock()
            lk = cache.inc_lock_ref(node)
            rec.add("lock", clock() - t)
            need = len(key) - prefix
            avail = alloc.available_size()
            if avail < need:
                t = clock()
                evicted += cache.evict(EvictParams(num_tokens=need - avail)).num_tokens_evicted
                rec.add("evict", clock() - t)
            prefix_idx = cache.path_device_indices(node)  # the request's row (the scheduler holds it)
            t = clock()
            fresh = alloc.alloc(need)
            rec.add("alloc", clock() - t)
            if fresh is not None:
                value = torch.cat([prefix_idx, fresh])
                t = clock()
                cache.insert(InsertParams(key=key, value=value, prev_prefix_len=prefix))
                rec.add("insert", clock() - t)
            t = clock()
            cache.dec_lock_ref(node, lk.to_dec_params())
            rec.add("unlock", clock() - t)
            t = clock()
            cache.check_hicache_events()
            rec.add("step", clock() - t)
            rec.end_request()
        # every slot is free, in the tree, or nowhere else: the loop's frees and the tree's agree
        assert cache.protected_size() == 0
        assert alloc.available_size() + cache.evictable_size() == pages * page_size, (
            alloc.available_size(),
            cache.evictable_size(),
        )
    finally:
        import atexit

        atexit.unregister(cache.shutdown)
        cache.release_host_resources()
    out = rec.summary()
    out["facts"] = {
        "host_hit_tokens": host_hits,
        "loaded_back_tokens": loaded,
        "evicted_tokens_device": evicted,
        "tree_core": type(cache.tree_core).__name__,
        "host_pool_tokens": int(cache.cache_controller.mem_pool_host.size),
    }
    return out


def run_hicache_nocopy(prompts: list[array], page_size: int, pages: int, host_factor: int, start: int) -> dict:
    """`run_hicache` with the KV byte copy made a no-op: on CPU torch HiCache's copies run inline on
    the scheduler thread (`sglang_cpu_layer.patches.transfer_kv_direct`, standing in for the CUDA kernel that
    `mem_cache/pool_host/mha.py` calls on a side stream), so this is its scheduler-thread cost
    without the bytes, the nearest this machine gets to a GPU's (where the copy is a kernel launch)."""
    from sglang.srt.mem_cache.pool_host import mha

    copy = mha.transfer_kv_direct
    mha.transfer_kv_direct = lambda *args, **kwargs: None  # benchmark only; restored below
    try:
        return run_hicache(prompts, page_size, pages, host_factor, start)
    finally:
        mha.transfer_kv_direct = copy


RUNNERS = {
    "sgl_hicache": run_ours,
    "sgl_hicache_settled": functools.partial(run_ours, settle=True),
    "sgl_hicache_nocopy": functools.partial(run_ours, copy_bytes=False),
    "sglang_radix": run_radix,
    "sglang_hicache": run_hicache,
    "sglang_hicache_nocopy": run_hicache_nocopy,
}


def median_range(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "range": [round(min(xs), 2), round(max(xs), 2)]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(ap, repeats=5, quick_requests=QUICK_REQUESTS)
    ap.add_argument(
        "--device-fraction", type=float, default=0.25, help="device pool / the stream's distinct pages (0.25)"
    )
    ap.add_argument("--host-factor", type=int, default=4, help="host pool / device pool (default 4)")
    ap.add_argument(
        "--workload",
        choices=("trace", "tree_scale"),
        default="trace",
        help="trace: the first --requests trace prompts, pool a --device-fraction of them; tree_scale: "
        "benchmarks.tree.scale's synthetic sessions (120k nodes in a 1M-token pool by default), pool --pool-tokens, "
        "--measure-requests timed once the stream outgrows the pool",
    )
    add_workload_args(ap)
    ap.add_argument("--measure-requests", type=int, default=1500, help="tree_scale: requests timed (default 1500)")
    ap.add_argument("--no-sglang", action="store_true", help="measure ours only")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = QUICK_REQUESTS, 2
    with_sglang = SGLANG and not args.no_sglang
    ps = args.page_size
    if args.workload == "tree_scale":
        prompts, pages, start = scale_stream(args, ps)
    else:
        prompts = []
        for r in load_trace(args.trace, limit=args.requests, scale=args.scale):
            ids = list(r.input_ids)
            ids = ids[: len(ids) // ps * ps]
            if ids:
                prompts.append(array("q", ids))
        pages, start = pool_sizes(prompts, ps, args.device_fraction)
    gc.collect()
    gc.freeze()  # SGLang's import leaves a large heap: keep it out of every collection below
    sides = list(SIDES) if with_sglang else ["sgl_hicache"]
    rounds: dict[str, list[dict]] = {s: [] for s in sides}
    t_start = time.perf_counter()
    for rnd in range(args.repeats):
        for side in sides if rnd % 2 == 0 else list(reversed(sides)):
            rounds[side].append(RUNNERS[side](prompts, ps, pages, args.host_factor, start))

    results: dict[str, dict] = {}
    for side in sides:
        rs = rounds[side]
        calls = {}
        for c in CALLS:
            if not rs[0]["calls"][c].get("n"):
                continue
            calls[c] = {"n": rs[0]["calls"][c]["n"]}
            for q in ("p50", "p99", "max", "mean"):
                calls[c][q] = median_range([r["calls"][c][q] for r in rs])
        per_req = {q: median_range([r["per_request"][q] for r in rs]) for q in ("p50", "p99", "max", "mean")}
        results[side] = {"calls_us": calls, "per_request_us": per_req, "facts": rs[0]["facts"]}
    out = {
        "benchmark": "tree_hicache_peer",
        "config": {
            "workload": args.workload,
            **(
                {"pool_tokens": args.pool_tokens, "target_nodes": args.target_nodes, "seed": args.seed}
                if args.workload == "tree_scale"
                else {}
            ),
            "trace": str(args.trace),
            "requests": len(prompts),
            "measured_requests": len(prompts) - start,
            "prompt_tokens": sum(map(len, prompts)),
            "scale": args.scale,
            "page_size": ps,
            "device_pool_tokens": pages * ps,
            "host_factor": args.host_factor,
            "device_fraction": args.device_fraction,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "sglang": {"available": SGLANG, "used": with_sglang, "error": SGLANG_ERROR},
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "clock": "time.thread_time of the calling (scheduler) thread; transfer threads not counted",
        "results": results,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    brief = {
        side: {
            "per_request_mean_us": r["per_request_us"]["mean"]["median"],
            "p50/p99": {c: [v["p50"]["median"], v["p99"]["median"]] for c, v in r["calls_us"].items()},
            "facts": r["facts"],
        }
        for side, r in results.items()
    }
    print(json.dumps({"config": out["config"], "results": brief, "wall_s": out["wall_s"]}, indent=2))
    return out


if __name__ == "__main__":
    main()
