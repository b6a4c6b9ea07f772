"""Does the tree-walk predictor pay where it can, and stay silent where it cannot? (issue 24)

    PYTHONPATH=. python benchmarks/prediction_pays.py --json out/prediction_pays.json
    PYTHONPATH=. python benchmarks/prediction_pays.py --quick      # smaller shapes, no chat trace

Runs the embedded engine (virtual time: every figure is deterministic) with `prefetch`, `predict`
and `oracle` on:

- `chain`: cold restore with a probe (`replay/shapes.py`): a short request matches the head of a
  long session spilled to disk, `lead_s` before the request that needs the rest;
- `chain_hints`: the same chain, each probe carrying the client's hint that its session comes back
  (``prefetch`` by session: `policy/hints.py`), replayed through the controller;
- `branch`: sibling branches revisited, a probe on their shared document `lead_s` before;
- `chat`: the shipped Mooncake conversation trace (first `--chat-limit` requests, the main job's
  settings: closed loop at concurrency 16, device 500k / host 2M / disk 16M tokens), where nothing
  lies below the match point and the predictor must stay silent.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_hicache.engine.presets import get_hardware, get_model  # noqa: E402
from sgl_hicache.engine.simulator import EmbeddedEngine, EngineConfig  # noqa: E402
from sgl_hicache.replay import load_trace  # noqa: E402
from sgl_hicache.replay.shapes import branch, chain, role_of  # noqa: E402

POLICIES = ("prefetch", "predict", "oracle")
CHAT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def run(requests: list, config: EngineConfig, targets: set[str]) -> dict[str, Any]:
    """One policy on one workload: the figures of the module docstring."""
    engine = EmbeddedEngine(config)
    try:
        engine.run(requests)
        engine.cache.check()
        snap = engine.cache.snapshot()
        rec = engine.records
        role = {r.arrival_s * config.time_scale: role_of(r) for r in requests} if targets else {}
        ttft = list(rec.ttft_s)
        target = [t for a, t in zip(rec.arrival_s, rec.ttft_s) if any(role.get(a, "").startswith(x) for x in targets)]
        pred = snap["prefetch"].get("predict", {})
        return {
            "requests": len(rec),
            "hit_tokens": snap["hit_tokens"],
            "hit_tokens_total": sum(snap["hit_tokens"].values()),
            "ttft_mean_s": mean(ttft) if ttft else None,
            "target_requests": len(target),
            "target_ttft_mean_s": mean(target) if target else None,
            "bytes_moved": snap["bytes_moved"],
            "bytes_moved_total": sum(snap["bytes_moved"].values()),
            "predictor": {k: pred.get(k) for k in ("promoted_tokens", "used_tokens", "wasted_tokens", "precision")},
            "guard_stopped": engine.controller.guard.stopped,
            "half_life_s": engine.cache.tree.half_life.value,
            "virtual_s": engine.now,
        }
    finally:
        engine.close()


def compare(name: str, requests: list, base: dict[str, Any], targets: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(requests), "settings": {k: v for k, v in base.items() if k not in ("model", "hardware")}}
    for policy in POLICIES:
        out[policy] = run(requests, EngineConfig(policy=policy, **base), targets)
        r = out[policy]
        print(f"{name:7s} {policy:9s} hits {r['hit_tokens_total']:>10,}  ttft {r['ttft_mean_s']:.3f} s  "
              f"target ttft {r['target_ttft_mean_s'] if r['target_ttft_mean_s'] is None else round(r['target_ttft_mean_s'], 3)}  "
              f"bytes {r['bytes_moved_total'] / 2**30:.2f} GiB  predictor {r['predictor']}", flush=True)
    pf, pr, orc = out["prefetch"], out["predict"], out["oracle"]
    key = "target_ttft_mean_s" if targets else "ttft_mean_s"
    gain = pf[key] - orc[key]
    out["summary"] = {
        "ttft_ratio_predict_over_prefetch": pr[key] / pf[key],
        "share_of_oracle_gain": (pf[key] - pr[key]) / gain if gain > 0 else None,
        "bytes_ratio_predict_over_prefetch": pr["bytes_moved_total"] / pf["bytes_moved_total"] if pf["bytes_moved_total"] else None,
        "hit_tokens_predict_minus_prefetch": pr["hit_tokens_total"] - pf["hit_tokens_total"],
        "on": key,
    }
    print(f"{name:7s} summary {out['summary']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and no chat trace (a smoke run)")
    ap.add_argument("--chat-trace", type=Path, default=CHAT_TRACE)
    ap.add_argument("--chat-limit", type=int, default=2000)
    ap.add_argument("--workloads", default="chain,chain_hints,branch,chat",
                    help="comma-separated subset of chain, chain_hints, branch, chat")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds from the probe to the request it announces")
    args = ap.parse_args(argv)
    model, hw = get_model("llama3-8b"), get_hardware("h200")
    n = 12 if args.quick else 24
    turn = 2048 if args.quick else 4096
    # small tiers, so that a session's history spills to disk before it comes back
    shape = dict(model=model, hardware=hw, device_tokens=16_384 if args.quick else 65_536,
                 host_tokens=32_768 if args.quick else 131_072, disk_tokens=4_000_000, concurrency=None, byte_mode="metadata")
    result: dict[str, Any] = {"benchmark": "prediction_pays", "quick": args.quick, "model": model.name, "hardware": hw.name,
                              "lead_s": args.lead}
    wanted = set(args.workloads.split(","))
    if "chain" in wanted:
        result["chain"] = compare("chain", chain(sessions=n, turn_tokens=turn, lead_s=args.lead), shape, {"cont"})
    if "chain_hints" in wanted:  # the same chain, each probe carrying the client's prefetch hint
        result["chain_hints"] = compare("chain+h", chain(sessions=n, turn_tokens=turn, lead_s=args.lead, hints=True), shape, {"cont"})
    if "branch" in wanted:
        result["branch"] = compare("branch", branch(sessions=n, doc_tokens=turn, branch_tokens=turn // 2, lead_s=args.lead), shape, {"revisit"})
    if "chat" in wanted and not args.quick:
        chat = list(load_trace(args.chat_trace, limit=args.chat_limit))
        base = dict(model=model, hardware=hw, device_tokens=500_000, host_tokens=2_000_000, disk_tokens=16_000_000,
                    concurrency=16, byte_mode="metadata")
        result["chat"] = compare("chat", chat, base, set())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
