"""Does the tree-walk predictor pay where it can, and stay silent where it cannot?

    PYTHONPATH=. python -m benchmarks.engine.prediction --json out/prediction_pays.json
    PYTHONPATH=. python -m benchmarks.engine.prediction --quick      # smaller shapes, no chat trace
    PYTHONPATH=. python -m benchmarks.engine.prediction --workloads silence --synth S.jsonl --agentic A.jsonl --json out/silence.json

Runs the embedded engine (virtual time: every figure is deterministic) with `prefetch`, `predict`
and `oracle` on:

- `chain`: cold restore with a probe (`replay/shapes.py`): a short request matches the head of a
  long session spilled to disk, `lead_s` before the request that needs the rest;
- `chain_hints`: the same chain, each probe carrying the client's hint that its session comes back
  (``prefetch`` by session: `policy/hints.py`), replayed through the controller;
- `branch`: sibling branches revisited, a probe on their shared document `lead_s` before;
- `agent`: tool-call pauses (`replay/shapes.py`): agents whose steps are separated by short and
  long tool calls, beside other users' one-shot traffic that pushes a paused session's KV to host
  and disk; target: the post-pause requests (``resume<k>``), also split by the pause before them
  (long: over `LONG_PAUSE_S`). The walk alone has nothing to walk to: the next step extends the
  session's tip;
- `agent_hints`: the same agents, each step followed by a tool call carrying the framework's
  ``prefetch`` of its prompt, run `lead_s` before the tool returns; `prefetch` and `predict` replay
  the hints, and the summary's share is of the hint-less `agent`'s oracle gain over its `prefetch`;
- `chat`: the shipped Mooncake conversation trace (first `--chat-limit` requests, the main job's
  settings: closed loop at concurrency 16, device 500k / host 2M / disk 16M tokens), where nothing
  lies below the match point and the predictor must stay silent;
- `silence`: `prefetch` against `predict` on every multi-turn chat family (`benchmarks/engine/retention.py`'s
  families and regime: the Mooncake slice from `--start`, `--synth`, `--agentic`; `--requests` each,
  total capacity `--capacities` x the family's working set split 1:2:8, trace clock x4): TTFT and
  bytes moved of `predict` over `prefetch`. Bar: at most 1.00x TTFT and +1 % bytes in every cell.

Per workload and policy: hit tokens per tier, TTFT mean (all requests, and the *target* requests:
the continuations of `chain`, the revisits of `branch`), bytes moved per link, and the predictor's
promoted / used / wasted tokens and precision. Speculative copies pay their link time, behind demand
loads and ahead of write-back (`transfer/executors.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE as CHAT_TRACE
from benchmarks.lib.slices import load_window, split_capacities, working_set_tokens
from sgl_hicache.replay import load_trace
from sgl_hicache.replay.shapes import agent, branch, chain, role_of
from sgl_hicache.replay.trace import Request
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig

POLICIES = ("prefetch", "predict", "oracle")
LONG_PAUSE_S = 10.0  # a post-pause request counts as after a long pause past this gap from its previous step


def pause_groups(requests: list[Request]) -> dict[str, str]:
    """``long pause`` / ``short pause`` per request id of the requests that follow an earlier one
    of their session (the gap from the previous arrival of the session, over or under `LONG_PAUSE_S`)."""
    last: dict[str, float] = {}
    out: dict[str, str] = {}
    for r in sorted(requests, key=lambda r: r.arrival_s):
        if r.session in last:
            out[r.request_id] = "long pause" if r.arrival_s - last[r.session] > LONG_PAUSE_S else "short pause"
        last[r.session] = r.arrival_s  # type: ignore[index]
    return out


def run(
    requests: list, config: EngineConfig, targets: set[str], groups: dict[str, str] | None = None
) -> dict[str, Any]:
    """One policy on one workload: the figures of the module docstring. `groups`: a label per
    request id; the targets' TTFT mean is also given per label."""
    if targets and len({r.arrival_s for r in requests}) != len(requests):
        raise ValueError("two requests arrive at the same instant: the records cannot tell their roles apart")
    engine = EmbeddedEngine(config)
    try:
        engine.run(requests)
        engine.cache.check()
        snap = engine.cache.snapshot()
        rec = engine.records
        by_arrival = {r.arrival_s * config.time_scale: r for r in requests} if targets else {}
        ttft = list(rec.ttft_s)
        hits = [
            (by_arrival[a], t)
            for a, t in zip(rec.arrival_s, rec.ttft_s)
            if a in by_arrival and any(role_of(by_arrival[a]).startswith(x) for x in targets)
        ]
        target = [t for _, t in hits]
        per_group: dict[str, list[float]] = {}
        for r, t in hits:
            if groups and r.request_id in groups:
                per_group.setdefault(groups[r.request_id], []).append(t)
        pred = snap["prefetch"].get("predict", {})
        return {
            "requests": len(rec),
            "hit_tokens": snap["hit_tokens"],
            "hit_tokens_total": sum(snap["hit_tokens"].values()),
            "ttft_mean_s": mean(ttft) if ttft else None,
            "target_requests": len(target),
            "target_ttft_mean_s": mean(target) if target else None,
            "target_groups": {k: {"requests": len(v), "ttft_mean_s": mean(v)} for k, v in sorted(per_group.items())},
            "hints": dict(engine.controller.hints.counts),
            "hints_rejected": engine.hints_rejected,
            "bytes_moved": snap["bytes_moved"],
            "bytes_moved_total": sum(snap["bytes_moved"].values()),
            "predictor": {k: pred.get(k) for k in ("promoted_tokens", "used_tokens", "wasted_tokens", "precision")},
            **engine.controller.speculation.counters(),
            "half_life_s": engine.cache.tree.half_life.value,
            "virtual_s": engine.now,
        }
    finally:
        engine.close()


