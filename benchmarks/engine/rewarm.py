"""Re-warm at start: TTFT of the first requests after a restart, with and without re-warm, against
the same requests on the server that never stopped.

    python -m benchmarks.engine.rewarm [--json benchmarks/results/rewarm.json] [--repeats 5]

The embedded engine (llama3-8b on one H200, real bytes through the real disk tier) serves phase A:
`--sessions` conversations, each a distinct `--prefix` -token system prompt and its first turns,
sized so that the host tier holds every prefix and the device only a few. Then one of three things
happens before phase B (each session's next turn, the first arriving `--gap` s after the start,
then one every `--spacing` s):

- `warm`: nothing (the same engine serves B: the reference "before the stop");
- `cold`: a restart with re-warm off: a new engine on the same disk directory (host empty);
- `rewarm`: the same restart with re-warm on (the record the stopped engine saved).

Each repeat draws other token ids and another session order in B (seed = repeat). Reports, per arm,
mean and p90 TTFT of phase B's first `--first` requests, the re-warm's gain over `cold` in mean
TTFT (the issue's target: >= 30 %), the worst per-request slowdown of `rewarm` against `cold` (the
target: no request slower by > 5 %), and what re-warm brought and what of it was used (tokens, and
bytes at the model's KV size: the bytes read never used).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

from sgl_hicache.replay.trace import Request
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig

MODEL, HARDWARE = "llama3-8b", "h200"
PAGE = 64


def sessions(n: int, prefix: int, turn: int, seed: int) -> list[list[int]]:
    """Each session's prefix token ids (distinct per session and per seed)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 120_000) for _ in range(prefix)] for _ in range(n)]


def phase_a(prefixes: list[list[int]], turn: int, turns: int) -> list[Request]:
    out = []
    t = 0.0
    for k in range(turns):
        for i, p in enumerate(prefixes):
            prompt = p + [7 + i + 1000 * k] * turn
            out.append(Request(f"a{i}.{k}", f"s{i}", t, array("q", prompt), 16, 0))
            t += 0.05
    return out


def phase_b(prefixes: list[list[int]], turn: int, gap: float, spacing: float, seed: int, start: float) -> list[Request]:
    order = list(range(len(prefixes)))
    random.Random(seed + 1).shuffle(order)
    return [
        Request(f"b{i}", f"s{i}", start + gap + j * spacing, array("q", prefixes[i] + [99_000 + i] * turn), 16, 0)
        for j, i in enumerate(order)
    ]


def config(args: argparse.Namespace, disk_dir: Path, rewarm: bool) -> EngineConfig:
    n, prefix = args.sessions, args.prefix
    return EngineConfig(
        policy="demote",
        model=get_model(MODEL),
        hardware=get_hardware(HARDWARE),
        device_tokens=args.device_sessions * (prefix + 4 * args.turn),
        host_tokens=n * (prefix + 4 * args.turn),
        disk_tokens=4 * n * (prefix + 4 * args.turn),
        page_size=PAGE,
        disk_dir=disk_dir,
        concurrency=None,
        rewarm=rewarm,
    )


def ttfts(engine: EmbeddedEngine, requests: list[Request]) -> dict[str, float]:
    """TTFT of `requests` by request id (records keep no ids: each B request has its own arrival)."""
    by_arrival = {round(r.arrival_s, 6): r.request_id for r in requests}
    return {by_arrival[k]: r.ttft_s for r in engine.records if (k := round(r.arrival_s, 6)) in by_arrival}


