"""Retention: eviction policies against LRU and the oracle, on every trace family, at
0.1 / 0.2 / 0.3 x the working set.

    python -m benchmarks.engine.retention --json out/retention.json [--quick]

For each trace family (`--families`) and each total capacity (`--capacities`, fractions of the
family's working set = tokens of distinct whole pages its requests touch, as `regime_map.py`
counts it) it replays the requests through the embedded engine (`--bytes metadata`: the same hits
and virtual times as real bytes) with, every one at load-at-schedule (`demote`, no prefetch), so
only retention differs:

- `lru`: the baseline; `lfu` with `--policies`;
- `belady`: the oracle's Belady eviction alone (no prefetch);
- `oracle`: Belady eviction + perfect prefetch of the next 16 requests (`policy/oracle.py`).

Capacities split device:host:disk = 1:2:8 (the device at least the largest prompt plus its output),
llama3-8b on one H200, trace clock x4, as the regime map's base cell. Reports per cell hit rate and
TTFT mean of each policy, the ceiling (the better of `belady` and `oracle`), its gain over LRU in
points, and each deployable policy's share of that gain. Families:

- `mooncake`: requests `--start`.. of the shipped conversation trace (held out from the reuse
  model's first 6,000), clock rebased;
- `synth`: a Mooncake-style trace grown from the shipped one (`sgl-hicache synth --seed 1`);
- `agentic`: BFCL agent sessions (`benchmarks/agentic_trace.py --sessions 40`).

A family whose file is missing is skipped (named in the JSON's `skipped`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE as TRACE
from benchmarks.lib.slices import MODELS, load_window, split_capacities, working_set_tokens
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.run import run_policy
from sgl_hicache.sim.simulator import EngineConfig

# name -> (EngineConfig.policy, eviction policy, prefetch window)
POLICIES = {
    "lru": ("demote", "lru", 16),
    "lfu": ("demote", "lfu", 16),
    "belady": ("oracle", "lru", 0),
    "oracle": ("oracle", "lru", 16),
}
CEILINGS = ("belady", "oracle")


def run_cell(requests: list, frac: float, ws: int, policies: list[str], page_size: int) -> dict[str, Any]:
    model_name, hw_name = MODELS["8b"]
    device, host, disk = split_capacities(requests, frac, ws, page_size)
    out: dict[str, Any] = {
        "capacity_fraction": frac,
        "device_tokens": device,
        "host_tokens": host,
        "disk_tokens": disk,
        "policies": {},
    }
    for name in policies:
        policy, eviction, window = POLICIES[name]
        cfg = EngineConfig(
            policy=policy,
            model=get_model(model_name),
            hardware=get_hardware(hw_name),
            device_tokens=device,
            host_tokens=host,
            disk_tokens=disk,
            page_size=page_size,
            concurrency=None,
            time_scale=4.0,
            eviction_policy=eviction,
            prefetch_window=window,
            byte_mode="metadata",
        )
        t = time.perf_counter()
        rep = run_policy(requests, cfg)
        out["policies"][name] = {
            "hit_rate": rep["hit_rate"],
            "ttft_mean": rep["ttft_s"]["mean"],
            "ttft_p90": rep["ttft_s"]["p90"],
            "wall_s": round(time.perf_counter() - t, 1),
        }
    p = out["policies"]
    if "lru" in p:
        lru = p["lru"]["hit_rate"]
        ceiling = max((p[c]["hit_rate"] for c in CEILINGS if c in p), default=None)
        out["ceiling_gain_points"] = None if ceiling is None else 100 * (ceiling - lru)
        for r in p.values():
            r["vs_lru_points"] = 100 * (r["hit_rate"] - lru)
            r["share_of_ceiling_gain"] = (
                (r["hit_rate"] - lru) / (ceiling - lru) if ceiling is not None and ceiling > lru else None
            )
    return out


def table(families: list[dict[str, Any]], policies: list[str]) -> str:
    head = (
        ["family", "capacity / WS"]
        + [f"{n} hit / TTFT" for n in policies]
        + ["ceiling gain (pt)"]
        + [f"{n} share" for n in policies if n not in ("lru",) + CEILINGS]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam in families:
        for c in fam["cells"]:
            p = c["policies"]
            row = [fam["family"], f"{c['capacity_fraction']:.1f}"]
            row += [f"{100 * p[n]['hit_rate']:.2f} % / {p[n]['ttft_mean']:.2f} s" for n in policies]
            g = c.get("ceiling_gain_points")
            row.append("-" if g is None else f"{g:+.2f}")
            row += [
                "-"
                if p[n].get("share_of_ceiling_gain") is None or (g or 0) < 3
                else f"{p[n]['share_of_ceiling_gain']:.2f}"
                for n in policies
                if n not in ("lru",) + CEILINGS
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mooncake", type=Path, default=TRACE)
    ap.add_argument("--start", type=int, default=6000, help="first request of the Mooncake slice")
    ap.add_argument("--requests", type=int, default=1000, help="requests per family")
    ap.add_argument(
        "--synth",
        type=Path,
        default=Path("out/synth3000.jsonl"),
        help="`sgl-hicache synth TRACE --requests 3000 --seed 1`",
    )
    ap.add_argument(
        "--agentic", type=Path, default=Path("out/agentic40.jsonl"), help="`benchmarks/agentic_trace.py --sessions 40`"
    )
    ap.add_argument("--families", default="mooncake,synth,agentic")
    ap.add_argument("--capacities", default="0.1,0.2,0.3")
    ap.add_argument("--policies", default="lru,belady,oracle")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="the smallest run: 60 Mooncake requests, 0.3 x WS")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.capacities, args.families = 60, "0.3", "mooncake"
    policies = [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    sources = {"mooncake": (args.mooncake, args.start), "synth": (args.synth, 0), "agentic": (args.agentic, 0)}
    families, skipped = [], []
    wall = time.perf_counter()
    for fam in args.families.split(","):
        path, start = sources[fam]
        if not path.exists():
            skipped.append(f"{fam}: {path} not found")
            continue
        requests = load_window(path, start, args.requests)
        ws = working_set_tokens(requests, args.page_size)
        entry = {
            "family": fam,
            "trace": str(path),
            "requests": len(requests),
            "start": start,
            "working_set_tokens": ws,
            "cells": [],
        }
        families.append(entry)
        for frac in (float(x) for x in args.capacities.split(",")):
            entry["cells"].append(run_cell(requests, frac, ws, policies, args.page_size))
            print(table([{"family": fam, "cells": entry["cells"][-1:]}], policies).splitlines()[-1], flush=True)
    result = {
        "benchmark": "retention",
        "engine": "embedded, --bytes metadata, demote (no queue prefetch), llama3-8b/h200, trace clock x4",
        "page_size": args.page_size,
        "split": "device:host:disk = 1:2:8",
        "policies": {n: dict(zip(("engine_policy", "eviction", "prefetch_window"), POLICIES[n])) for n in policies},
        "families": families,
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - wall, 1),
        "table": table(families, policies),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
