"""CPU time per request that sgl_hicache's cache path costs, against SGLang's own RadixCache, on a
workload that fits the device tier entirely (tiering can gain nothing there and must cost almost nothing).

    .venv-sglang/bin/python -m benchmarks.tree.overhead --json overhead.json          # ~20 s here
    .venv-sglang/bin/python -m benchmarks.tree.overhead --quick --json overhead.json  # seconds

Workload: the prompts of the first `--requests` lines of the Mooncake conversation trace
(`load_trace(limit=N, scale=S)`), served one after the other; the device tier holds every page of every
prompt, so nothing is ever evicted, and host and disk tiers are configured (small) but never used.

Each prompt is an int64 `array` on both sides, built before the clock (SGLang's `RadixKey.token_ids`).
Per request, what a scheduler calls:
- ours (`TieredCache`): `match`, `record_request`, `promote` only if the match has lower-tier tokens
  (never here), `lock`, `allocate_device` for the new pages, `insert`, `free_device(duplicates)`,
  `unlock`.
- SGLang (`RadixCache.create_simulated` with a mock allocator): `match_prefix`, `inc_lock_ref`,
  `insert(key, value=the request's KV row)`, `dec_lock_ref`. The row (what `req_to_token` holds) is
  built before the clock starts, and SGLang's allocator is a mock that does nothing, so SGLang's figure
  is a lower bound of its real cost. Ours pays its real slot allocator; its share is reported apart
  (`alloc_us`, CPU time around `allocate_device` / `free_device`).
CPU time is `time.thread_time()` of the loop (this thread only: other users of a shared machine do not
count), rounds interleaved (ours, SGLang, SGLang, ours, ...), `--repeats` rounds, medians.
`ratio_ours_over_sglang` > 1 means ours costs more per request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from array import array
from pathlib import Path

from benchmarks.lib.trees import TINY, MockAllocator, add_trace_args
from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig
from sgl_hicache.replay import load_trace

try:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    SGLANG, SGLANG_ERROR = True, None
except Exception as exc:  # noqa: BLE001
    SGLANG, SGLANG_ERROR = False, f"{type(exc).__name__}: {exc}"


def run_ours(prompts: list[list[int]], page_size: int) -> dict[str, float]:
    pages = sum(len(p) // page_size for p in prompts)
    cfg = CacheConfig(
        TINY, device_tokens=pages * page_size + page_size, host_tokens=64 * page_size, page_size=page_size
    )
    cache = TieredCache(cfg)
    prompts = [array("q", p) for p in prompts]  # type: ignore[misc]  # as SGLang's RadixKey holds them
    alloc_s = 0.0
    pc = time.perf_counter
    tt = time.thread_time  # the allocator's share in CPU time, as the total is
    gc.collect()
    t0 = time.thread_time()
    w0 = pc()
    for tokens in prompts:
        m = cache.match(tokens)
        cache.record_request(len(tokens), m)
        if m.lower_tier_tokens:
            m = cache.promote(m)
        cache.lock(m.last_node)
        a0 = tt()
        fresh = cache.allocate_device(len(tokens) // page_size - len(m.device_handles))
        alloc_s += tt() - a0
        r = cache.insert(tokens, m.device_handles + fresh)
        if r.duplicates:
            a0 = tt()
            cache.free_device(r.duplicates)
            alloc_s += tt() - a0
        cache.unlock(m.last_node)
    cpu = time.thread_time() - t0
    wall = pc() - w0
    assert cache.snapshot()["evicted_tokens"]["device"] == 0, "the workload must fit the device tier"
    cache.check()
    return {"cpu_s": cpu, "wall_s": wall, "alloc_s": alloc_s, "hit_tokens": cache.stats.hit_tokens["device"]}


def run_sglang(prompts: list[list[int]], page_size: int) -> dict[str, float]:
    cache = RadixCache.create_simulated(mock_allocator=MockAllocator(), page_size=page_size)
    keys = [RadixKey(array("q", p)) for p in prompts]
    rows = [torch.arange(len(p), dtype=torch.int64) for p in prompts]
    hits = 0
    pc = time.perf_counter
    gc.collect()
    t0 = time.thread_time()
    w0 = pc()
    for key, row in zip(keys, rows):
        m = cache.match_prefix(MatchPrefixParams(key=key))
        hits += m.device_prefix_len
        lk = cache.inc_lock_ref(m.last_device_node)
        r = cache.insert(InsertParams(key=key, value=row))
        cache.dec_lock_ref(m.last_device_node, lk.to_dec_params())
    cpu = time.thread_time() - t0
    wall = pc() - w0
    assert cache.protected_size() == 0
    return {"cpu_s": cpu, "wall_s": wall, "alloc_s": 0.0, "hit_tokens": hits, "last_prefix": r.prefix_len}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(ap, repeats=7)
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 50, 2
    with_sglang = SGLANG and not args.no_sglang
    prompts = [list(r.input_ids) for r in load_trace(args.trace, limit=args.requests, scale=args.scale)]
    gc.collect()
    gc.freeze()
    sides = ["sgl_hicache"] + (["sglang"] if with_sglang else [])
    runners = {"sgl_hicache": run_ours, "sglang": run_sglang}
    samples: dict[str, list[dict]] = {s: [] for s in sides}
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    for rnd in range(args.repeats):
        for side in sides if rnd % 2 == 0 else list(reversed(sides)):
            samples[side].append(runners[side](prompts, args.page_size))

    n = len(prompts)

    def us(side: str, field: str) -> float:
        return round(statistics.median(s[field] for s in samples[side]) / n * 1e6, 2)

    per_req = {side: {"cpu_us": us(side, "cpu_s"), "wall_us": us(side, "wall_s")} for side in sides}
    per_req["sgl_hicache"]["alloc_us"] = us("sgl_hicache", "alloc_s")
    per_req["sgl_hicache"]["cpu_us_without_alloc"] = round(
        per_req["sgl_hicache"]["cpu_us"] - per_req["sgl_hicache"]["alloc_us"], 2
    )
    out = {
        "benchmark": "overhead",
        "config": {
            "trace": str(args.trace),
            "requests": n,
            "prompt_tokens": sum(map(len, prompts)),
            "scale": args.scale,
            "page_size": args.page_size,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "sglang": {"available": SGLANG, "used": with_sglang, "error": SGLANG_ERROR},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            # 1-minute load average at the start and the end (rounds are interleaved CPU time)
            "loadavg_1m": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        },
        "us_per_request": per_req,
        "device_hit_tokens": {side: int(samples[side][0]["hit_tokens"]) for side in sides},
        "samples_cpu_s": {side: [round(s["cpu_s"], 5) for s in samples[side]] for side in sides},
        "note": "CPU time (thread_time) per request of the cache calls a scheduler makes; nothing is evicted or promoted"
        + ("" if with_sglang else "; SGLang not importable in this interpreter: ours only"),
    }
    if with_sglang:
        ours, theirs = per_req["sgl_hicache"], per_req["sglang"]
        out["ratio_ours_over_sglang"] = {
            "cpu": round(ours["cpu_us"] / theirs["cpu_us"], 3),
            "cpu_without_alloc": round(ours["cpu_us_without_alloc"] / theirs["cpu_us"], 3),
            "wall": round(ours["wall_us"] / theirs["wall_us"], 3),
        }
        out["added_us_per_request"] = round(ours["cpu_us"] - theirs["cpu_us"], 2)
    out["wall_s"] = round(time.perf_counter() - t_start, 2)
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(
        json.dumps(
            {
                k: out.get(k)
                for k in ("sglang", "us_per_request", "ratio_ours_over_sglang", "device_hit_tokens", "wall_s")
            },
            indent=2,
        )
    )
    return out


if __name__ == "__main__":
    main()