def one_repeat(args: argparse.Namespace, seed: int, root: Path) -> dict[str, Any]:
    prefixes = sessions(args.sessions, args.prefix, args.turn, seed)
    a = phase_a(prefixes, args.turn, args.turns)
    end_a = a[-1].arrival_s + 5.0
    disk = root / f"disk{seed}"
    # warm: A then B in one engine (B's arrivals after A's, with the same gap)
    warm_dir = root / f"warm{seed}"
    b_warm = phase_b(prefixes, args.turn, args.gap, args.spacing, seed, end_a)
    eng = EmbeddedEngine(config(args, warm_dir, rewarm=False))
    try:
        eng.run(a + b_warm)
        warm = ttfts(eng, sorted(b_warm, key=lambda r: r.arrival_s)[: args.first])
    finally:
        eng.close()
    # the stopped server: A alone, then a clean stop (the re-warm record is saved)
    eng = EmbeddedEngine(config(args, disk, rewarm=True))
    try:
        eng.run(a)
    finally:
        eng.close()
    b = phase_b(prefixes, args.turn, args.gap, args.spacing, seed, 0.0)
    first = sorted(b, key=lambda r: r.arrival_s)[: args.first]
    out: dict[str, Any] = {"seed": seed}
    for arm, on in (("cold", False), ("rewarm", True)):
        d = root / f"{arm}{seed}"
        shutil.copytree(disk, d)  # both restarts start from the same directory
        eng = EmbeddedEngine(config(args, d, rewarm=on))
        try:
            eng.run(b)
            out[arm] = ttfts(eng, first)
            pf = eng.cache.stats.snapshot()["prefetch"]["rewarm"]
            out[f"{arm}_rewarm_tokens"] = {k: pf[k] for k in ("promoted_tokens", "used_tokens", "wasted_tokens")}
            out[f"{arm}_hits"] = eng.cache.stats.snapshot()["hit_tokens"]
        finally:
            eng.close()
    out["warm"] = warm
    return out


def summarize(reps: list[dict[str, Any]], kv_bytes_per_token: int) -> dict[str, Any]:
    def mean(d: dict[str, float]) -> float:
        return statistics.fmean(d.values())

    gains = [1 - mean(r["rewarm"]) / mean(r["cold"]) for r in reps]
    worst = [max(r["rewarm"][k] / r["cold"][k] - 1 for k in r["cold"]) for r in reps]
    unused = [r["rewarm_rewarm_tokens"]["promoted_tokens"] - r["rewarm_rewarm_tokens"]["used_tokens"] for r in reps]

    def stat(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    return {
        "ttft_mean_s": {arm: stat([mean(r[arm]) for r in reps]) for arm in ("warm", "cold", "rewarm")},
        "rewarm_gain_vs_cold": stat(gains),
        "worst_request_slowdown_vs_cold": stat(worst),
        "rewarm_promoted_tokens": stat([r["rewarm_rewarm_tokens"]["promoted_tokens"] for r in reps]),
        "rewarm_used_tokens": stat([r["rewarm_rewarm_tokens"]["used_tokens"] for r in reps]),
        "rewarm_unused_bytes": stat([u * kv_bytes_per_token for u in unused]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--prefix", type=int, default=4096, help="tokens of each session's shared prefix")
    ap.add_argument("--turn", type=int, default=128, help="tokens of each turn's own suffix")
    ap.add_argument("--turns", type=int, default=2, help="phase A turns per session")
    ap.add_argument("--device-sessions", type=int, default=4, help="sessions the device tier holds")
    ap.add_argument("--first", type=int, default=16, help="phase B requests measured")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds from the start to phase B's first request")
    ap.add_argument("--spacing", type=float, default=0.25, help="seconds between phase B's requests")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/rewarm.json"))
    args = ap.parse_args(argv)
    reps = []
    with tempfile.TemporaryDirectory(prefix="sgl-hicache-rewarm-") as tmp:
        for seed in range(args.repeats):
            reps.append(one_repeat(args, seed, Path(tmp)))
    kv = get_model(MODEL).kv_bytes_per_token
    result = {
        "benchmark": "rewarm",
        "command": "python -m benchmarks.engine.rewarm " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": MODEL,
        "hardware": HARDWARE,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "summary": summarize(reps, kv),
        "repeats": reps,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    for arm in ("warm", "cold", "rewarm"):
        t = s["ttft_mean_s"][arm]
        print(f"{arm:7s} mean TTFT of the first {args.first}: {t['median']:.3f} s ({t['min']:.3f}-{t['max']:.3f})")
    g, w = s["rewarm_gain_vs_cold"], s["worst_request_slowdown_vs_cold"]
    print(f"re-warm gain vs cold: {100 * g['median']:.1f} % ({100 * g['min']:.1f}-{100 * g['max']:.1f})")
    print(f"worst request vs cold: {100 * w['median']:+.1f} % ({100 * w['min']:+.1f}-{100 * w['max']:+.1f})")
    print(f"unused re-warm bytes: {s['rewarm_unused_bytes']['median'] / 2**20:.0f} MiB (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