def compare(
    name: str,
    requests: list,
    base: dict[str, Any],
    targets: set[str],
    policies: tuple[str, ...] = POLICIES,
    against: dict[str, Any] | None = None,
    groups: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`policies` on one workload, and the summary: `predict` against `prefetch` and its share of
    the oracle's gain over `prefetch`, the baseline and the oracle taken from `against` (another
    workload's results, e.g. the hint-less trace) when given, else from this one."""
    out: dict[str, Any] = {
        "requests": len(requests),
        "settings": {k: v for k, v in base.items() if k not in ("model", "hardware")},
    }
    for policy in policies:
        out[policy] = run(requests, EngineConfig(policy=policy, **base), targets, groups)
        r = out[policy]
        print(
            f"{name:7s} {policy:9s} hits {r['hit_tokens_total']:>10,}  ttft {r['ttft_mean_s']:.3f} s  "
            f"target ttft {r['target_ttft_mean_s'] if r['target_ttft_mean_s'] is None else round(r['target_ttft_mean_s'], 3)}  "
            f"bytes {r['bytes_moved_total'] / 2**30:.2f} GiB  predictor {r['predictor']}",
            flush=True,
        )
    ref = against if against is not None else out
    pf, pr, orc = ref["prefetch"], out["predict"], ref["oracle"]
    key = "target_ttft_mean_s" if targets else "ttft_mean_s"
    gain = pf[key] - orc[key]
    out["summary"] = {
        "ttft_ratio_predict_over_prefetch": pr[key] / pf[key],
        "share_of_oracle_gain": (pf[key] - pr[key]) / gain if gain > 0 else None,
        "bytes_ratio_predict_over_prefetch": pr["bytes_moved_total"] / pf["bytes_moved_total"]
        if pf["bytes_moved_total"]
        else None,
        "hit_tokens_predict_minus_prefetch": pr["hit_tokens_total"] - pf["hit_tokens_total"],
        "on": key,
        "baseline_and_oracle_from": "this workload" if against is None else "the workload without hints",
    }
    if groups:
        out["summary"]["share_of_oracle_gain_by_group"] = {
            g: (v["ttft_mean_s"] - pr["target_groups"][g]["ttft_mean_s"])
            / (v["ttft_mean_s"] - orc["target_groups"][g]["ttft_mean_s"])
            if v["ttft_mean_s"] > orc["target_groups"][g]["ttft_mean_s"]
            else None
            for g, v in pf["target_groups"].items()
        }
    print(f"{name:7s} summary {out['summary']}", flush=True)
    return out


def silence(
    families: dict[str, tuple[Path, int]],
    count: int,
    fractions: list[float],
    page_size: int = 256,
    host_deltas: tuple[int, ...] = (),
) -> dict[str, Any]:
    """`prefetch` against `predict` on chat families (path, first request) at capacity `fractions`
    of each family's working set (`retention.py`'s regime): TTFT and bytes ratios per cell.
    `host_deltas`: also `prefetch` with the host tier that many pages larger (or smaller), against
    `prefetch`: how far a change that small moves the cell (its noise floor)."""
    model, hw = get_model("llama3-8b"), get_hardware("h200")
    out: dict[str, Any] = {
        "regime": "retention.py's: device:host:disk = 1:2:8 of the fraction x working set, llama3-8b/h200, "
        "trace clock x4, open loop, --bytes metadata, lru",
        "cells": [],
        "skipped": [],
    }
    for fam, (path, start) in families.items():
        if not path.exists():
            out["skipped"].append(f"{fam}: {path} not found")
            continue
        requests = load_window(path, start, count)
        ws = working_set_tokens(requests, page_size)
        for frac in fractions:
            device, host, disk = split_capacities(requests, frac, ws, page_size)
            base = dict(
                model=model,
                hardware=hw,
                device_tokens=device,
                host_tokens=host,
                disk_tokens=disk,
                page_size=page_size,
                concurrency=None,
                time_scale=4.0,
                byte_mode="metadata",
            )
            cell: dict[str, Any] = {
                "family": fam,
                "trace": str(path),
                "start": start,
                "requests": len(requests),
                "working_set_tokens": ws,
                "capacity_fraction": frac,
                "device_tokens": device,
                "host_tokens": host,
                "disk_tokens": disk,
            }
            for policy in ("prefetch", "predict"):
                cell[policy] = run(requests, EngineConfig(policy=policy, **base), set())
            pf, pr = cell["prefetch"], cell["predict"]
            cell["ttft_ratio"] = pr["ttft_mean_s"] / pf["ttft_mean_s"]
            cell["bytes_ratio"] = pr["bytes_moved_total"] / pf["bytes_moved_total"] if pf["bytes_moved_total"] else 1.0
            cell["hit_tokens_diff"] = pr["hit_tokens_total"] - pf["hit_tokens_total"]
            cell["holds"] = cell["ttft_ratio"] <= 1.0 and cell["bytes_ratio"] <= 1.01
            cell["noise"] = {}
            for delta in host_deltas:
                moved = run(
                    requests,
                    EngineConfig(policy="prefetch", **{**base, "host_tokens": host + delta * page_size}),
                    set(),
                )
                cell["noise"][f"host{delta:+d} pages"] = {
                    "ttft_ratio": moved["ttft_mean_s"] / pf["ttft_mean_s"],
                    "bytes_ratio": moved["bytes_moved_total"] / pf["bytes_moved_total"]
                    if pf["bytes_moved_total"]
                    else 1.0,
                }
            print(
                f"silence {fam:9s} {frac:.1f}x WS  ttft {cell['ttft_ratio']:.5f}x  bytes {cell['bytes_ratio']:.5f}x  "
                f"hits {cell['hit_tokens_diff']:+,}  predictor {pr['predictor']}  holds {cell['holds']}"
                + "".join(
                    f"  [{k}: ttft {v['ttft_ratio']:.5f}x bytes {v['bytes_ratio']:.5f}x]"
                    for k, v in cell["noise"].items()
                ),
                flush=True,
            )
            out["cells"].append(cell)
    out["holds_everywhere"] = all(c["holds"] for c in out["cells"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and no chat trace (a smoke run)")
    ap.add_argument("--chat-trace", type=Path, default=CHAT_TRACE)
    ap.add_argument("--chat-limit", type=int, default=2000)
    ap.add_argument(
        "--workloads",
        default="chain,chain_hints,branch,agent,agent_hints,chat",
        help="comma-separated subset of chain, chain_hints, branch, agent, agent_hints, chat, silence",
    )
    ap.add_argument(
        "--lead", type=float, default=2.0, help="seconds from the probe (or the hint) to the request it announces"
    )
    ap.add_argument("--start", type=int, default=6000, help="silence: first request of the Mooncake slice")
    ap.add_argument("--requests", type=int, default=1000, help="silence: requests per family")
    ap.add_argument(
        "--synth",
        type=Path,
        default=Path("out/synth3000.jsonl"),
        help="silence: `sgl-hicache synth TRACE --requests 3000 --seed 1`",
    )
    ap.add_argument(
        "--agentic", type=Path, default=Path("out/agentic.jsonl"), help="silence: `benchmarks/agentic_trace.py` (BFCL)"
    )
    ap.add_argument(
        "--capacities", default="0.1,0.2,0.3", help="silence: capacity fractions of each family's working set"
    )
    ap.add_argument(
        "--families",
        default="mooncake,synth,agentic",
        help="silence: comma-separated subset of mooncake, synth, agentic",
    )
    ap.add_argument(
        "--noise",
        default="",
        help="silence: comma-separated host-tier changes in pages (e.g. 1,2,-1): each cell also runs "
        "`prefetch` with its host tier so changed, against `prefetch` (the cell's noise floor)",
    )
    args = ap.parse_args(argv)
    wanted = set(args.workloads.split(","))
    unknown = wanted - {"chain", "chain_hints", "branch", "agent", "agent_hints", "chat", "silence"}
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}")
    model, hw = get_model("llama3-8b"), get_hardware("h200")
    n = 12 if args.quick else 24
    turn = 2048 if args.quick else 4096
    # small tiers, so that a session's history spills to disk before it comes back
    shape = dict(
        model=model,
        hardware=hw,
        device_tokens=16_384 if args.quick else 65_536,
        host_tokens=32_768 if args.quick else 131_072,
        disk_tokens=4_000_000,
        concurrency=None,
        byte_mode="metadata",
    )
    result: dict[str, Any] = {
        "benchmark": "prediction_pays",
        "quick": args.quick,
        "model": model.name,
        "hardware": hw.name,
        "lead_s": args.lead,
    }
    if "chain" in wanted:
        result["chain"] = compare("chain", chain(sessions=n, turn_tokens=turn, lead_s=args.lead), shape, {"cont"})
    if "chain_hints" in wanted:  # the same chain, each probe carrying the client's prefetch hint
        result["chain_hints"] = compare(
            "chain+h", chain(sessions=n, turn_tokens=turn, lead_s=args.lead, hints=True), shape, {"cont"}
        )
    if "branch" in wanted:
        result["branch"] = compare(
            "branch", branch(sessions=n, doc_tokens=turn, branch_tokens=turn // 2, lead_s=args.lead), shape, {"revisit"}
        )
    if wanted & {"agent", "agent_hints"}:
        sessions = 12 if args.quick else 24
        plain = agent(sessions=sessions, lead_s=args.lead)
        groups = pause_groups(plain)
        # the chain's full-size tiers (a step's prompt reaches 18k tokens), quick or not
        shape = dict(shape, device_tokens=65_536, host_tokens=131_072)
        result["agent"] = compare("agent", plain, shape, {"resume"}, groups=groups)
        if "agent_hints" in wanted:
            result["agent_hints"] = compare(
                "agent+h",
                agent(sessions=sessions, lead_s=args.lead, hints=True),
                shape,
                {"resume"},
                ("prefetch", "predict"),
                against=result["agent"],
                groups=groups,
            )
    if "chat" in wanted and not args.quick:
        chat = list(load_trace(args.chat_trace, limit=args.chat_limit))
        base = dict(
            model=model,
            hardware=hw,
            device_tokens=500_000,
            host_tokens=2_000_000,
            disk_tokens=16_000_000,
            concurrency=16,
            byte_mode="metadata",
        )
        result["chat"] = compare("chat", chat, base, set())
    if "silence" in wanted:
        sources = {"mooncake": (args.chat_trace, args.start), "synth": (args.synth, 0), "agentic": (args.agentic, 0)}
        names = args.families.split(",")
        if set(names) - set(sources):
            ap.error(f"unknown families {sorted(set(names) - set(sources))}; choose from {', '.join(sources)}")
        families = {n: sources[n] for n in names}
        try:
            deltas = tuple(int(x) for x in args.noise.split(",") if x.strip())
        except ValueError:
            ap.error(f"--noise: not a comma-separated list of page counts: {args.noise!r}")
        result["silence"] = silence(
            families,
            60 if args.quick else args.requests,
            [0.3] if args.quick else [float(x) for x in args.capacities.split(",")],
            host_deltas=deltas,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
