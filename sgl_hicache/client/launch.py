"""`sgl-hicache serve [tiering options] -- <any sglang launch_server flags>`.

Runs `python -m sglang.launch_server <flags> --radix-cache-backend sgl_hicache` with the tiering options
passed to the scheduler through `SGLHICACHE_*` environment variables (see `settings.py`). Every SGLang
flag after `--` passes through unchanged. On a machine without CUDA it adds what SGLang needs on a CPU
unless the flags already say otherwise: `SGLANG_USE_CPU_ENGINE=1`, `--device cpu --attention-backend
torch_native --disable-cuda-graph`, and a bounded `--max-total-tokens` (SGLang would otherwise size the
KV pool from host memory).

    sgl-hicache serve --host-tokens 65536 --disk-dir /nvme/kv -- --model-path Qwen/Qwen2.5-7B-Instruct --port 30000

This module imports no sglang: the server runs in a child process (the same interpreter by default).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from ..config import DISK_WRITE_POLICIES, EVICTION_POLICIES, PREDICTORS, WRITE_POLICIES
from .backend_settings import CONFIG_ENV, BackendSettings, SettingsError, load_settings, settings_env
from .server import cpu_server_args, has_cuda

BACKEND = "sgl_hicache"
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sgl-hicache serve",
        description="Launch SGLang with the sgl_hicache tiered prefix cache. Tiering options go before `--`, SGLang's flags after it.",
    )
    p.add_argument(
        "--config",
        help="JSON file of tiering settings (keys as in docs/sglang-backend.md); the flags below override it",
    )
    p.add_argument("--host-tokens", type=int, help="host DRAM tier capacity in tokens (default: 4x the device pool)")
    p.add_argument("--host-ratio", type=float, help="host capacity as a multiple of the device pool (default 4)")
    p.add_argument("--disk-dir", help="disk tier directory (default ~/.cache/sgl_hicache/<model namespace>)")
    p.add_argument("--disk-tokens", type=int, help="disk tier capacity in tokens (0 turns it off; default: --disk-gb)")
    p.add_argument(
        "--disk-gb", type=float, help="disk tier capacity in GiB when --disk-tokens is not given (default 16)"
    )
    p.add_argument(
        "--store",
        help="shared store tier in the disk tier's place: mooncake://HOST:PORT[?metadata=URL] or redis://HOST:PORT",
    )
    p.add_argument(
        "--store-min-hits", type=int, help="write back to the store only pages hit at least this often (default 0)"
    )
    p.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        help="device -> host copies (default write_through: started at commit)",
    )
    p.add_argument(
        "--disk-write-policy", choices=DISK_WRITE_POLICIES, help="host -> disk copies (default write_through)"
    )
    p.add_argument("--eviction-policy", choices=EVICTION_POLICIES, help="eviction order in every tier (default lru)")
    p.add_argument(
        "--predictor",
        choices=PREDICTORS,
        help="promote likely descendants of a match disk -> host (default tree_walk; none turns it off)",
    )
    p.add_argument(
        "--no-prefetch", action="store_true", help="do not start disk -> host promotion while a request waits"
    )
    p.add_argument(
        "--load-timeout-s", type=float, help="longest wait for a request's disk pages before recomputing (default 30)"
    )
    p.add_argument(
        "--hint-port",
        type=int,
        help="serve the hint API (POST /hints: prefetch / pin / retain / demote a prefix) on this port (0: any free port; default off; TP=1 only)",
    )
    p.add_argument(
        "--stats-file",
        help="the scheduler writes JSON stats here periodically (default none; live stats are on GET /server_info)",
    )
    p.add_argument("--page-size", type=int, help="SGLang's --page-size (KV page = cache page), if not given after --")
    p.add_argument("--python", default=sys.executable, help="interpreter with SGLang installed (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command, do not start")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then SGLang launch_server flags")
    return p


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_command(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The child's argv and the environment additions. Raises SettingsError / ValueError on bad input."""
    environ = dict(os.environ if environ is None else environ)
    sg = list(ns.sglang_args or [])
    if sg and sg[0] == "--":
        sg = sg[1:]
    if not _has_flag(sg, "--model-path") and not _has_flag(sg, "--model"):
        raise ValueError("no model: pass SGLang's flags after `--`, e.g. `sgl-hicache serve -- --model-path MODEL`")
    backend = _flag_value(sg, "--radix-cache-backend")
    if backend is not None and backend != BACKEND:
        raise ValueError(
            f"--radix-cache-backend {backend} given after `--`; `sgl-hicache serve` runs the {BACKEND} backend"
        )
    if _has_flag(sg, "--enable-hierarchical-cache"):
        raise ValueError(
            "--enable-hierarchical-cache turns on SGLang's own HiCache; it cannot run together with sgl_hicache"
        )
    env: dict[str, str] = {}
    if ns.config:
        env[CONFIG_ENV] = os.path.abspath(ns.config)
    # settings: config file (if any) + the flags given here; validated now, in this process
    overrides = {
        "host_tokens": ns.host_tokens,
        "host_ratio": ns.host_ratio,
        "disk_dir": ns.disk_dir,
        "disk_tokens": ns.disk_tokens,
        "disk_gb": ns.disk_gb,
        "store": ns.store,
        "store_min_hits": ns.store_min_hits,
        "write_policy": ns.write_policy,
        "disk_write_policy": ns.disk_write_policy,
        "eviction_policy": ns.eviction_policy,
        "predictor": ns.predictor,
        "load_timeout_s": ns.load_timeout_s,
        "stats_file": ns.stats_file,
        "hint_port": ns.hint_port,
    }
    base = load_settings({k: v for k, v in environ.items() if k.startswith("SGLHICACHE_")} | env)
    changes = {k: v for k, v in overrides.items() if v is not None}
    if ns.no_prefetch:
        changes["prefetch"] = False
    if changes.get("disk_dir"):
        changes["disk_dir"] = os.path.abspath(os.path.expanduser(changes["disk_dir"]))
    if changes.get("stats_file"):
        changes["stats_file"] = os.path.abspath(os.path.expanduser(changes["stats_file"]))
    settings: BackendSettings = base.replace(**changes)
    env.update(settings_env(settings))
    argv = [ns.python, "-m", "sglang.launch_server", *sg]
    if backend is None:
        argv += ["--radix-cache-backend", BACKEND]
    if ns.page_size is not None and not _has_flag(sg, "--page-size"):
        argv += ["--page-size", str(ns.page_size)]
    if not has_cuda() and not _has_flag(sg, "--device"):
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        cpu = cpu_server_args(max_total_tokens=CPU_DEFAULT_MAX_TOTAL_TOKENS)
        if _has_flag(sg, "--max-total-tokens"):
            i = cpu.index("--max-total-tokens")
            del cpu[i : i + 2]
        if _has_flag(sg, "--attention-backend"):
            i = cpu.index("--attention-backend")
            del cpu[i : i + 2]
        if _has_flag(sg, "--disable-cuda-graph"):
            cpu.remove("--disable-cuda-graph")
        argv += cpu
    return argv, env


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help, or a bad option (argparse printed why)
        return int(e.code or 0)
    try:
        cmd, env = build_command(ns)
    except (SettingsError, ValueError) as e:
        print(f"sgl-hicache serve: {e}", file=sys.stderr)
        return 2
    if ns.dry_run:
        for k, v in sorted(env.items()):
            print(f"{k}={v}")
        print(" ".join(cmd))
        return 0
    proc = subprocess.Popen(cmd, env={**os.environ, **env})

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    old = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the child got SIGINT too (same process group); let it shut down
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    raise SystemExit(main())
