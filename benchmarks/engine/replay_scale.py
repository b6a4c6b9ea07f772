"""Replay at scale: wall time, requests/s and max RSS of `sgl-hicache replay` against trace length,
in both byte modes, and `--compare` in parallel processes against one after another.

    .venv/bin/python -m benchmarks.engine.replay_scale --lengths 2000,10000,30000 --json replay_scale.json --plot replay_scale.png
    .venv/bin/python -m benchmarks.engine.replay_scale --quick --json replay_scale.json     # seconds (the smoke size)
    .venv/bin/python -m benchmarks.engine.replay_scale --lengths 2000,10000 --long-requests 1000000 --json long.json --plot long.png

Each length N is a trace of N requests grown from the shipped trace by `sgl-hicache synth` (seed 0;
the shipped trace's session lengths, gaps and prefix sharing), replayed by the real command line in
a fresh process: `sgl-hicache replay SYN --policy predict --bytes MODE --quiet --report R`
(defaults otherwise: llama3-8b on one H200 by the cost model, device 500k / host 2M / disk 16M
tokens, page 256, concurrency 16). Per run: wall seconds of the process (interpreter and imports
included), its CPU seconds (user + sys, from `wait4`: a shared machine's other users do not count),
the engine's own `cpu_s`, max RSS (`wait4`'s ru_maxrss), and the hit figures (which must be equal
across modes). Modes are interleaved per length (metadata, real, metadata, real ...) over `--repeats`
rounds; medians. requests/s = N / engine CPU seconds (and N / wall).

`--source-requests N` also replays the first N requests of the source trace itself (not synthesised;
a point with `"trace": "source"`), in the same interleaving and with the same `--baseline`.

`--compare-requests M` also times `replay --compare` on the first M requests of the shipped trace
with `--workers 2` against `--workers 1` (interleaved, medians): the parallel/sequential wall ratio.

`--long-requests N` also replays one trace of N synthesised requests (metadata mode, one policy:
`replay`'s default) with `--checkpoint-every K` (`--long-checkpoint`) and records, at every checkpoint
the run writes, the requests done, the engine's CPU and wall seconds (from the partial report) and the
process's RSS and high-water mark (`/proc/PID/status`): time and RSS against trace length from one
run. `--long-limit` stops it at that many requests (`--limit`); the trend so far is kept either way.

`--baseline DIR` also runs every replay point with another checkout's package (DIR on PYTHONPATH,
e.g. `/work/main`), interleaved with this tree's runs (this, baseline, this, baseline ...), and
reports `speed_over_baseline` = baseline engine CPU / this engine CPU (medians) and whether the hit
figures are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE as TRACE
from benchmarks.lib.paths import REPO


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "sgl_hicache.cli", *args]


def _run(cmd: list[str], repo: Path = REPO) -> dict[str, Any]:
    """Run `cmd` with `repo`'s package; wall, CPU and max RSS of that one process (wait4, not the children total)."""
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    # cwd = repo: `python -m` puts the working directory ahead of PYTHONPATH, so a baseline run
    # started from this tree would import this tree's package
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=repo)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_mb": usage.ru_maxrss / 1024}


def replay_point(trace: Path, n: int, mode: str, work: Path, repo: Path = REPO) -> dict[str, Any]:
    report = work / f"r-{n}-{mode}.json"
    out = _run(
        _cli(
            "replay",
            str(trace),
            "--limit",
            str(n),
            "--policy",
            "predict",
            "--bytes",
            mode,
            "--quiet",
            "--report",
            str(report),
        ),
        repo,
    )
    rep = json.loads(report.read_text())["policies"]["predict"]
    out.update(
        engine_cpu_s=rep["engine"]["cpu_s"],
        engine_wall_s=rep["engine"]["wall_s"],
        hit_tokens=rep["hit_tokens"],
        ttft_mean_s=rep["ttft_s"]["mean"],
        virtual_s=rep["engine"]["virtual_s"],
        requests=rep["requests"],
    )
    return out


