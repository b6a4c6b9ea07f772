"""A second trace family: agentic tool-use sessions from BFCL's multi-turn data (a PyPI package).

    pip download --no-deps bfcl-eval==2026.3.23 -d /tmp/bfcl       # the wheel ships the data
    python -m benchmarks.agentic_trace --wheel /tmp/bfcl/bfcl_eval-2026.3.23-py3-none-any.whl --out agentic.jsonl

Source: `bfcl_eval/data/BFCL_v4_multi_turn_base.json` (200 sessions: user turns, the tool classes they
involve, the session's initial state) with `possible_answer/` (the ground-truth tool calls of each turn)
and `multi_turn_func_doc/` (the tools' JSON documentation) of the Berkeley Function Calling Leaderboard
package `bfcl-eval` (Apache-2.0). With `bfcl_eval` importable, `--wheel` may be left out.

Each session becomes a chain of agent steps, the way an agent framework calls an LLM: the prompt is the
system text with the documentation of the involved tool classes (shared by every session using the same
classes: fan-out below a shared prefix), the session's initial state, then the conversation so far;
one request per ground-truth tool call (output = the call), then one for the answer to the user. Tool
results are not in the data: a fixed stand-in line per call keeps the prefix deterministic. Timing: sessions
start as a Poisson process (`--session-rate` per second); agent steps follow each other after a tool
latency of `--tool-s` (uniform 0.5x-1.5x); user turns after a think time of `--think-s` (same spread).
Output is the project's plain JSONL (`docs/trace-formats.md`), text prompts, byte-level tokens by default.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import zipfile
from pathlib import Path

DOCS = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
SYSTEM = (
    "You are an agent that completes the user's tasks by calling the functions documented below, one call per step.\n"
)


def _reader(wheel: Path | None):
    if wheel is not None:
        z = zipfile.ZipFile(wheel)
        return lambda rel: z.read(f"bfcl_eval/data/{rel}").decode()
    try:
        from importlib.resources import files

        root = files("bfcl_eval") / "data"
    except ModuleNotFoundError:
        raise SystemExit(
            "bfcl_eval is not importable: pass --wheel (pip download --no-deps bfcl-eval==2026.3.23)"
        ) from None
    return lambda rel: (root / rel).read_text()


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def sessions(read) -> list[dict]:
    questions = _jsonl(read("BFCL_v4_multi_turn_base.json"))
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(read("possible_answer/BFCL_v4_multi_turn_base.json"))}
    docs = {cls: read(f"multi_turn_func_doc/{name}.json") for cls, name in DOCS.items()}
    out = []
    for q in questions:
        truth = answers.get(q["id"])
        if truth is None or len(truth) != len(q["question"]):
            continue
        system = SYSTEM + "".join(f"# {cls}\n{docs[cls]}\n" for cls in q["involved_classes"] if cls in docs)
        state = "Initial state: " + json.dumps(q.get("initial_config", {}), sort_keys=True) + "\n"
        turns = [
            (" ".join(m["content"] for m in turn if m.get("role") == "user"), calls)
            for turn, calls in zip(q["question"], truth)
        ]
        out.append({"id": q["id"], "prefix": system + state, "turns": turns})
    return out


def build(sess: list[dict], session_rate: float, tool_s: float, think_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows, t0 = [], 0.0
    for s in sess:
        t0 += rng.expovariate(session_rate)
        t, text = t0, s["prefix"]
        for k, (user, calls) in enumerate(s["turns"]):
            if k:
                t += think_s * rng.uniform(0.5, 1.5)
            text += f"User: {user}\n"
            for call in calls:
                rows.append(
                    {"session": s["id"], "prompt": text, "output_length": max(8, len(call)), "timestamp": round(t, 3)}
                )
                text += f"Call: {call}\nResult: ok ({call.split('(')[0]})\n"
                t += tool_s * rng.uniform(0.5, 1.5)
            rows.append({"session": s["id"], "prompt": text, "output_length": 64, "timestamp": round(t, 3)})
            text += "Assistant: done.\n"
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, help="the bfcl-eval wheel (default: the importable bfcl_eval package)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--session-rate", type=float, default=0.5, help="sessions started per second (Poisson)")
    ap.add_argument("--tool-s", type=float, default=2.0, help="mean tool latency between agent steps, seconds")
    ap.add_argument("--think-s", type=float, default=30.0, help="mean user think time between turns, seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sess = sessions(_reader(args.wheel))[: args.sessions]
    if not sess:
        raise SystemExit("no sessions found in the BFCL data")
    rows = build(sess, args.session_rate, args.tool_s, args.think_s, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"sessions": len(sess), "requests": len(rows), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
