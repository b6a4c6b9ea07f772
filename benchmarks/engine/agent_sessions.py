"""Do an agent framework's hints pay on real coding-agent sessions, and never harm?

    python -m benchmarks.engine.agent_sessions SESSIONS --json agent_sessions.json
    python -m benchmarks.engine.agent_sessions tests/data/agent_sessions_excerpt --quick --json /tmp/a.json

SESSIONS is a kv-cache-tester session file or a folder of them (the recorded Claude Code sessions,
`replay/agent_sessions.py`). Each cell replays the same calls three ways on the embedded engine
(virtual time, deterministic; llama3-8b on the H200 cost model; the sessions' own clock; the
replayer's default page of 256 tokens and a 16M-token disk tier): `predict`
(the shipped policy) without hints, `predict` with the hints a framework would send (a tool-call
hint on each call that stops on `tool_use`, its duration the real gap off by a uniform error of
+-`--estimate-error`, one draw per `--seeds` entry; an end hint on each session's last call), and
`oracle` (Belady eviction and perfect prefetch) without hints. Grid: device / host tier sizes x gap
caps (a longer pause between a call's end and the next call is cut to the cap). Contexts are scaled
by `--block-scale` tokens per 64-token block; sessions start `--session-spread` seconds apart in all.

Per cell: mean and p99 TTFT of every call and of the calls after a tool, after a person and
first calls; hints against no hints (`mean_ratio`, `p99_ratio`: median and range over the seeds);
the oracle's gain over no hints and the share of it the hints take (`share_of_oracle_gain`, only
where the oracle gains at least 10 %); and `learned`: no hints, with the server's own retentions
from each conversation's past pauses (`learn_returns`), against no hints (`learned_mean_ratio`,
`learned_p99_ratio`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

from benchmarks.lib.engine_runs import agent_engine, percentile
from sgl_hicache.records import PRECEDED_BY
from sgl_hicache.replay.agent_sessions import read_agent_sessions

CELLS = ((100_000, 200_000), (120_000, 1_200_000), (200_000, 400_000))  # (device, host) tokens
GAP_CAPS = (600.0, 120.0)


def figures(ttft: list[float]) -> dict[str, float]:
    return {"mean_s": mean(ttft), "p99_s": percentile(ttft, 0.99), "requests": len(ttft)}


def run(requests: list, policy: str, device: int, host: int, learn_returns: bool = False) -> dict[str, Any]:
    """One policy over the calls: TTFT overall and by what preceded each call."""
    engine = agent_engine(policy, device, host, disk=16_000_000, learn_returns=learn_returns)
    started = time.process_time()
    try:
        engine.run(requests)
        engine.cache.check()
        rec = engine.records
        ttft = list(rec.ttft_s)
        out: dict[str, Any] = {"all": figures(ttft)}
        for i, kind in enumerate(PRECEDED_BY):
            xs = [t for t, k in zip(ttft, rec.preceded) if k == i]
            if xs:
                out[kind] = figures(xs)
        out["hints"] = engine.controller.hints.summary()
        out["cpu_s"] = time.process_time() - started
        return out
    finally:
        engine.close()


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": median(xs), "min": min(xs), "max": max(xs)}


def cell(path: Path, device: int, host: int, gap_cap: float, args: argparse.Namespace) -> dict[str, Any]:
    """One grid cell: no hints, the oracle and the learned run once, hints once per seed; the ratios."""

    def read(hints: bool, seed: int = 0) -> list:
        return read_agent_sessions(
            path,
            block_scale=args.block_scale,
            gap_cap_s=gap_cap,
            session_spread_s=args.session_spread,
            hints=hints,
            hint_estimate_error=args.estimate_error,
            hint_seed=seed,
        )

    plain = read(False)
    out: dict[str, Any] = {"device_tokens": device, "host_tokens": host, "gap_cap_s": gap_cap}
    out["no_hints"] = run(plain, "predict", device, host)
    out["oracle"] = run(plain, "oracle", device, host)
    out["hints"] = {str(s): run(read(True, s), "predict", device, host) for s in args.seeds}
    out["learned"] = run(plain, "predict", device, host, learn_returns=True)
    base, orc = out["no_hints"]["all"], out["oracle"]["all"]
    gain = (base["mean_s"] - orc["mean_s"]) / base["mean_s"]
    means = [h["all"]["mean_s"] / base["mean_s"] for h in out["hints"].values()]
    p99s = [h["all"]["p99_s"] / base["p99_s"] for h in out["hints"].values()]
    shares = [(1 - m) / gain for m in means] if gain >= 0.10 else None
    out["summary"] = {
        "mean_ratio": spread(means),
        "p99_ratio": spread(p99s),
        "oracle_gain": gain,
        "share_of_oracle_gain": spread(shares) if shares else None,
        "learned_mean_ratio": out["learned"]["all"]["mean_s"] / base["mean_s"],
        "learned_p99_ratio": out["learned"]["all"]["p99_s"] / base["p99_s"],
    }
    s = out["summary"]
    print(
        f"device {device:>8,} host {host:>9,} cap {gap_cap:>5.0f} s: mean {base['mean_s']:.4f} s, hints x"
        f"{s['mean_ratio']['median']:.3f} ({s['mean_ratio']['min']:.3f}-{s['mean_ratio']['max']:.3f}), "
        f"p99 x{s['p99_ratio']['median']:.3f} ({s['p99_ratio']['min']:.3f}-{s['p99_ratio']['max']:.3f}), "
        f"oracle gain {gain:.1%}"
        + (f", share {s['share_of_oracle_gain']['median']:.2f}" if shares else "")
        + f"; learned (no hints) x{s['learned_mean_ratio']:.3f}, p99 x{s['learned_p99_ratio']:.3f}",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sessions", type=Path, help="a kv-cache-tester session file or a folder of them")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="one small cell, one seed (a smoke run)")
    ap.add_argument("--block-scale", type=int, default=8, help="tokens per 64-token block (default 8)")
    ap.add_argument("--session-spread", type=float, default=3600.0, help="seconds the session starts span")
    ap.add_argument("--estimate-error", type=float, default=0.5, help="the tool-duration estimate's error")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the estimate errors")
    args = ap.parse_args(argv)
    if not args.sessions.exists():
        ap.error(f"{args.sessions} does not exist")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    cells = [(d, h, g) for g in GAP_CAPS for d, h in CELLS]
    if args.quick:
        cells, args.seeds = [(20_000, 40_000, 600.0)], args.seeds[:1]
    results = [cell(args.sessions, d, h, g, args) for d, h, g in cells]
    doc = {
        "benchmark": "agent_sessions",
        "sessions": str(args.sessions),
        "block_scale": args.block_scale,
        "session_spread_s": args.session_spread,
        "estimate_error": args.estimate_error,
        "seeds": args.seeds,
        "cells": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