def _proc_mb(pid: int, field: str) -> float | None:
    """A `/proc/PID/status` memory field (VmRSS, VmHWM) in MB, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def long_run(trace: Path, work: Path, every: int, limit: int | None = None, poll_s: float = 2.0) -> dict[str, Any]:
    """One metadata replay of `trace` (replay's default policy) with checkpoints every `every`
    requests: a row per checkpoint (requests done, engine CPU / wall seconds, RSS and its high-water
    mark), then the process's wall, CPU and max RSS and the final report's engine figures."""
    report = work / "long.json"
    cmd = _cli(
        "replay",
        str(trace),
        "--bytes",
        "metadata",
        "--quiet",
        "--report",
        str(report),
        "--checkpoint-every",
        str(every),
    )
    if limit:
        cmd += ["--limit", str(limit)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    rows: list[dict[str, Any]] = []
    seen = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:  # ended: its own CPU and max RSS (wait4), not the children total
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        partial = next(work.glob("long.json.*.partial.json"), None)
        stamp = partial.stat().st_mtime_ns if partial is not None and partial.exists() else None
        if stamp is not None and stamp != seen:
            try:
                data = json.loads(partial.read_text())  # type: ignore[union-attr]
            except (OSError, ValueError):
                data = None  # replaced while read: the next poll reads it
            if data is not None:
                seen = stamp
                rep = next(iter(data["policies"].values()))
                rows.append(
                    {
                        "requests_done": data["partial"]["requests_done"],
                        "engine_cpu_s": rep["engine"]["cpu_s"],
                        "engine_wall_s": rep["engine"]["wall_s"],
                        "rss_mb": _proc_mb(proc.pid, "VmRSS"),
                        "rss_hwm_mb": _proc_mb(proc.pid, "VmHWM"),
                        "load_avg": os.getloadavg()[0],
                    }
                )
                print(f"long: {rows[-1]}", file=sys.stderr)
        time.sleep(poll_s)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    out: dict[str, Any] = {
        "every": every,
        "limit": limit,
        "checkpoints": rows,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_mb": usage.ru_maxrss / 1024,
    }
    if report.exists():
        rep = next(iter(json.loads(report.read_text())["policies"].values()))
        out.update(requests=rep["requests"], engine=rep["engine"], hit_tokens=rep["hit_tokens"])
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2000,10000,30000", help="trace lengths (requests), comma separated")
    ap.add_argument("--modes", default="metadata,real")
    ap.add_argument("--real-max", type=int, default=10**9, help="skip real-bytes runs above this length")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--compare-requests", type=int, default=0, help="also time --compare on this many requests (0: skip)"
    )
    ap.add_argument("--source", type=Path, default=TRACE)
    ap.add_argument(
        "--source-requests",
        type=int,
        default=0,
        help="also replay the first N requests of --source itself (not synthesised), as a point with trace 'source'",
    )
    ap.add_argument(
        "--baseline", type=Path, help="another checkout (its root holds sgl_hicache/) run interleaved on every point"
    )
    ap.add_argument(
        "--long-requests",
        type=int,
        default=0,
        help="also one metadata replay of this many synthesised requests, "
        "with checkpoints: time and RSS against requests done (0: skip)",
    )
    ap.add_argument(
        "--long-checkpoint", type=int, default=100000, help="checkpoint every this many requests of the long run"
    )
    ap.add_argument(
        "--long-limit", type=int, default=0, help="stop the long run at this many requests (0: the whole trace)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke size: 60 requests, both modes, compare on 20")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    args.source = args.source.resolve()  # the runs start in the repo they import (see `_run`)
    if args.quick:
        args.lengths, args.compare_requests, args.repeats = "60", 20, 1
        args.long_requests, args.long_checkpoint = 60, 20
    lengths = [int(float(x)) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_start": os.getloadavg()},
        "regime": "policy predict, llama3-8b / h200 cost model, device 500k / host 2M / disk 16M tokens, "
        "page 256, concurrency 16; traces grown from the shipped trace by `sgl-hicache synth` (seed 0)",
        "points": [],
    }
    with tempfile.TemporaryDirectory(prefix="replay-scale-") as tmp:
        work = Path(tmp)
        points: list[tuple[str, int, Path | None]] = [("synth", n, None) for n in lengths]
        if args.source_requests:
            points.append(("source", args.source_requests, args.source))
        for kind, n, trace in points:
            if trace is None:
                trace = work / f"syn-{n}.jsonl"
                _run(_cli("synth", str(args.source), "--requests", str(n), "--out", str(trace)))
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            base: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for _ in range(args.repeats):
                for mode in modes:
                    if mode == "real" and n > args.real_max:
                        continue
                    runs[mode].append(replay_point(trace, n, mode, work))
                    print(f"{n} {mode}: {runs[mode][-1]}", file=sys.stderr)
                    if args.baseline:
                        base[mode].append(replay_point(trace, n, mode, work, args.baseline))
                        print(f"{n} {mode} baseline: {base[mode][-1]}", file=sys.stderr)
            for mode, rows in runs.items():
                if not rows:
                    continue
                cpu = _median(rows, "engine_cpu_s")
                out["points"].append(
                    {
                        "requests": n,
                        "trace": kind,
                        "bytes": mode,
                        "runs": len(rows),
                        "wall_s": _median(rows, "wall_s"),
                        "cpu_s": _median(rows, "cpu_s"),
                        "engine_cpu_s": cpu,
                        "engine_wall_s": _median(rows, "engine_wall_s"),
                        "max_rss_mb": _median(rows, "max_rss_mb"),
                        "requests_per_s_cpu": n / cpu if cpu else None,
                        "requests_per_s_wall": n / _median(rows, "engine_wall_s"),
                        "hit_tokens": rows[0]["hit_tokens"],
                        "ttft_mean_s": rows[0]["ttft_mean_s"],
                        "virtual_s": rows[0]["virtual_s"],
                    }
                )
                if base[mode]:
                    b = base[mode]
                    out["points"][-1]["baseline"] = {
                        "repo": str(args.baseline),
                        "runs": b,
                        "engine_cpu_s": _median(b, "engine_cpu_s"),
                        "max_rss_mb": _median(b, "max_rss_mb"),
                        "speed_over_baseline": _median(b, "engine_cpu_s") / cpu,
                        "same_hits": all(
                            r["hit_tokens"] == rows[0]["hit_tokens"] and r["virtual_s"] == rows[0]["virtual_s"]
                            for r in b
                        ),
                    }
            if len([m for m in modes if runs[m]]) == 2:
                a, b = runs["metadata"][0], runs["real"][0]
                out["points"][-1]["modes_agree"] = (
                    a["hit_tokens"] == b["hit_tokens"] and a["virtual_s"] == b["virtual_s"]
                )
                out["points"][-1]["real_over_metadata_speed"] = _median(runs["metadata"], "engine_cpu_s") / _median(
                    runs["real"], "engine_cpu_s"
                )
        if args.compare_requests:
            cmp: dict[str, list[dict[str, Any]]] = {"workers1": [], "workers2": []}
            for _ in range(max(1, args.repeats)):
                for w in ("2", "1"):
                    cmp[f"workers{w}"].append(
                        _run(
                            _cli(
                                "replay",
                                str(args.source),
                                "--limit",
                                str(args.compare_requests),
                                "--compare",
                                "--workers",
                                w,
                                "--quiet",
                                "--bytes",
                                "metadata",
                            )
                        )
                    )
            par, seq = _median(cmp["workers2"], "wall_s"), _median(cmp["workers1"], "wall_s")
            out["compare"] = {
                "requests": args.compare_requests,
                "bytes": "metadata",
                "parallel_wall_s": par,
                "sequential_wall_s": seq,
                "parallel_over_sequential": par / seq,
                "runs": cmp,
            }
        if args.long_requests:
            trace = work / f"syn-{args.long_requests}.jsonl"
            _run(_cli("synth", str(args.source), "--requests", str(args.long_requests), "--out", str(trace)))
            out["long"] = long_run(
                trace, work, args.long_checkpoint, args.long_limit or None, poll_s=0.2 if args.quick else 2.0
            )
            out["long"]["trace_requests"] = args.long_requests
    out["machine"]["load_avg_end"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(
        json.dumps(
            {k: v for k, v in out.items() if k != "points"}
            | {
                "points": [
                    {
                        k: p[k]
                        for k in (
                            "requests",
                            "trace",
                            "bytes",
                            "engine_cpu_s",
                            "engine_wall_s",
                            "max_rss_mb",
                            "requests_per_s_cpu",
                        )
                    }
                    for p in out["points"]
                ]
            },
            indent=1,
            default=str,
        )
    )
    if args.plot:
        plot(out, args.plot)
    return 0


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for mode, style in (("metadata", "o-"), ("real", "s--")):
        pts = [p for p in out["points"] if p["bytes"] == mode and p.get("trace", "synth") == "synth"]
        if not pts:
            continue
        xs = [p["requests"] for p in pts]
        ax1.plot(xs, [p["engine_cpu_s"] for p in pts], style, label=f"{mode}: engine CPU s")
        ax2.plot(xs, [p["max_rss_mb"] for p in pts], style, label=f"{mode}: max RSS MB")
    long = out.get("long") or {}
    pts = long.get("checkpoints") or []
    if pts:
        xs = [p["requests_done"] for p in pts]
        ax1.plot(xs, [p["engine_cpu_s"] for p in pts], "^-", label="metadata, one long run: engine CPU s")
        ax2.plot(xs, [p["rss_hwm_mb"] for p in pts], "^-", label="metadata, one long run: RSS high-water MB")
    for ax, title in ((ax1, "time against trace length"), (ax2, "max RSS against trace length")):
        ax.set_xscale("log")
        ax.set_xlabel("requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
