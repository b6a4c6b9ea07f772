"""Where can any predictor matter? The regime map.

    python -m benchmarks.engine.regime_map --json out/regime_map.json [--plot out/regime_map.png] [--quick]

For each cell of a coarse grid (by default a star: one base cell and one axis changed at a time;
`--grid full` for every combination) (capacity of device+host+disk against the slice's working set, disk
bandwidth 0.98 vs 5.23 GB/s, model preset 8B / 32B / 480B, load = the trace clock stretched x1 / x2 / x4)
it replays one slice of the shipped trace through the embedded engine with:

- `lru`: `demote` (load at schedule, LRU eviction): the baseline;
- `prefetch`: disk -> host while the request queues, LRU;
- `reuse`: `prefetch` with eviction by the reuse model's expected value (`policy/reuse.py`);
- `predict`: `reuse` plus the continuation predictor's promotions ahead of arrival (guarded);
- `oracle`: Belady eviction + perfect prefetch (`policy/oracle.py`): the ceiling.

and reports per cell hit rate, TTFT mean and bytes moved of each, the oracle's gain over LRU, and each
policy's share of that gain (`(x - lru) / (oracle - lru)`, hit rate). Cells where the oracle gains < 10 %
(relative hit rate) are marked "nothing to gain". Hit counts are exact; times are virtual (cost model).

The slice is held out by default: requests `--start` .. `--start + --requests` of the trace, clock rebased
to 0, away from the first 6,000 requests the reuse model was designed on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE as TRACE
from benchmarks.lib.slices import MODELS, load_window, working_set_tokens
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.run import run_policy
from sgl_hicache.sim.simulator import EngineConfig

GB = 1e9
# name -> (EngineConfig.policy, eviction policy, predictor)
POLICIES = {
    "lru": ("demote", "lru", "tree_walk"),
    "prefetch": ("prefetch", "lru", "tree_walk"),
    "reuse": ("prefetch", "reuse", "tree_walk"),
    "predict": ("predict", "reuse", "continuation"),
    "oracle": ("oracle", "lru", "tree_walk"),
}


def run_cell(
    requests: list, cell: dict[str, Any], policies: list[str], page_size: int, largest_prompt: int
) -> dict[str, Any]:
    model_name, hw_name = MODELS[cell["model"]]
    hw = get_hardware(hw_name).replace(
        disk_read_bandwidth=cell["disk_gbs"] * GB, disk_write_bandwidth=cell["disk_gbs"] * GB
    )
    total = cell["capacity_tokens"]
    # device:host:disk = 1:2:8 of the total, the device at least one prompt plus its output
    device = max(total // 11, largest_prompt + 4 * page_size)
    host, disk = 2 * total // 11, max(0, total - device - 2 * total // 11)
    out: dict[str, Any] = {
        "cell": cell,
        "device_tokens": device,
        "host_tokens": host,
        "disk_tokens": disk,
        "policies": {},
    }
    for name in policies:
        policy, eviction, predictor = POLICIES[name]
        cfg = EngineConfig(
            policy=policy,
            model=get_model(model_name),
            hardware=hw,
            device_tokens=device,
            host_tokens=host,
            disk_tokens=disk,
            page_size=page_size,
            concurrency=None,
            time_scale=cell["load_stretch"],
            eviction_policy=eviction,
            predictor=predictor,
        )
        rep = run_policy(requests, cfg)
        pred = rep.get("predict") or {}
        out["policies"][name] = {
            "hit_rate": rep["hit_rate"],
            "ttft_mean": rep["ttft_s"]["mean"],
            "ttft_p90": rep["ttft_s"]["p90"],
            "bytes_moved": sum(rep["bytes_moved"].values())
            // cfg.storage_layout.bytes_per_token
            * cfg.model.kv_bytes_per_token,
            "predict_promoted_tokens": pred.get("promoted_tokens", 0),
            "predict_precision": pred.get("precision"),
            "prefetch_coverage": (rep.get("prefetch") or {}).get("coverage"),
        }
    p = out["policies"]
    if "lru" in p and "oracle" in p:
        lru, orc = p["lru"]["hit_rate"], p["oracle"]["hit_rate"]
        out["oracle_gain"] = (orc - lru) / lru if lru else None
        out["gainable"] = bool(lru == 0 and orc > 0) or (lru > 0 and (orc - lru) / lru >= 0.10)
        for r in p.values():
            r["share_of_oracle_gain"] = (r["hit_rate"] - lru) / (orc - lru) if orc > lru else None
            r["ttft_vs_lru"] = r["ttft_mean"] / p["lru"]["ttft_mean"] if p["lru"]["ttft_mean"] else None
            r["bytes_vs_lru"] = r["bytes_moved"] / p["lru"]["bytes_moved"] if p["lru"]["bytes_moved"] else None
    return out


def table(cells: list[dict[str, Any]], policies: list[str]) -> str:
    head = (
        "| capacity / WS | disk GB/s | model | load | "
        + " | ".join(f"{p} hit" for p in policies)
        + " | oracle gain | "
        + " | ".join(f"{p} share" for p in policies if p not in ("lru", "oracle"))
        + " | "
        + " | ".join(f"{p} TTFT/lru" for p in policies if p != "lru")
        + " |"
    )
    lines = [head, "|" + "---|" * head.count("|")[:-1] if False else "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        cell, p = c["cell"], c["policies"]
        row = [f"{cell['capacity_fraction']:.2f}", f"{cell['disk_gbs']}", cell["model"], f"x{cell['load_stretch']:g}"]
        row += [f"{100 * p[n]['hit_rate']:.1f} %" for n in policies]
        gain = c.get("oracle_gain")
        row.append("-" if gain is None else f"{100 * gain:+.0f} %" + ("" if c.get("gainable") else " (none)"))
        row += [
            "-" if p[n].get("share_of_oracle_gain") is None else f"{p[n]['share_of_oracle_gain']:.2f}"
            for n in policies
            if n not in ("lru", "oracle")
        ]
        row += [
            "-" if p[n].get("ttft_vs_lru") is None else f"{p[n]['ttft_vs_lru']:.3f}" for n in policies if n != "lru"
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(10, len(cells) * 0.9), 4.8))
    xs = list(range(len(cells)))
    labels = [
        f"{c['cell']['capacity_fraction']:.2f}/{c['cell']['disk_gbs']}/{c['cell']['model']}/x{c['cell']['load_stretch']:g}"
        for c in cells
    ]
    for name in policies:
        ax.plot(xs, [100 * c["policies"][name]["hit_rate"] for c in cells], marker="o", label=name)
        ax2.plot(xs, [c["policies"][name].get("ttft_vs_lru") or 1.0 for c in cells], marker="o", label=name)
    for a, ylabel in ((ax, "hit rate (% of prompt tokens)"), (ax2, "TTFT mean / LRU's (lower is better)")):
        a.set_xticks(xs)
        a.set_xticklabels(labels, rotation=70, fontsize=7)
        a.set_ylabel(ylabel)
        a.set_xlabel("cell: capacity/WS, disk GB/s, model, load stretch")
        a.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument(
        "--start",
        type=int,
        default=6000,
        help="first request of the slice (held out: the reuse model was looked at on 0..5999)",
    )
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument(
        "--capacities", default="0.3,0.1,1.0", help="total tier capacity as fractions of the slice's working set"
    )
    ap.add_argument("--disk-gbs", default="5.23,0.98")
    ap.add_argument("--models", default="8b,32b,480b")
    ap.add_argument(
        "--loads", default="4,1", help="trace clock stretch factors (1 = the trace's own clock, 4 = 4x slower arrivals)"
    )
    ap.add_argument("--policies", default="lru,reuse,predict,oracle")
    ap.add_argument(
        "--grid",
        choices=["star", "full"],
        default="star",
        help="star (default): a base cell (the first value of each axis) and one axis changed at a time; full: every combination",
    )
    ap.add_argument("--quick", action="store_true", help="the smallest map: 30 requests, one cell")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.capacities, args.disk_gbs, args.models, args.loads = 30, "0.3", "5.23", "8b", "4"
    policies = [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    requests = load_window(args.trace, args.start, args.requests)
    ws = working_set_tokens(requests, args.page_size)
    largest = max(len(r.input_ids) + r.output_length for r in requests)
    cells = []
    wall = time.perf_counter()
    axes = (
        [float(x) for x in args.capacities.split(",")],
        [float(x) for x in args.disk_gbs.split(",")],
        args.models.split(","),
        [float(x) for x in args.loads.split(",")],
    )
    if args.grid == "full":
        grid = list(itertools.product(*axes))
    else:  # star: the first value of every axis, then each other value of one axis at a time
        base = tuple(a[0] for a in axes)
        grid = [base] + [tuple(v if i == k else base[i] for i in range(4)) for k, a in enumerate(axes) for v in a[1:]]
    for frac, gbs, model, load in grid:
        cell = {
            "capacity_fraction": frac,
            "capacity_tokens": int(frac * ws),
            "disk_gbs": gbs,
            "model": model,
            "load_stretch": load,
        }
        cells.append(run_cell(requests, cell, policies, args.page_size, largest))
        print(table(cells[-1:], policies).splitlines()[-1], flush=True)
    result = {
        "trace": str(args.trace),
        "slice": [args.start, args.start + args.requests],
        "working_set_tokens": ws,
        "page_size": args.page_size,
        "policies": {n: dict(zip(("engine_policy", "eviction", "predictor"), POLICIES[n])) for n in policies},
        "wall_s": time.perf_counter() - wall,
        "cells": cells,
        "table": table(cells, policies),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(cells, policies, args.plot)
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
