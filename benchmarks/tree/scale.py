"""Per-call CPU of the cache calls a scheduler makes, at production tree sizes, side by side with
SGLang's own `RadixCache` on the same request stream.

    .venv-sglang/bin/python -m benchmarks.tree.scale --json benchmarks/results/tree_scale.json  # minutes
    .venv-sglang/bin/python -m benchmarks.tree.scale --quick                                    # seconds

Workload (synthetic, seeded, identical for every side): `--sessions` conversations, each opened on
one of `--system-prompts` shared system prompts (`--system-tokens` long); every request is one turn
of a random session: its prompt is the system prompt, the session's history and a new turn of
1-3 node-sized chunks (a node is about `--pool-tokens / --target-nodes` tokens, at least one page).
A turn sometimes regenerates from an earlier point of its session (a branch that splits a node),
and a session whose history passes `--history-tokens` starts afresh. The device pool holds
`--pool-tokens`; requests run until `--pressure` times the pool was inserted, so the tree is full
and evicts on most requests for most of the run. Only requests after the first eviction count.

Per request, what SGLang's scheduler calls, each timed alone (`time.thread_time`: this thread's
CPU, so other processes on a shared machine do not count), less the garbage collector's passes that
ran inside it. Those are the process's (whichever call allocates when the count of new objects
crosses a threshold runs one) and are given apart, per generation (`gc`: passes, p50 / max µs, µs
per measured request):
- ours (`TieredCache`): `match`, `lock`, `evict` (only when the pool lacks room for the request's
  new pages: the pages missing), `insert` (with `allocate_device` for the new pages, timed as
  `alloc` apart, and `free_device` of the duplicates), `unlock`; with tiers also `promote` when
  the match has host or disk tokens.
- SGLang `RadixCache.create_simulated` (mock allocator: frees nothing, so SGLang's figures are a
  lower bound of its real cost): `match_prefix`, `inc_lock_ref`, `evict` (same rule: the tokens
  missing), `insert`, `dec_lock_ref`.
Sides: `radix` (SGLang), `ours` (host and disk off: the plain path), and `ours_tiered` (host
`--host-factor` and disk `--disk-factor` times the pool, metadata-only stores so no bytes move,
the shipped policy: write-through to host and disk, eviction drops clean pages). Rounds alternate
the sides' order; figures are medians over `--repeats` rounds of each call's p50 / p99 / max (µs).
SGLang's `HiRadixCache` needs its cache controller's host pool and I/O threads, which this
benchmark does not build: it is not measured here.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from array import array
from pathlib import Path

from benchmarks.lib.trees import TINY, MockAllocator, add_workload_args, requests
from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.tiers.metadata import MetadataDiskStore, MetadataSlotStore

try:  # the only import of sglang, and only to measure against it
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    SGLANG, SGLANG_ERROR = True, None
except Exception as exc:  # noqa: BLE001 - any import failure means: measure ours only
    SGLANG, SGLANG_ERROR = False, f"{type(exc).__name__}: {exc}"


class Calls:
    """Per-call CPU samples (µs) by call name, kept only once `on` is set, timed by `clock`: this
    thread's CPU time less the garbage collector's passes. A pass runs inside whichever call
    allocates when the process's count of new objects crosses a threshold, so its time is the
    process's, not that call's: the passes are kept apart (`gc_summary`, per generation; each side's
    tree sets how many objects they run over). It hooks `gc.callbacks` until `close`."""

    def __init__(self) -> None:
        self.samples: dict[str, array] = {}
        self.on = False
        self.gc_passes: dict[int, array] = {0: array("d"), 1: array("d"), 2: array("d")}
        self._in_gc = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._gc_pass)

    def close(self) -> None:
        gc.callbacks.remove(self._gc_pass)

    def _gc_pass(self, phase: str, info: dict) -> None:
        now = time.thread_time()
        if phase == "start":
            self._gc_start = now
            return
        self._in_gc += now - self._gc_start
        if self.on:
            self.gc_passes[info["generation"]].append((now - self._gc_start) * 1e6)

    def clock(self) -> float:
        """Seconds of this thread's CPU, less those spent in garbage-collector passes."""
        return time.thread_time() - self._in_gc

    def gc_summary(self, requests: int) -> dict[str, dict[str, float]]:
        """Per generation: the passes while `on`, their p50 / max (µs), and their total per request (µs)."""
        out = {}
        for gen, xs in self.gc_passes.items():
            s = sorted(xs)
            out[f"gen{gen}"] = {
                "n": len(s),
                "p50": s[len(s) // 2] if s else 0.0,
                "max": s[-1] if s else 0.0,
                "us_per_request": sum(s) / requests if requests else 0.0,
            }
        return out

    def add(self, name: str, seconds: float) -> None:
        if self.on:
            self.samples.setdefault(name, array("d")).append(seconds * 1e6)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, xs in self.samples.items():
            s = sorted(xs)
            out[name] = {
                "n": len(s),
                "p50": s[len(s) // 2],
                "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
                "max": s[-1],
                "mean": sum(s) / len(s),
            }
        return out


def run_ours(args: argparse.Namespace, page_size: int, tiered: bool) -> dict:
    pool_pages = args.pool_tokens // page_size
    if tiered:
        cfg = CacheConfig(
            TINY,
            device_tokens=pool_pages * page_size,
            host_tokens=args.host_factor * pool_pages * page_size,
            disk_tokens=args.disk_factor * pool_pages * page_size,
            page_size=page_size,
            disk_dir=Path(tempfile.gettempdir()),  # never written: the disk store below is metadata
            write_policy="write_through",
            disk_write_policy="write_through",
            eviction_demotes="none",
        )
        cache = TieredCache(
            cfg,
            device=MetadataSlotStore(DEVICE, TINY, page_size, cfg.device_pages),
            host=MetadataSlotStore(HOST, TINY, page_size, cfg.host_pages),
            disk=MetadataDiskStore(TINY, page_size, cfg.disk_pages),
        )
    else:
        cfg = CacheConfig(TINY, device_tokens=pool_pages * page_size, page_size=page_size)
        cache = TieredCache(cfg)
    calls = Calls()
    clock = calls.clock
    store = cache.stores[DEVICE]
    n = measured = 0
    gc.collect()
    for tokens in requests(args, page_size):
        t = clock()
        m = cache.match(tokens)
        calls.add("match", clock() - t)
        if m.lower_tier_tokens:
            t = clock()
            m = cache.promote(m)
            calls.add("promote", clock() - t)
        t = clock()
        cache.lock(m.last_node)
        calls.add("lock", clock() - t)
        need = len(tokens) // page_size - len(m.device_handles)
        if store.free_pages < need:
            calls.on = True
            t = clock()
            cache.evict(DEVICE, need - store.free_pages)
            calls.add("evict", clock() - t)
        t = clock()
        fresh = cache.allocate_device(need)
        calls.add("alloc", clock() - t)
        if fresh is None:  # everything left is locked by this request: skip it
            cache.unlock(m.last_node)
            measured += calls.on
            continue
        t = clock()
        r = cache.insert(tokens, m.device_handles + fresh)
        if r.duplicates:
            cache.free_device(r.duplicates)
        calls.add("insert", clock() - t)
        t = clock()
        cache.unlock(m.last_node)
        calls.add("unlock", clock() - t)
        n += 1
        measured += calls.on
        if args.measure_requests and measured >= args.measure_requests:
            break
    calls.close()
    return {
        "requests": n,
        "tree_nodes": cache.tree.node_count,
        "tree_tokens": cache.tree.pages[DEVICE] * page_size,
        "calls": calls.summary(),
        "gc": calls.gc_summary(measured),
    }


def run_radix(args: argparse.Namespace, page_size: int) -> dict:
    cache = RadixCache.create_simulated(mock_allocator=MockAllocator(), page_size=page_size)
    pool = args.pool_tokens // page_size * page_size
    calls = Calls()
    clock = calls.clock
    n = measured = 0
    gc.collect()
    for tokens in requests(args, page_size):
        key = RadixKey(tokens)
        t = clock()
        m = cache.match_prefix(MatchPrefixParams(key=key))
        calls.add("match", clock() - t)
        t = clock()
        lk = cache.inc_lock_ref(m.last_device_node)
        calls.add("lock", clock() - t)
        need = len(tokens) - m.device_prefix_len
        held = cache.evictable_size() + cache.protected_size()
        if held + need > pool:
            calls.on = True
            t = clock()
            cache.evict(EvictParams(num_tokens=held + need - pool))
            calls.add("evict", clock() - t)
        value = torch.arange(len(tokens), dtype=torch.int64)  # the request's KV row (a mock: never freed)
        t = clock()
        cache.insert(InsertParams(key=key, value=value))
        calls.add("insert", clock() - t)
        t = clock()
        cache.dec_lock_ref(m.last_device_node, lk.to_dec_params())
        calls.add("unlock", clock() - t)
        n += 1
        measured += calls.on
        if args.measure_requests and measured >= args.measure_requests:
            break
    calls.close()
    nodes = 0
    stack = [cache.root_node]
    while stack:
        x = stack.pop()
        nodes += 1
        stack.extend(x.children.values())
    return {
        "requests": n,
        "tree_nodes": nodes - 1,
        "tree_tokens": cache.evictable_size() + cache.protected_size(),
        "calls": calls.summary(),
        "gc": calls.gc_summary(measured),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument(
        "--measure-requests",
        type=int,
        default=0,
        help="stop after this many requests past the first eviction (0: run the whole stream)",
    )
    ap.add_argument("--host-factor", type=int, default=2)
    ap.add_argument("--disk-factor", type=int, default=4)
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--sides", default="radix,ours,ours_tiered")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 20k-token pool, 1 round (the CI smoke size)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.pool_tokens, args.target_nodes, args.repeats = 20_000, 2_000, 1
    sides = [s for s in args.sides.split(",") if s != "radix" or SGLANG]
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    gc.collect()
    gc.freeze()
    runs: dict[str, dict[str, list[dict]]] = {str(ps): {s: [] for s in sides} for ps in page_sizes}
    t0 = time.perf_counter()
    for rnd in range(args.repeats):
        for ps in page_sizes:
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                res = run_radix(args, ps) if side == "radix" else run_ours(args, ps, tiered=side == "ours_tiered")
                runs[str(ps)][side].append(res)
    results: dict[str, dict] = {}
    for ps, by_side in runs.items():
        entry: dict[str, dict] = {}
        for side, rs in by_side.items():
            names = sorted({c for r in rs for c in r["calls"]})
            entry[side] = {
                "tree_nodes": [r["tree_nodes"] for r in rs],
                "tree_tokens": [r["tree_tokens"] for r in rs],
                "requests": rs[0]["requests"],
                "calls_us": {
                    c: {
                        f: round(statistics.median(r["calls"][c][f] for r in rs if c in r["calls"]), 2)
                        for f in ("n", "p50", "p99", "max", "mean")
                    }
                    for c in names
                },
                # garbage-collector passes apart from the calls (`Calls`): medians over rounds
                "gc": {
                    g: {f: round(statistics.median(r["gc"][g][f] for r in rs), 2) for f in rs[0]["gc"][g]}
                    for g in rs[0]["gc"]
                },
                "calls_us_range": {
                    c: {
                        f: [
                            round(min(r["calls"][c][f] for r in rs if c in r["calls"]), 2),
                            round(max(r["calls"][c][f] for r in rs if c in r["calls"]), 2),
                        ]
                        for f in ("p50", "p99", "max")
                    }
                    for c in names
                },
            }
        if "radix" in entry:
            for side in ("ours", "ours_tiered"):
                if side in entry:
                    entry[f"p99_ratio_{side}_over_radix"] = {
                        c: round(v["p99"] / entry["radix"]["calls_us"][c]["p99"], 3)
                        for c, v in entry[side]["calls_us"].items()
                        if c in entry["radix"]["calls_us"]
                    }
        results[ps] = entry
    out = {
        "benchmark": "tree_scale",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sglang": {"available": SGLANG, "error": SGLANG_ERROR},
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "note": "per-call CPU µs (thread_time less garbage-collector passes, which `gc` gives apart), medians over "
        "rounds of each round's p50/p99/max; calls after the first eviction",
        "results": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    for ps, entry in results.items():
        for side in sides:
            e = entry[side]
            print(
                f"page {ps} {side:12s} nodes {e['tree_nodes']} "
                + "  ".join(f"{c} {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}" for c, v in e["calls_us"].items())
            )
    print(f"wall {out['wall_s']} s")
    return out


if __name__ == "__main__":
    main()
