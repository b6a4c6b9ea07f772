"""Benchmark 4: the embedded engine's policy comparison at production scale on the shipped trace.

    python -m benchmarks.engine.production --json out/production_compare.json [--limit 2000] [--quick]

Runs `recompute`, `demote`, `prefetch`, `predict` and `oracle` (the ceiling) side by side (same trace, same capacities) for
each (model, hardware) case below and reports TTFT, throughput and hit tokens per tier, with ratios
against `recompute` and `demote`. Capacities are sized from each case's real memory: the device tier
gets the KV room left on the GPUs after the weights (times `--device-fraction`), the host tier
`--host-gb` of DRAM, the disk tier `--disk-tb` of NVMe, all in tokens of that model's KV.
Times are virtual (the cost model, docs/embedded-engine.md); hit counts are exact.
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
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.run import compare
from sgl_hicache.sim.simulator import EngineConfig

CASES = [("llama3-8b", "h200"), ("qwen2.5-32b", "h200"), ("qwen3-coder-480b-a35b", "8xh200")]


def capacities(model_name: str, hw_name: str, device_fraction: float, host_gb: float, disk_tb: float) -> dict[str, int]:
    model, hw = get_model(model_name), get_hardware(hw_name)
    kv = model.kv_bytes_per_token
    free = max(hw.device_memory_bytes * hw.num_gpus * 0.9 - model.weight_bytes, 0)
    return {
        "device_tokens": max(int(free * device_fraction / kv), 65536),
        "host_tokens": int(host_gb * 1e9 / kv),
        "disk_tokens": int(disk_tb * 1e12 / kv),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--device-fraction", type=float, default=0.9, help="share of the GPUs' free memory given to the prefix cache"
    )
    ap.add_argument("--host-gb", type=float, default=256)
    ap.add_argument("--disk-tb", type=float, default=4)
    ap.add_argument("--quick", action="store_true", help="smallest size: 60 requests, llama3-8b only")
    args = ap.parse_args(argv)
    limit = 60 if args.quick else args.limit
    cases = CASES[:1] if args.quick else CASES
    requests = load_trace(TRACE, limit=limit)
    out = {
        "benchmark": "production_compare",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "trace": str(TRACE),
        "requests": limit,
        "concurrency": args.concurrency,
        "cases": {},
    }
    for model_name, hw_name in cases:
        caps = capacities(model_name, hw_name, args.device_fraction, args.host_gb, args.disk_tb)
        base = EngineConfig(
            "recompute",
            get_model(model_name),
            get_hardware(hw_name),
            page_size=256,
            concurrency=args.concurrency,
            **caps,
        )
        t0 = time.perf_counter()
        result = compare(requests, base)
        summary = {}
        for name, rep in result["policies"].items():
            summary[name] = {
                "hit_tokens": rep["hit_tokens"],
                "hit_rate": rep["hit_rate"],
                "ttft_s": rep["ttft_s"],
                "throughput_tok_s": rep["throughput_tok_s"],
                "prefetch": rep["prefetch"],
                "predict": rep["predict"],
            }
        out["cases"][f"{model_name}@{hw_name}"] = {
            "capacities": caps,
            "policies": summary,
            "ratios": result["ratios"],
            "wall_s": time.perf_counter() - t0,
        }
        print(
            f"{model_name}@{hw_name}: "
            + ", ".join(
                f"{n} ttft {s['ttft_s']['mean']:.2f}s hit {100 * s['hit_rate']:.1f}%" for n, s in summary.items()
            ),
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
