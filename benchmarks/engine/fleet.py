"""What would a shared store give a fleet? The embedded engine's fleet what-if over a grid.

    .venv/bin/python -m benchmarks.engine.fleet --json fleet.json            # ~3 min here
    .venv/bin/python -m benchmarks.engine.fleet --quick --json fleet.json    # seconds

N simulated servers (`sgl_hicache/sim/fleet.py`) replay the first `--requests` requests of the
shipped Mooncake conversation trace together, on one virtual timeline, without a store (each server
its own disk tier) and with a shared store in the disk tier's place, for each routing (round-robin,
by session) and each store link bandwidth (per server; latency `--latency-us` per transfer). Same
model and hardware preset (llama3-8b on one H200), capacities and policy (`prefetch`) in every cell.
Virtual time: the figures are deterministic (one run per cell, no repeats needed). Ratios are
store / local (hit rate, TTFT mean and p90, throughput).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from benchmarks.lib.paths import DEFAULT_TRACE as TRACE
from sgl_hicache.replay import load_trace
from sgl_hicache.sim.fleet import ROUTES, fleet_whatif
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EngineConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--bandwidths", default="1,10,50", help="store link GB/s per server, comma-separated")
    ap.add_argument("--latency-us", type=float, default=200.0)
    ap.add_argument("--device-tokens", type=int, default=500_000)
    ap.add_argument("--host-tokens", type=int, default=2_000_000)
    ap.add_argument("--disk-tokens", type=int, default=16_000_000)
    ap.add_argument("--policy", default="prefetch")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated: round_robin, session")
    ap.add_argument(
        "--quick", action="store_true", help="200 requests, 2 servers, round-robin, 10 GB/s, smaller tiers (smoke size)"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.servers, args.bandwidths, args.routes = 200, 2, "10", "round_robin"
        args.device_tokens, args.host_tokens = 200_000, 800_000
    requests = load_trace(TRACE, limit=args.requests)
    base = EngineConfig(
        policy=args.policy,
        model=get_model("llama3-8b"),
        hardware=get_hardware("h200"),
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        disk_tokens=args.disk_tokens,
        store_latency_s=args.latency_us * 1e-6,
    )
    rows = []
    t0 = time.perf_counter()
    for route in args.routes.split(","):
        for gbps in (float(x) for x in args.bandwidths.split(",")):
            cfg = base.__class__(**{**base.__dict__, "store_bandwidth": gbps * 1e9})
            out = fleet_whatif(requests, cfg, args.servers, route)
            loc, sto = out["policies"]["local"], out["policies"]["store"]
            row = {
                "route": route,
                "store_gbps": gbps,
                "hit_rate_local": loc["hit_rate"],
                "hit_rate_store": sto["hit_rate"],
                "store_hit_tokens": sto["hit_tokens"]["disk"],
                "local_disk_hit_tokens": loc["hit_tokens"]["disk"],
                "ttft_mean_local": loc["ttft_s"]["mean"],
                "ttft_mean_store": sto["ttft_s"]["mean"],
                "ttft_p90_local": loc["ttft_s"]["p90"],
                "ttft_p90_store": sto["ttft_s"]["p90"],
                "throughput_local": loc["throughput_tok_s"],
                "throughput_store": sto["throughput_tok_s"],
                "store_pages_written": sto["store"]["pages_written"],
                "store_pages_read": sto["store"]["pages_read"],
                "loads_recomputed_store": sto["prefetch"]["loads_recomputed"],
                **{f"ratio_{k}": v for k, v in out["ratios"]["store/local"].items()},
            }
            rows.append(row)
            print(
                f"{route:<11} {gbps:>5g} GB/s  hit {100 * row['hit_rate_local']:.1f}% -> {100 * row['hit_rate_store']:.1f}%  "
                f"ttft mean x{row['ratio_ttft_mean']:.3f} p90 x{row['ratio_ttft_p90']:.3f}  throughput x{row['ratio_throughput']:.3f}",
                flush=True,
            )
    result = {
        "benchmark": "fleet_whatif",
        "requests": len(requests),
        "servers": args.servers,
        "policy": args.policy,
        "model": "llama3-8b",
        "hardware": "h200",
        "device_tokens": args.device_tokens,
        "host_tokens": args.host_tokens,
        "disk_tokens": args.disk_tokens,
        "latency_us": args.latency_us,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
        "python": platform.python_version(),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
