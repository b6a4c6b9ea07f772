"""Tree operations, side by side: sgl_hicache's tree against SGLang's own RadixCache, same token stream.

    .venv-sglang/bin/python -m benchmarks.tree.ops --json tree_ops.json          # ~1-2 min here
    .venv-sglang/bin/python -m benchmarks.tree.ops --quick --json tree_ops.json  # seconds

Token stream: the prompts of the first `--requests` lines of the Mooncake conversation trace,
synthesised by `sgl_hicache.replay.load_trace(path, limit=N, scale=S)` (every 512-token block becomes
S tokens), identical for both sides.

What is timed, per page size (1, 16, 64), for each side, in one process, interleaved
(ours, SGLang, ours, SGLang, ... for `--repeats` rounds, order alternating between rounds):
Both sides get each prompt as an int64 `array` built before the clock starts (what SGLang 0.5.23's
scheduler holds in `RadixKey.token_ids`, and what sgl_hicache's SGLang backend passes on).
- `insert`: a fresh tree; every prompt inserted in trace order. Ours: `TieredCache.insert` (host and
  disk tiers off, a device pool large enough that nothing is evicted) with device pages allocated
  before the clock starts; SGLang: `RadixCache.insert(InsertParams(key, value))` with the key and value
  tensor built before the clock starts. Duplicate pages are freed after the clock stops (ours).
- `match`: on the filled tree, every prompt matched once in trace order. Ours: `TieredCache.match`
  (touch=True: the full product path, which also counts the predictor's traffic and refreshes
  recency); SGLang: `RadixCache.match_prefix`.
- `evict`: the filled tree (matched once, as above) emptied in 10 equal `evict` calls, the tree's
  work alone on both sides. Ours: `TieredCache.evict("device", n)` (with no lower tier an evicted
  page is dropped, as in SGLang) with the device store's free a no-op; SGLang: `RadixCache.evict`
  into a mock allocator that does nothing.
- `evict_alloc`: eviction as a server runs it, each side freeing into the allocator SGLang's server
  builds for a plain model (`kv_cache_configurator.py`: `TokenToKVPoolAllocator` at page 1,
  `PagedTokenToKVPoolAllocator` above, `need_sort=False` outside PD disaggregation), over a tiny
  real KV pool. SGLang: its tree built with values from that allocator, each insert's duplicate
  prefix freed as `cache_finished_req` frees it (outside the clock), then emptied the same way; its
  `free` joins each evicted node onto the whole free list (`torch.cat`). Ours: the SGLang backend's
  device tier (`SGLangDevicePool`) over the same allocator, each `evict` call inside
  `deferred_frees` as the backend's scheduler calls run (one allocator free per call).
- `evict_checked` (ours only, no SGLang counterpart): the embedded engine's eviction, into its own
  slot store, whose free checks every slot for a double free (`ours_evict_free_share` is that
  check's part of the time).
Time is this thread's CPU time (`time.thread_time`), so other processes on a shared machine do not
count. Figures are medians over rounds of prompts/s (and tokens/s); the ratio is ours / SGLang (> 1: ours
faster). Run it with the interpreter that has SGLang (`.venv-sglang`); without SGLang the JSON says
so and only our side is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import time
from array import array
from pathlib import Path

from benchmarks.lib.paths import DEFAULT_TRACE
from benchmarks.lib.trees import TINY, MockAllocator, server_allocator
from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig
from sgl_hicache.replay import load_trace

OPS = ("insert", "match", "evict")  # measured on both sides, without SGLang's allocator
ALLOC_OPS = ("evict_alloc",)  # both sides, through SGLang's server allocator
OURS_ONLY_OPS = ("evict_checked",)  # the embedded engine's checked store: no SGLang counterpart

try:  # the only import of sglang, and only to measure against it
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    SGLANG = True
    SGLANG_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure means: measure ours only
    SGLANG = False
    SGLANG_ERROR = f"{type(exc).__name__}: {exc}"


def _timed(fn) -> float:
    """CPU seconds of this thread in `fn` (a shared machine's other processes do not count)."""
    gc.collect()
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _ours_cache(prompts: list[array], page_size: int, device=None) -> TieredCache:
    """An empty cache whose device tier holds every page of `prompts`; `device`: the device store
    (default: the embedded engine's)."""
    total_pages = sum(len(p) // page_size for p in prompts)
    return TieredCache(
        CacheConfig(TINY, device_tokens=max(total_pages, 1) * page_size, page_size=page_size), device=device
    )


def _ours_filled(prompts: list[array], page_size: int, device=None) -> TieredCache:
    """`_ours_cache` with every prompt inserted and matched once (as `insert` and `match` leave
    it), untimed."""
    cache = _ours_cache(prompts, page_size, device)
    for p in prompts:
        r = cache.insert(p, cache.allocate_device(len(p) // page_size))
        cache.free_device(r.duplicates)
    for p in prompts:
        cache.match(p)
    return cache


def _ours_evict(cache: TieredCache, each_call=contextlib.nullcontext) -> float:
    """CPU seconds of emptying the device tier in 10 equal `evict` calls, each inside `each_call()`
    (a context manager)."""
    chunk = max(1, -(-cache.tree.pages["device"] // 10))

    def evict() -> None:
        for _ in range(10):
            with each_call():
                cache.evict("device", chunk)

    seconds = _timed(evict)
    assert cache.tree.pages["device"] == 0, "ours: eviction left pages behind"
    return seconds


def run_ours(prompts: list[list[int]], page_size: int, with_sglang: bool) -> dict[str, float]:
    # int64 arrays, as SGLang's scheduler hands them over (`RadixKey.token_ids`), built before the clock
    prompts = [array("q", p) for p in prompts]  # type: ignore[misc]
    total_pages = sum(len(p) // page_size for p in prompts)
    cache = _ours_cache(prompts, page_size)
    handles = [cache.allocate_device(len(p) // page_size) for p in prompts]
    dups: list = []  # each insert's duplicates, freed after the clock stops

    def insert() -> None:
        for p, h in zip(prompts, handles):
            dups.append(cache.insert(p, h).duplicates)

    def match() -> None:
        for p in prompts:
            cache.match(p)

    out = {"insert": _timed(insert)}
    for d in dups:
        cache.free_device(d)
    out["match"] = _timed(match)
    out["tree_tokens"] = cache.tree.pages["device"] * page_size
    # the embedded engine's eviction, and the share of it spent in its store's checked free
    store = cache.stores["device"]
    free_runs = store.free_runs
    in_free = [0.0]

    def timed_free_runs(runs) -> None:
        t0 = time.thread_time()
        free_runs(runs)
        in_free[0] += time.thread_time() - t0

    store.free_runs = timed_free_runs  # type: ignore[method-assign]
    out["evict_checked"] = _ours_evict(cache)
    out["evict_free"] = in_free[0]
    # the tree's work alone, as SGLang's side with its mock allocator
    filled = _ours_filled(prompts, page_size)
    filled.stores["device"].free_runs = lambda runs: None  # type: ignore[method-assign]
    out["evict"] = _ours_evict(filled)
    if with_sglang:
        pool = SGLangDevicePool(server_allocator(total_pages * page_size + page_size, page_size, head_dim=1))
        on_server = _ours_filled(prompts, page_size, device=pool)
        out["evict_alloc"] = _ours_evict(on_server, pool.deferred_frees)
        assert pool.allocator.available_size() >= total_pages * page_size, "ours (allocator): pages not returned"
    return out


def run_sglang(prompts: list[list[int]], page_size: int) -> dict[str, float]:
    cache = RadixCache.create_simulated(mock_allocator=MockAllocator(), page_size=page_size)
    keys = [RadixKey(array("q", p)) for p in prompts]
    values = [torch.arange(len(p), dtype=torch.int64) for p in prompts]
    match_keys = [RadixKey(array("q", p)) for p in prompts]

    def insert() -> None:
        for k, v in zip(keys, values):
            cache.insert(InsertParams(key=k, value=v))

    def match() -> None:
        for k in match_keys:
            cache.match_prefix(MatchPrefixParams(key=k))

    out = {"insert": _timed(insert)}
    out["match"] = _timed(match)
    held = cache.evictable_size()
    chunk = max(page_size, -(-held // 10))

    def evict() -> None:
        for _ in range(10):
            cache.evict(EvictParams(num_tokens=chunk))

    out["evict"] = _timed(evict)
    assert cache.evictable_size() == 0, "sglang: eviction left tokens behind"
    out["tree_tokens"] = held
    out["evict_alloc"] = _sglang_evict_with_allocator(prompts, page_size)
    return out


def _sglang_evict_with_allocator(prompts: list[list[int]], page_size: int) -> float:
    """CPU seconds of SGLang's `RadixCache.evict` emptying the filled tree into its server's allocator
    (module docstring, `evict_alloc`)."""
    aligned = [p[: len(p) // page_size * page_size] for p in prompts]
    aligned = [p for p in aligned if p]
    total = sum(len(p) for p in aligned)
    allocator = server_allocator(total + page_size, page_size)
    cache = RadixCache.create_simulated(mock_allocator=allocator, page_size=page_size)
    for p in aligned:
        value = allocator.alloc(len(p))
        assert value is not None, "sglang allocator: pool too small"
        prefix_len = cache.insert(InsertParams(key=RadixKey(array("q", p)), value=value)).prefix_len
        if prefix_len:
            allocator.free(value[:prefix_len])  # the duplicate part, as cache_finished_req frees it
    held = cache.evictable_size()
    chunk = max(page_size, -(-held // 10))

    def evict() -> None:
        for _ in range(10):
            cache.evict(EvictParams(num_tokens=chunk))

    seconds = _timed(evict)
    assert cache.evictable_size() == 0, "sglang (allocator): eviction left tokens behind"
    assert allocator.available_size() >= total, "sglang (allocator): pages not returned"
    return seconds


def _spread(ratios: list[float]) -> dict[str, float]:
    """Median, lowest and highest of per-round ratios."""
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=1000, help="first N lines of the trace (default 1000)")
    ap.add_argument("--scale", type=int, default=32, help="tokens per 512-token trace block (default 32)")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; figures are medians (default 5)")
    ap.add_argument("--quick", action="store_true", help="smallest size: 40 requests, 2 rounds")
    ap.add_argument("--no-sglang", action="store_true", help="measure ours only")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 40, 2
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    with_sglang = SGLANG and not args.no_sglang

    reqs = load_trace(args.trace, limit=args.requests, scale=args.scale)
    prompts = [list(r.input_ids) for r in reqs]
    n_tokens = sum(len(p) for p in prompts)
    gc.collect()
    gc.freeze()  # SGLang's import leaves a large heap: keep it out of every collection below

    sides = ["sgl_hicache"] + (["sglang"] if with_sglang else [])
    runners = {"sgl_hicache": lambda p, ps: run_ours(p, ps, with_sglang), "sglang": run_sglang}
    both = OPS + (ALLOC_OPS if with_sglang else ())
    samples: dict[int, dict[str, dict[str, list[float]]]] = {
        ps: {s: {op: [] for op in both + (OURS_ONLY_OPS if s == "sgl_hicache" else ())} for s in sides}
        for ps in page_sizes
    }
    tree_tokens: dict[int, dict[str, int]] = {ps: {} for ps in page_sizes}
    free_samples: dict[int, list[float]] = {ps: [] for ps in page_sizes}
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    for rnd in range(args.repeats):
        for ps in page_sizes:
            order = sides if rnd % 2 == 0 else list(reversed(sides))
            for side in order:
                res = runners[side](prompts, ps)
                for op in samples[ps][side]:
                    samples[ps][side][op].append(res[op])
                if "evict_free" in res:
                    free_samples[ps].append(res["evict_free"])
                tree_tokens[ps][side] = int(res["tree_tokens"])

    results: dict[str, dict] = {}
    for ps in page_sizes:
        entry: dict[str, dict] = {
            "seconds_median": {},
            "prompts_per_s": {},
            "tokens_per_s": {},
            "tree_tokens": tree_tokens[ps],
        }
        for side in sides:
            med = {op: statistics.median(xs) for op, xs in samples[ps][side].items()}
            entry["seconds_median"][side] = {op: round(v, 6) for op, v in med.items()}
            entry["prompts_per_s"][side] = {
                op: round(len(prompts) / v, 1) if v else None for op, v in med.items() if not op.startswith("evict")
            }
            entry["tokens_per_s"][side] = {
                op: round((tree_tokens[ps][side] if op.startswith("evict") else n_tokens) / v, 1) if v else None
                for op, v in med.items()
            }
        if with_sglang:
            entry["ratio_ours_over_sglang"] = {
                op: round(
                    statistics.median(samples[ps]["sglang"][op]) / statistics.median(samples[ps]["sgl_hicache"][op]),
                    3,
                )
                for op in both
            }
        if with_sglang:
            # the ratio of each round's pair (the two sides ran back to back): its spread is the noise
            entry["ratio_rounds"] = {
                op: _spread([b / a for a, b in zip(samples[ps]["sgl_hicache"][op], samples[ps]["sglang"][op]) if a])
                for op in both
            }
        # of the embedded engine's eviction's CPU time, the median share spent in its store's checked free
        entry["ours_evict_free_share"] = round(
            statistics.median(
                f / e for f, e in zip(free_samples[ps], samples[ps]["sgl_hicache"]["evict_checked"]) if e
            ),
            3,
        )
        entry["samples_s"] = {
            side: {op: [round(x, 6) for x in xs] for op, xs in samples[ps][side].items()} for side in sides
        }
        results[str(ps)] = entry

    out = {
        "benchmark": "tree_ops",
        "config": {
            "trace": str(args.trace),
            "requests": len(prompts),
            "prompt_tokens": n_tokens,
            "scale": args.scale,
            "page_sizes": page_sizes,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "sglang": {"available": SGLANG, "used": with_sglang, "error": SGLANG_ERROR},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            # 1-minute load average at the start and the end (other processes share the CPUs;
            # the ratios are of interleaved rounds of CPU time, so they hold under load)
            "loadavg_1m": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        },
        "ours_path": "TieredCache (host and disk tiers off): insert / match(touch=True) / evict('device') with "
        "the store's free a no-op; evict_alloc: the same over SGLangDevicePool into SGLang's server allocator, "
        "one deferred_frees block per evict call; evict_checked: into the embedded engine's checked slot store",
        "sglang_path": "RadixCache.create_simulated(mock_allocator): insert / match_prefix / evict; "
        "evict_alloc: RadixCache.evict into the allocator SGLang's server builds (server_allocator)",
        "note": "ratio_ours_over_sglang = SGLang seconds / ours seconds (> 1: ours faster), medians of interleaved rounds"
        + ("" if with_sglang else "; SGLang not importable in this interpreter: ours only"),
        "results": results,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    summary = {
        ps: {
            "prompts_per_s": r["prompts_per_s"],
            "ratio": r.get("ratio_ours_over_sglang"),
            "ratio_rounds": r.get("ratio_rounds"),
        }
        for ps, r in results.items()
    }
    print(json.dumps({"sglang": out["sglang"], "results": summary, "wall_s": out["wall_s"]}, indent=2))
    return out


if __name__ == "__main__":
    main()
