"""What the real server drops in its default settings: the README's first-run sequence, per trace family.

    .venv-sglang/bin/python -m benchmarks.server.first_run_drops --json first_run_drops.json
    .venv-sglang/bin/python -m benchmarks.server.first_run_drops --traces mooncake --limit 40 --json quick.json

For each trace: a fresh `sgl-hicache serve` with the README's first-run flags (the tiny model with dummy
weights, `--max-total-tokens 1024` device pool, `--host-tokens 4096`, a fresh `--disk-dir`, page 16,
every other setting default), then `sgl-hicache replay TRACE --url ... --limit N --scale 16
--max-new-tokens 4 --concurrency 4 --report R`, and the server's per-tier figures from the report's
`server_stats`: tokens evicted from the device and host tiers, and of those the tokens dropped dirty
(no copy below: lost). The bar: dirty drops at most 1 % of the evicted tokens while the tier
below has room. Optionally (`--restart`) a second server on the same disk directory replays the same
requests (what the disk tier gives after a restart).

Traces (`--traces`, comma-separated names or paths): `mooncake` = the shipped Mooncake conversation
trace; `agentic` = BFCL multi-turn tool-use sessions written by `benchmarks/agentic_trace.py`
(`--agentic FILE`; generated into the work dir from `--bfcl-wheel` when given), rewritten as a block
trace of ~512-token blocks (`as_block_trace`) so that `--scale 16` fits it to the tiny model; `synth` = a trace
grown from the shipped one by `sgl-hicache synth --seed 1` (same family, other sessions); any other
value is a trace file path. A trace that cannot be had is reported as skipped, with the reason.

Hit tokens are nearly repeatable (concurrency 4 reorders inserts a little); the drop counts are the
figure. Exit status 1 if a server failed or a tier dropped more than `--max-drop` of its evictions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE as SHIPPED
from benchmarks.lib.paths import REPO
from benchmarks.lib.server_runs import TINY_MODEL as MODEL
from benchmarks.lib.server_runs import server_env_for_cli
from benchmarks.lib.traces import as_block_trace
from sgl_hicache.client.server import ServerStartError, SGLangServer, free_port


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("sgl-hicache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sgl_hicache.cli"]


def _env() -> dict[str, str]:
    env = server_env_for_cli()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def serve_and_replay(trace: Path, disk_dir: Path, work: Path, a: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One `sgl-hicache serve` (README flags) and one replay of `trace` against it."""
    port = free_port()
    serve = [
        *_cli(),
        "serve",
        "--host-tokens",
        str(a.host_tokens),
        "--disk-dir",
        str(disk_dir),
        "--page-size",
        "16",
        "--",
        "--model-path",
        str(MODEL),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--port",
        str(port),
        "--max-total-tokens",
        str(a.device_tokens),
        "--enable-metrics",
    ]
    log_path = work / f"{tag}.server.log"
    log = open(log_path, "wb")  # noqa: SIM115 (the server writes it; closed when it stops)
    proc = subprocess.Popen(
        serve,
        cwd=REPO,
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    # the README's `sgl-hicache serve` process group, waited for and stopped as every other server is
    srv = SGLangServer(
        proc=proc,
        host="127.0.0.1",
        port=port,
        log_path=log_path,
        argv=serve,
        started_at=time.monotonic(),
        _log_file=log,
    )
    try:
        try:
            srv.wait_healthy(a.start_timeout)
        except ServerStartError as e:
            return {"error": f"server not up: {str(e)[-1500:]}"}
        report = work / f"{tag}.report.json"
        replay = [
            *_cli(),
            "replay",
            str(trace),
            "--url",
            srv.url,
            "--limit",
            str(a.limit),
            "--scale",
            "16",
            "--max-new-tokens",
            "4",
            "--concurrency",
            "4",
            "--report",
            str(report),
        ]
        t1 = time.monotonic()
        rp = subprocess.run(replay, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=a.replay_timeout)
        wall = time.monotonic() - t1
        if not report.exists():
            return {"error": f"replay exit {rp.returncode}: {rp.stderr[-1500:]}"}
        rep = json.loads(report.read_text())["policies"]["server"]
    finally:
        srv.stop()
    st = rep.get("server_stats") or {}
    out = {
        "replay_exit": rp.returncode,
        "requests": rep["requests"],
        "requests_failed": rep["requests_failed"],
        "requests_skipped": rep.get("requests_skipped", 0),
        "prompt_tokens": rep["prompt_tokens"],
        "hit_tokens": dict(rep["hit_tokens"]),
        "hit_rate": rep["hit_rate"],
        "ttft_mean_s": rep["ttft_s"]["mean"],
        "replay_wall_s": round(wall, 1),
    }
    for key in ("evicted_tokens", "dropped_dirty_tokens", "dropped_tokens"):
        if key in st:
            out[key] = st[key]
    for tier in ("device", "host"):
        ev = (st.get("evicted_tokens") or {}).get(tier, 0)
        dd = (st.get("dropped_dirty_tokens") or {}).get(tier, 0)
        out[f"{tier}_dirty_drop_share"] = dd / ev if ev else 0.0
    return out


def resolve_traces(names: list[str], work: Path, a: argparse.Namespace) -> dict[str, Path | str]:
    """name -> trace path, or a string saying why it is skipped."""
    out: dict[str, Path | str] = {}
    for name in names:
        if name == "mooncake":
            out[name] = SHIPPED if SHIPPED.exists() else f"{SHIPPED} missing"
        elif name == "synth":
            if not SHIPPED.exists():
                out[name] = f"{SHIPPED} missing"
                continue
            dst = work / "synth.jsonl"
            p = subprocess.run(
                [
                    *_cli(),
                    "synth",
                    str(SHIPPED),
                    "--requests",
                    str(max(a.limit * 4, 1000)),
                    "--seed",
                    "1",
                    "--out",
                    str(dst),
                ],
                cwd=REPO,
                env=_env(),
                capture_output=True,
                text=True,
            )
            out[name] = dst if p.returncode == 0 else f"synth failed: {p.stderr[-500:]}"
        elif name == "agentic":
            if a.agentic:
                out[name] = as_block_trace(Path(a.agentic), work / "agentic-blocks.jsonl")
            elif a.bfcl_wheel:
                dst = work / "agentic.jsonl"
                p = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.agentic_trace",
                        "--wheel",
                        a.bfcl_wheel,
                        "--out",
                        str(dst),
                    ],
                    cwd=REPO,
                    env=_env(),
                    capture_output=True,
                    text=True,
                )
                out[name] = (
                    as_block_trace(dst, work / "agentic-blocks.jsonl")
                    if p.returncode == 0
                    else f"agentic_trace failed: {p.stderr[-500:]}"
                )
            else:
                out[name] = "no --agentic FILE or --bfcl-wheel WHEEL given"
        else:
            path = Path(name)
            out[path.stem] = path if path.exists() else f"{path} missing"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--traces", default="mooncake,agentic,synth", help="comma-separated: mooncake, agentic, synth, or paths"
    )
    p.add_argument("--agentic", default=None, help="a BFCL agentic trace from benchmarks/agentic_trace.py")
    p.add_argument("--bfcl-wheel", default=None, help="bfcl_eval wheel to generate the agentic trace from")
    p.add_argument("--limit", type=int, default=300, help="requests per trace (README: 300)")
    p.add_argument("--device-tokens", type=int, default=1024, help="--max-total-tokens (README: 1024)")
    p.add_argument("--host-tokens", type=int, default=4096, help="--host-tokens (README: 4096)")
    p.add_argument("--restart", action="store_true", help="replay again on a second server over the same disk dir")
    p.add_argument(
        "--max-drop", type=float, default=0.01, help="fail above this dirty-drop share per tier (default 0.01)"
    )
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--replay-timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    results: dict[str, Any] = {
        "regime": {
            "model": str(MODEL.relative_to(REPO)),
            "device_tokens": a.device_tokens,
            "host_tokens": a.host_tokens,
            "page_size": 16,
            "limit": a.limit,
            "scale": 16,
            "concurrency": 4,
            "max_new_tokens": 4,
        },
        "traces": {},
    }
    ok = True
    with tempfile.TemporaryDirectory(prefix="first-run-drops-") as tmp:
        work = Path(tmp)
        for name, trace in resolve_traces([t.strip() for t in a.traces.split(",") if t.strip()], work, a).items():
            if isinstance(trace, str):
                results["traces"][name] = {"skipped": trace}
                print(f"{name}: skipped ({trace})", file=sys.stderr)
                continue
            disk = work / f"{name}-disk"
            row: dict[str, Any] = {
                "trace": str(trace),
                "first": serve_and_replay(trace, disk, work, a, f"{name}-first"),
            }
            if a.restart and "error" not in row["first"]:
                row["restart"] = serve_and_replay(trace, disk, work, a, f"{name}-restart")
            results["traces"][name] = row
            first = row["first"]
            if (
                "error" in first
                or first.get("requests_failed")
                or max(first["device_dirty_drop_share"], first["host_dirty_drop_share"]) > a.max_drop
            ):
                ok = False
            print(f"{name}: {json.dumps({k: v for k, v in first.items() if k != 'hit_tokens'})}", file=sys.stderr)
    text = json.dumps(results, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
