"""What separates the pages that come back (issue 25): per request of a Mooncake-style trace, whether
its first new block is used again, after how long, by what an online model could see at insert.

    python benchmarks/return_features.py [--trace T] [--requests 6000]

Reads requests 0..N-1 (the training slice; `benchmarks/retention.py` holds out 6,000-6,999). A
session is the chain of requests that extend an earlier request's blocks (beyond the shared first
one). For each request with new blocks it records: turn in its session, the session's previous
inter-turn gap, prompt and output length, number of new blocks, and the trace time until another
request uses its first new block (none = never). Prints P(return) and gap quantiles per class, the
hazard by idle time, and a fluid bound (`fluid_bound`): with `c` seconds of page-time per token
(capacity fraction x slice duration), LRU keeps returns within c; a policy that cannot tell which
requests return keeps a fraction f of them for c/f at best (max over f of f * F(c/f)); one that knows
each request's new-block class (the one feature that separates) splits the budget over the classes;
Belady keeps the returns with the shortest gaps until the budget is spent. Token-weighted, per request,
an approximation (a returning session hits its whole prompt; ancestors shared between turns are
counted once per turn).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics as st
from collections import defaultdict
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def records(rows: list[dict]) -> list[dict]:
    owner: dict[tuple, int] = {}  # every prefix (>= 2 blocks) -> the last request holding it
    sess_of: list[int] = []
    last_t: dict[int, float] = {}
    turns: dict[int, int] = defaultdict(int)
    users: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        for b in r["hash_ids"]:
            users[b].append(i)
    seen: set[int] = set()
    out = []
    for i, r in enumerate(rows):
        h = tuple(r["hash_ids"])
        t = r["timestamp"] / 1000
        prev = next((owner[h[:k]] for k in range(len(h), 1, -1) if h[:k] in owner), None)
        s = len(last_t) + i if prev is None else sess_of[prev]  # a fresh id, or the earlier request's session
        sess_of.append(s)
        for k in range(2, len(h) + 1):
            owner[h[:k]] = i
        gap = t - last_t[s] if s in last_t else None
        turns[s] += 1
        last_t[s] = t
        new = [b for b in h if b not in seen]
        seen.update(h)
        if not new:
            continue
        later = [j for j in users[new[0]] if j > i]
        nxt = rows[later[0]]["timestamp"] / 1000 - t if later else None
        out.append({"turn": turns[s], "prev_gap": gap, "input": r["input_length"], "output": r["output_length"],
                    "new_blocks": len(new), "next_use_s": nxt})
    return out


def summary(sel: list[dict], name: str) -> str:
    g = sorted(x["next_use_s"] for x in sel if x["next_use_s"] is not None)
    if not sel:
        return f"{name:24s} n=0"
    q = (lambda p: g[int(p * (len(g) - 1))]) if g else (lambda p: 0)
    return f"{name:40s} n={len(sel):5d} P(return)={len(g) / len(sel):.2f} gap p25/p50/p90 = {q(.25):.0f}/{q(.5):.0f}/{q(.9):.0f} s"


def _caught(pts: list[tuple[float, int]], t: float) -> int:
    return sum(w for g, w in pts if g <= t)


def _blind(pts: list[tuple[float, int]], total: int, budget: float) -> float:
    """Most tokens caught by keeping a fraction f of a class (unable to tell its members apart) for
    budget / (f * total) seconds each, over f."""
    if budget <= 0 or total == 0:
        return 0.0
    return max(f * _caught(pts, budget / (f * total)) for f in (i / 50 for i in range(1, 51)))


def fluid_bound(res: list[dict], c: float, frac: float) -> str:
    """Token-weighted (a request's prompt is what its return hits and what keeping it costs): with
    c seconds of page-time per token, LRU catches returns within c; a blind policy max over f of
    f * F(c / f); a class-aware one splits the budget over the new-block classes (1 / 2-4 / 5+),
    blind within each; Belady keeps the shortest gaps until the budget is spent."""
    total = sum(x["input"] for x in res)
    budget = c * total
    groups = {"1": lambda x: x["new_blocks"] == 1, "2-4": lambda x: 2 <= x["new_blocks"] <= 4,
              "5+": lambda x: x["new_blocks"] >= 5}
    curves = []
    for pred in groups.values():
        sel = [x for x in res if pred(x)]
        curves.append((sorted((x["next_use_s"], x["input"]) for x in sel if x["next_use_s"] is not None),
                       sum(x["input"] for x in sel)))
    pts = sorted((x["next_use_s"], x["input"]) for x in res if x["next_use_s"] is not None)
    lru = _caught(pts, c) / total
    blind = _blind(pts, total, budget) / total
    aware = max(sum(_blind(p, t, s * budget) for (p, t), s in zip(curves, (i / 10, j / 10, (10 - i - j) / 10)))
                for i in range(11) for j in range(11 - i)) / total
    used = kept = 0.0
    for g, w in pts:
        if used + g * w > budget:
            break
        used, kept = used + g * w, kept + w
    bel = kept / total
    return (f"  {frac}x WS (c = {c:.0f} s): LRU {lru:.3f}, blind {blind:.3f}, class-aware {aware:.3f}, Belady {bel:.3f}; "
            f"share of Belady's gain: blind {(blind - lru) / (bel - lru):.2f}, class-aware {(aware - lru) / (bel - lru):.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=6000)
    a = ap.parse_args()
    rows = [json.loads(line) for _, line in zip(range(a.requests), a.trace.open())]
    res = records(rows)
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    print(summary(res, "all"))
    classes = {
        "turn 1": lambda x: x["turn"] == 1, "turn 2": lambda x: x["turn"] == 2, "turn 3": lambda x: x["turn"] == 3,
        "turn >= 4": lambda x: x["turn"] >= 4,
        "turn >= 2 (a hit beyond the first block)": lambda x: x["turn"] >= 2,
        "prev gap < 60 s": lambda x: x["prev_gap"] is not None and x["prev_gap"] < 60,
        "prev gap 60-300 s": lambda x: x["prev_gap"] is not None and 60 <= x["prev_gap"] < 300,
        "prev gap >= 300 s": lambda x: x["prev_gap"] is not None and x["prev_gap"] >= 300,
        "prompt < 2k": lambda x: x["input"] < 2000, "prompt 2k-8k": lambda x: 2000 <= x["input"] < 8000,
        "prompt 8k-20k": lambda x: 8000 <= x["input"] < 20000, "prompt >= 20k": lambda x: x["input"] >= 20000,
        "output < 50": lambda x: x["output"] < 50, "output 50-300": lambda x: 50 <= x["output"] < 300,
        "output >= 300": lambda x: x["output"] >= 300,
        "new blocks 1": lambda x: x["new_blocks"] == 1, "new blocks 2-4": lambda x: 2 <= x["new_blocks"] <= 4,
        "new blocks 5-16": lambda x: 5 <= x["new_blocks"] <= 16, "new blocks >= 17": lambda x: x["new_blocks"] >= 17,
    }
    for name, pred in classes.items():
        print(summary([x for x in res if pred(x)], name))
    pairs = [(math.log1p(x["prev_gap"]), math.log1p(x["next_use_s"])) for x in res
             if x["prev_gap"] is not None and x["next_use_s"] is not None]
    print(f"correlation of log(previous gap), log(next gap): {st.correlation(*zip(*pairs)):.2f} over {len(pairs)} requests")
    n = len(res)
    for t in (10, 30, 60, 120, 240, 480, 960):
        alive = [x for x in (x["next_use_s"] for x in res) if x is None or x >= t]
        back = sum(1 for x in alive if x is not None and x < 2 * t)
        print(f"idle {t:4d} s: not yet back {len(alive) / n:.2f}, back within [t, 2t) {back / len(alive):.3f}")

    print(f"fluid bound (slice of {a.requests} requests spans {span:.0f} s; 1,000 requests ~ {1000 * span / a.requests:.0f} s):")
    for frac in (0.1, 0.2, 0.3):
        print(fluid_bound(res, frac * 1000 * span / a.requests, frac))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
