"""Do an agent framework's hints pay, and never harm? Hints against no hints against the oracle.

    PYTHONPATH=. python -m benchmarks.engine.agent_hints --json benchmarks/results/agent_hints.json
    PYTHONPATH=. python -m benchmarks.engine.agent_hints --quick --json /tmp/agent_hints.json   # one small cell
    PYTHONPATH=. python -m benchmarks.engine.agent_hints --hostile --cells 40000/80000/long --json benchmarks/results/agent_hints_hostile.json

Workload: the `agent` shape (`replay/shapes.py`) with long contexts (a 4k-token task, tool results
of 0.5-2k tokens: sessions of up to 21k tokens, together many times the device tier), beside other
users' one-shot prompts that push a paused session down the tiers. With hints, the framework knows
its tools' durations only roughly (lognormal error, spread 0.5): when a tool call starts it asks the
cache to retain the step's prompt for its estimate (``pin``), and it prefetches that prompt 2 s
before the estimate runs out. The requests are the same with and without hints.

Embedded engine (virtual time, deterministic), llama3-8b on the H200 cost model, trace clock,
`predict` (the shipped policy) with and without the hints, and `oracle` (Belady eviction and
perfect prefetch) without them. Grid: device / host tier sizes x tool-pause lengths. Per cell:
TTFT mean / p50 / p99 (all requests), job completion time (the mean of each agent's last-step
arrival + TTFT minus its first arrival), bytes moved, and the hints' counters. Bars: hints at most
1.05x the no-hint mean and p99 TTFT in every cell; where the oracle gains, hints take at least half
of its mean-TTFT gain over no hints (`share_of_oracle_gain`). With `--hostile`, also a client that
asks to keep every prompt (one-shot ones included) for 600 s: its cost to everyone is bounded by the
retention shares and refusals (`hostile_mean_ratio`, `hostile_p99_ratio` against no hints).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.lib.engine_runs import agent_engine, percentile
from sgl_hicache.replay.shapes import agent

TIERS = ((30_000, 300_000), (40_000, 80_000), (80_000, 160_000))  # (device, host) tokens
PAUSES = {"short": (5.0, 20.0), "long": (30.0, 120.0)}  # the long tools' duration range, s


def run(requests: list, policy: str, device: int, host: int) -> dict[str, Any]:
    """One policy on one trace: the figures of the module docstring."""
    engine = agent_engine(policy, device, host, disk=4_000_000)
    started = time.process_time()
    try:
        engine.run(requests)
        engine.cache.check()
        rec = engine.records
        ttft = list(rec.ttft_s)
        done = {a: a + t for a, t in zip(rec.arrival_s, rec.ttft_s)}
        jobs = {}
        for r in requests:
            if r.session and r.session.startswith("agent"):
                first, last = jobs.get(r.session, (r.arrival_s, r.arrival_s))
                jobs[r.session] = (min(first, r.arrival_s), max(last, r.arrival_s))
        jct = [done[last] - first for first, last in jobs.values() if last in done]
        snap = engine.cache.snapshot()
        return {
            "ttft_mean_s": mean(ttft),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "jct_mean_s": mean(jct) if jct else None,
            "hit_tokens": snap["hit_tokens"],
            "bytes_moved_total": sum(snap["bytes_moved"].values()),
            "hints": engine.controller.hints.summary(),
            "hints_rejected_by_engine": engine.hints_rejected,
            "carried_to_device_tokens": engine.controller.speculation.carried_tokens,
            "device_hit_tokens": snap["hit_tokens"].get("device") if isinstance(snap["hit_tokens"], dict) else None,
            "cpu_s": time.process_time() - started,
        }
    finally:
        engine.close()


def hostile(requests: list) -> list:
    """The same requests, each asking the cache to keep its prompt for the longest time allowed
    (600 s), every one-shot prompt included: a client that hints everything, for as long as it may."""
    from sgl_hicache.policy.hint_rules import Hint
    from sgl_hicache.replay.trace import Request

    return [
        Request(
            r.request_id,
            r.session,
            r.arrival_s,
            r.input_ids,
            r.output_length,
            r.line,
            hints=(Hint("pin", tuple(r.input_ids), ttl_s=600.0, after_s=0.5),),
        )
        for r in requests
    ]


def cell(
    device: int,
    host: int,
    long_s: tuple[float, float],
    sessions: int,
    seed: int,
    with_hostile: bool = False,
    estimate_sigma: float = 0.5,
) -> dict[str, Any]:
    """One grid cell: no hints, hints and the oracle on the same requests, and the bars (with
    `with_hostile`, also the hostile client's hints, `hostile`, against no hints)."""
    shape = {
        "sessions": sessions,
        "task_tokens": 4096,
        "result_tokens": (512, 2048),
        "long_s": long_s,
        "other_gap_s": 2.0,
        "session_gap_s": 5.0,
        "seed": seed,
    }
    plain, hinted = agent(**shape), agent(**shape, pins=True, estimate_sigma=estimate_sigma)
    out: dict[str, Any] = {
        "device_tokens": device,
        "host_tokens": host,
        "long_tool_s": list(long_s),
        "requests": len(plain),
    }
    out["no_hints"] = run(plain, "predict", device, host)
    out["hints"] = run(hinted, "predict", device, host)
    out["oracle"] = run(plain, "oracle", device, host)
    if with_hostile:
        out["hostile"] = run(hostile(plain), "predict", device, host)
    base, h, orc = out["no_hints"], out["hints"], out["oracle"]
    gain = base["ttft_mean_s"] - orc["ttft_mean_s"]
    out["summary"] = {
        "mean_ratio": h["ttft_mean_s"] / base["ttft_mean_s"],
        "p99_ratio": h["ttft_p99_s"] / base["ttft_p99_s"],
        "oracle_gain_s": gain,
        "share_of_oracle_gain": (base["ttft_mean_s"] - h["ttft_mean_s"]) / gain
        if gain > 0.01 * base["ttft_mean_s"]
        else None,
    }
    if with_hostile:
        out["summary"]["hostile_mean_ratio"] = out["hostile"]["ttft_mean_s"] / base["ttft_mean_s"]
        out["summary"]["hostile_p99_ratio"] = out["hostile"]["ttft_p99_s"] / base["ttft_p99_s"]
    s = out["summary"]
    s["passes"] = (
        s["mean_ratio"] <= 1.05
        and s["p99_ratio"] <= 1.05
        and (s["share_of_oracle_gain"] is None or s["share_of_oracle_gain"] >= 0.5)
    )
    print(
        f"device {device:>7,} host {host:>8,} long {long_s}: mean {base['ttft_mean_s']:.3f} / {h['ttft_mean_s']:.3f} / "
        f"{orc['ttft_mean_s']:.3f} s  p99 {base['ttft_p99_s']:.3f} / {h['ttft_p99_s']:.3f} / {orc['ttft_p99_s']:.3f}  "
        f"(no hints / hints / oracle)  share {s['share_of_oracle_gain']}  passes {s['passes']}"
        + (f"  hostile mean x{s['hostile_mean_ratio']:.3f} p99 x{s['hostile_p99_ratio']:.3f}" if with_hostile else ""),
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="one small cell (a smoke run)")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--seeds", default="0", help="comma-separated trace seeds (repeats)")
    ap.add_argument("--hostile", action="store_true", help="also a client that asks to keep every prompt for 600 s")
    ap.add_argument(
        "--estimate-sigma", type=float, default=0.5, help="spread of the framework's tool-duration error (0: exact)"
    )
    ap.add_argument("--cells", help="comma-separated subset of the grid, as DEVICE/HOST/PAUSE (e.g. 40000/80000/long)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = [(d, h, name, p) for d, h in TIERS for name, p in PAUSES.items()]
    sessions = args.sessions
    if args.cells:
        wanted = set(args.cells.split(","))
        cells = [c for c in cells if f"{c[0]}/{c[1]}/{c[2]}" in wanted]
    if args.quick:
        cells, sessions, seeds = [(30_000, 300_000, "short", PAUSES["short"])], 4, [0]
    results: dict[str, Any] = {
        "workload": f"agent shape, pins at each tool call's start for a noisy tool estimate (sigma {args.estimate_sigma})"
        " + prefetch 2 s before it",
        "engine": "embedded, llama3-8b / h200, trace clock, predict (hints or not) and oracle",
        "sessions": sessions,
        "seeds": seeds,
        "cells": [],
    }
    for device, host, name, pause in cells:
        for seed in seeds:
            c = cell(device, host, pause, sessions, seed, args.hostile, args.estimate_sigma)
            c["pause"], c["seed"] = name, seed
            results["cells"].append(c)
    results["all_pass"] = all(c["summary"]["passes"] for c in results["cells"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
