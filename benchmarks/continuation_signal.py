"""How much a conversation-continuation predictor could know, measured on a trace (issue 13, 3).

    python benchmarks/continuation_signal.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \
        --limit 2000 --json out/continuation_signal.json

The predicted event: a request's tip (its last whole, block-aligned page) is the prefix of a later
request: its conversation (or agent session) comes back. The predictor "every tip returns" is scored
as a promotion policy would be: precision = tips that come back / tips predicted; coverage = returns
that were predicted / all returns (1.0 for "every tip"). The same with only the tips of requests that
were themselves a return of at least `k` earlier turns (turn >= k: the depth signal of the reuse
model), for k = 1..5, so a threshold can be read off. `gap_s` is the time from a request's arrival to
its return's arrival, at the trace's clock x `--time-scale`: what a promotion ahead of arrival has to
bridge. No engine: pure trace analysis (deterministic).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_hicache.replay import load_trace


def page_keys(ids: list[int], page_size: int, align: int) -> list[int]:
    """Chained keys of the whole pages of the first `len(ids) // align * align` tokens."""
    keys, key = [], 0
    end = len(ids) // align * align
    for i in range(0, end - end % page_size, page_size):
        key = hash((key, tuple(ids[i: i + page_size])))
        keys.append(key)
    return keys


def quantiles(xs: list[float], qs=(0.1, 0.5, 0.9)) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {f"p{int(q * 100)}": s[min(len(s) - 1, int(q * len(s)))] for q in qs}


def analyse(requests: list, page_size: int, align: int, time_scale: float, max_turn: int = 5) -> dict[str, Any]:
    """The figures of the module docstring for `requests` (in arrival order)."""
    seen: dict[int, int] = {}  # page key -> how many earlier requests' prompts held it
    tip_owner: dict[int, int] = {}  # tip key -> the latest request whose tip it is
    turn: list[int] = []  # 0 = not a return; n = the n-th return in its chain
    returned: list[bool] = []
    gaps: list[float] = []
    n_new_tip = 0
    returns = 0
    for idx, r in enumerate(requests):
        keys = page_keys(r.input_ids, page_size, align)
        parent = None
        for k in reversed(keys):  # the deepest earlier tip on this prompt's path
            if k in tip_owner:
                parent = tip_owner[k]
                break
        t = 0
        if parent is not None:
            returns += 1
            t = turn[parent] + 1
            if not returned[parent]:
                returned[parent] = True
                gaps.append((r.arrival_s - requests[parent].arrival_s) * time_scale)
        turn.append(t)
        returned.append(False)
        if keys and seen.get(keys[-1], 0) == 0:  # a tip of its own (not only a shared prefix)
            tip_owner[keys[-1]] = idx
            n_new_tip += 1
        else:
            returned[-1] = True  # nothing of its own to predict: not scored
            turn[-1] = -1
        for k in keys:
            seen[k] = seen.get(k, 0) + 1
    scored = [i for i in range(len(requests)) if turn[i] >= 0]
    back = [i for i in scored if returned[i]]
    by_turn = []
    for k in range(max_turn + 1):
        pred = [i for i in scored if turn[i] >= k]
        hit = [i for i in pred if returned[i]]
        by_turn.append({"min_turn": k, "predicted": len(pred), "precision": len(hit) / len(pred) if pred else None,
                        "coverage": len(hit) / len(back) if back else None})
    return {"requests": len(requests), "tips": len(scored), "returns": returns, "returned_tips": len(back),
            "return_share": returns / len(requests) if requests else 0.0, "gap_s": quantiles(gaps), "by_min_turn": by_turn}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--limit", type=int, default=2000, help="requests after --start")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--align", type=int, default=512, help="tips end at a multiple of this (the trace's hash block)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.page_size <= 0 or args.align <= 0 or args.align % args.page_size:
        ap.error("--align must be a positive multiple of --page-size")
    reqs = list(load_trace(args.trace, limit=args.start + args.limit))[args.start:]
    if not reqs:
        ap.error(f"no requests in {args.trace} after --start {args.start}")
    out = {"trace": str(args.trace), "start": args.start, "limit": args.limit, "page_size": args.page_size, "align": args.align,
           "time_scale": args.time_scale, **analyse(reqs, args.page_size, args.align, args.time_scale)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("requests", "tips", "returns", "return_share", "gap_s")}))
    for row in out["by_min_turn"]:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
