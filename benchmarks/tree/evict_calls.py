"""CPU time of one small device eviction on a full tree: the incremental leaf queue against a heap
rebuilt over every evictable leaf on each call (the path of an eviction order whose keys do not only grow,
such as `reuse`).

    .venv/bin/python -m benchmarks.tree.evict_calls --json evict_calls.json
    .venv/bin/python -m benchmarks.tree.evict_calls --quick --json quick.json

Builds a `TieredCache` (host and disk off, so an evicted page is dropped) from the first `--requests`
requests of the shipped Mooncake conversation trace (512-token blocks scaled to `--scale` tokens,
page 16, a device pool that holds them all), then makes `--calls` rounds of what a scheduler does
under memory pressure: match a prompt (touching its path, so queued keys go stale) and evict
`--pages` pages. Each eviction is timed with `time.thread_time()` (CPU time of the calling thread: a
loaded 2-core machine deschedules the process for tens of ms, which wall time would report as the
call's). Rounds alternate incremental / rebuilt (`--repeats`, medians of p50 / p99 / max), then the
incremental queue under each of `--policies` (`ratio_over_lru_p50`; the bar is at most 1.2).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from benchmarks.lib.paths import DEFAULT_TRACE
from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.replay import load_trace
from sgl_hicache.tiers.base import DEVICE

PAGE = 16


def build(prompts: list[list[int]], incremental: bool, policy: str = "lru") -> TieredCache:
    tokens = sum(len(p) for p in prompts) + PAGE
    cfg = CacheConfig(
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=8),
        device_tokens=tokens,
        host_tokens=0,
        disk_tokens=0,
        page_size=PAGE,
        eviction_policy=policy,
    )
    clock = [0.0]
    cache = TieredCache(cfg, clock=lambda: clock[0])
    if not incremental:
        cache.tree.leaves = None  # evict() then rebuilds its heap on every call
    for p in prompts:
        clock[0] += 1.0
        m = cache.match(p)
        need = len(p) // PAGE - len(m.device_handles)
        fresh = cache.allocate_device(need)
        assert fresh is not None, "the pool must hold the whole stream"
        cache.insert(p[: len(p) // PAGE * PAGE], m.device_handles + fresh)
    return cache


def one_round(
    prompts: list[list[int]], incremental: bool, calls: int, pages: int, policy: str = "lru"
) -> dict[str, float]:
    cache = build(prompts, incremental, policy)
    leaves = sum(1 for _ in cache.tree.tier_leaves(DEVICE))
    clock = float(len(prompts))
    times = []
    for i in range(calls):
        clock += 1.0
        cache.clock = lambda c=clock: c
        cache.match(prompts[-1 - i % len(prompts)])
        t0 = time.thread_time()
        cache.evict(DEVICE, pages)
        times.append(time.thread_time() - t0)
    times.sort()
    return {
        "p50_us": times[len(times) // 2] * 1e6,
        "p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6,
        "max_us": times[-1] * 1e6,
        "device_leaves_before": leaves,
        "nodes_after": cache.tree.node_count,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--scale", type=int, default=16, help="tokens per 512-token trace block")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--pages", type=int, default=4, help="pages per eviction")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="lfu", help="incremental policies timed beside LRU")
    ap.add_argument("--quick", action="store_true", help="smallest size: 60 requests, 20 calls, 1 round")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.requests, a.calls, a.repeats = 60, 20, 1
    reqs = load_trace(a.trace, scale=a.scale, limit=a.requests, vocab_size=1024)
    prompts = [list(r.input_ids) for r in reqs if len(r.input_ids) >= PAGE]
    extra = [p for p in a.policies.split(",") if p]
    rounds: dict[str, list[dict[str, float]]] = {"incremental": [], "rebuilt": [], **{p: [] for p in extra}}
    for _ in range(a.repeats):
        for mode in rounds:  # interleaved; "incremental" and "rebuilt" are LRU's two paths
            policy = mode if mode in extra else "lru"
            rounds[mode].append(one_round(prompts, mode != "rebuilt", a.calls, a.pages, policy))
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rounds.items()}
    out = {
        "benchmark": "evict_calls",
        "config": {
            "requests": a.requests,
            "scale": a.scale,
            "page_size": PAGE,
            "calls": a.calls,
            "pages": a.pages,
            "repeats": a.repeats,
            "quick": a.quick,
            "clock": "thread_time",
        },
        "machine": {"python": platform.python_version(), "loadavg": __import__("os").getloadavg()},
        "median": med,
        "rounds": rounds,
        "ratio_rebuilt_over_incremental_p50": med["rebuilt"]["p50_us"] / max(med["incremental"]["p50_us"], 1e-9),
        "ratio_over_lru_p50": {p: med[p]["p50_us"] / max(med["incremental"]["p50_us"], 1e-9) for p in extra},
    }
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
