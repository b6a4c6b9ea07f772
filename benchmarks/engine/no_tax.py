"""No tax: on a workload that fits the device tier, the tiered policies must cost nothing. The embedded
engine replays one trace slice under `recompute` (device tier only) and under `demote` / `prefetch` /
`predict` (host and disk tiers on) with a device tier that holds the whole working set, and reports
each policy's TTFT against `recompute`'s.

    .venv/bin/python -m benchmarks.engine.no_tax --json no_tax.json            # ~1 min here
    .venv/bin/python -m benchmarks.engine.no_tax --quick --json no_tax.json    # seconds

Regime (defaults): the first `--requests` requests of the Mooncake conversation trace at full size
(512 tokens per block), llama3-8b on one H200 (presets), page 256, closed loop at concurrency 16, host
2,000,000 and disk 16,000,000 tokens, device = the slice's working set (distinct whole pages)
x `--device-slack` + 64 pages, so nothing is ever evicted (the JSON says so: `evicted_tokens`).
Times are the engine's virtual times (cost model), so they are exact and repeatable: one run per
policy and byte mode. `--bytes real` copies real bytes through the stores (slower; same times),
`metadata` (default) only accounts them.

Output: per policy TTFT mean / p50 / p90, hit tokens per tier, bytes moved per link, steps, device
evictions and the virtual seconds evictions charged to steps (`demote_seconds`); `ratio_vs_recompute`
per policy (TTFT mean / p90, > 1 is a tax). Exit status 1 if any ratio exceeds `--max-ratio`
(default 1.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.lib.paths import DEFAULT_TRACE
from benchmarks.lib.slices import working_set_tokens
from sgl_hicache.replay import load_trace
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig

POLICIES = ("recompute", "demote", "prefetch", "predict")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(reqs: list, policy: str, a: argparse.Namespace, device_tokens: int) -> dict:
    cfg = EngineConfig(
        policy=policy,
        model=get_model(a.model),
        hardware=get_hardware(a.hardware),
        device_tokens=device_tokens,
        host_tokens=a.host_tokens,
        disk_tokens=a.disk_tokens,
        page_size=a.page_size,
        concurrency=a.concurrency,
        byte_mode=a.bytes,
    )
    engine = EmbeddedEngine(cfg)
    t0 = time.perf_counter()
    try:
        recs = engine.run(reqs)
    finally:
        engine.close()
    ttft = list(recs.ttft_s)
    st = engine.cache.stats
    return {
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "hit_tokens": {"device": sum(recs.hit_device), "host": sum(recs.hit_host), "disk": sum(recs.hit_disk)},
        "bytes_moved": dict(st.bytes_moved),
        "evicted_tokens": dict(st.evicted_tokens),
        "steps": engine.steps,
        "demote_seconds": engine.demote_seconds,
        "virtual_end_s": engine.now,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--host-tokens", type=int, default=2_000_000)
    p.add_argument("--disk-tokens", type=int, default=16_000_000)
    p.add_argument(
        "--device-slack", type=float, default=1.0, help="device = working set x this + 64 pages (default 1.0)"
    )
    p.add_argument("--bytes", choices=("metadata", "real"), default="metadata")
    p.add_argument("--max-ratio", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="200 requests")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.requests = 200
    reqs = load_trace(str(a.trace), limit=a.requests)
    ws_pages = working_set_tokens(reqs, a.page_size) // a.page_size
    device = int(ws_pages * a.device_slack + 64) * a.page_size
    res = {pol: run(reqs, pol, a, device) for pol in POLICIES}
    base = res["recompute"]
    ratios = {
        pol: {"ttft_mean": r["ttft_mean_s"] / base["ttft_mean_s"], "ttft_p90": r["ttft_p90_s"] / base["ttft_p90_s"]}
        for pol, r in res.items()
        if pol != "recompute"
    }
    fits = all(r["evicted_tokens"].get("device", 0) == 0 for r in res.values())
    worst = max(max(v.values()) for v in ratios.values())
    out = {
        "benchmark": "no_tax",
        "regime": {
            "trace": str(a.trace),
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.input_ids) for r in reqs),
            "working_set_tokens": ws_pages * a.page_size,
            "device_tokens": device,
            "host_tokens": a.host_tokens,
            "disk_tokens": a.disk_tokens,
            "page_size": a.page_size,
            "concurrency": a.concurrency,
            "model": a.model,
            "hardware": a.hardware,
            "bytes": a.bytes,
            "fits_device": fits,
        },
        "policies": res,
        "ratio_vs_recompute": ratios,
        "max_ratio": worst,
        "within": worst <= a.max_ratio,
    }
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"regime": out["regime"], "ratio_vs_recompute": ratios, "within": out["within"]}, indent=1))
    return 0 if out["within"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
