"""Runs on a real SGLang server, shared by the server benchmarks.

- `start_server`: `SGLangServer.start` with the CPU test layer asked for (`CPU_LAYER_ENV`), so that
  SGLang's own HiCache runs on a machine without CUDA (`scripts/cpu/layer`; a no-op on a GPU);
- the configurations compared (`CONFIGS`, `LABELS`) and each one's flags and environment
  (`server_args`, `server_env`);
- a trace slice sized for a CPU server (`load_slice`, `working_set_tokens`, `pool_tokens`);
- `warm_up`: untimed requests that take a fresh server's first-batch costs;
- `run_one`: one replay on a fresh server, stopped and cleaned in every path, with its figures
  (TTFT, throughput, hits per tier, prefill batches) and optionally a py-spy profile
  (`start_profiler`; read it with `python -m benchmarks.server.profile_summary`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import CPU_MODELS
from sgl_hicache.client.backend_settings import BackendSettings, settings_env
from sgl_hicache.client.server import ServerStartError, SGLangServer
from sgl_hicache.replay import load_trace
from sgl_hicache.replay.http import generate_stream, replay_http

DEFAULT_MODEL = CPU_MODELS / "bench-llama"
TINY_MODEL = CPU_MODELS / "tiny-llama"
# Every SGLang server a benchmark starts asks for the CPU test layer; it patches only where CUDA is absent.
CPU_LAYER_ENV = {"SGLANG_CPU_TEST_LAYER": "1"}
CONFIGS = (
    "default",
    "hicache",
    "sgl_hicache",
    "hicache_host",
    "sgl_hicache_noskip",
    "sgl_hicache_hold",
    "sgl_hicache_nohold",
    "sgl_hicache_spf",
    "hicache_spf",
)
# sgl_hicache variants: the same server with these backend settings changed (an A/B in one run)
VARIANTS: dict[str, dict[str, Any]] = {
    "sgl_hicache": {},
    "sgl_hicache_noskip": {"skip_waiting_admission": False},
    "sgl_hicache_hold": {"admission_hold": "always"},
    "sgl_hicache_nohold": {"admission_hold": "off"},
    "sgl_hicache_spf": {},
}
# configurations that differ from their base only in SGLang's scheduling policy (an A/B of queue order)
SCHEDULE_POLICY = {"sgl_hicache_spf": "shortest-prefill-first", "hicache_spf": "shortest-prefill-first"}
DEFAULT_CONFIGS = CONFIGS[:3]
LABELS = {
    "default": "SGLang default cache",
    "hicache": "SGLang HiCache (host + file)",
    "sgl_hicache": "sgl_hicache",
    "hicache_host": "SGLang HiCache (host only)",
    "sgl_hicache_noskip": "sgl_hicache, skip_waiting_admission off",
    "sgl_hicache_hold": "sgl_hicache, admission_hold always",
    "sgl_hicache_nohold": "sgl_hicache, admission_hold off",
    "sgl_hicache_spf": "sgl_hicache, --schedule-policy shortest-prefill-first",
    "hicache_spf": "SGLang HiCache, --schedule-policy shortest-prefill-first",
}
TIERS = ("device", "host", "disk")


def start_server(model: str | Path, *, env: Mapping[str, str] | None = None, **kwargs: Any) -> SGLangServer:
    """`SGLangServer.start(model, env=..., **kwargs)` with `CPU_LAYER_ENV` under the caller's `env`."""
    return SGLangServer.start(model, env={**CPU_LAYER_ENV, **(env or {})}, **kwargs)


WARMUP = (48, 160, 320)  # untimed prompts first: a fresh server's first batches of a shape are slow


def warm_up(url: str, vocab: int, output_tokens: int) -> None:
    """A few untimed requests of unrelated ids (top of the vocabulary, descending: no trace prefix),
    so that no measured request pays the fresh server's first-batch costs."""
    for i, n in enumerate(WARMUP):
        generate_stream(url, [vocab - 1 - ((i * 7 + j) % (vocab // 2)) for j in range(n)], output_tokens)


def server_env_for_cli(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a server started through the CLI (`sgl-hicache serve`): this process's,
    `CPU_LAYER_ENV`, `extra` on top."""
    return {**os.environ, **CPU_LAYER_ENV, **(extra or {})}


# ------------------------------------------------------------------------------------------ workload
def load_slice(trace: Path, n: int, scale: int, vocab: int, output_tokens: int) -> list:
    reqs = load_trace(str(trace), limit=n, scale=scale, vocab_size=vocab)
    # Same output length for every request (the trace's own lengths are capped at `output_tokens`
    # by the replayer anyway; this also lifts the few shorter ones).
    return [dataclasses.replace(r, output_length=output_tokens) for r in reqs]


def pool_tokens(frac: float, ws: int, longest: int, output_tokens: int, page: int) -> int:
    floor = math.ceil((longest + output_tokens) / page) * page + page
    return max(math.ceil(frac * ws / page) * page, floor)


# ------------------------------------------------------------------------------------------ one run
def server_args(config: str, pool: int, page: int, host_ratio: float) -> list[str]:
    args = ["--page-size", str(page), "--max-total-tokens", str(pool)]
    if config in SCHEDULE_POLICY:
        args += ["--schedule-policy", SCHEDULE_POLICY[config]]
    if config in ("hicache", "hicache_host", "hicache_spf"):
        args += [
            "--enable-hierarchical-cache",
            "--hicache-io-backend",
            "direct",
            "--hicache-mem-layout",
            "layer_first",
            "--hicache-ratio",
            f"{host_ratio:g}",
        ]
        if config in ("hicache", "hicache_spf"):
            args += ["--hicache-storage-backend", "file"]
    elif config in VARIANTS:
        args += ["--radix-cache-backend", "sgl_hicache"]
    return args


def server_env(
    config: str,
    pool: int,
    host_ratio: float,
    store_dir: Path,
    disk_tokens: int,
    page: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, str]:
    env: dict[str, str] = {}  # (main() removed the caller's SGLHICACHE_* variables from os.environ)
    if config in ("hicache", "hicache_spf"):
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(store_dir)
    elif config in VARIANTS:
        host = int(pool * host_ratio) // page * page
        s = BackendSettings(
            host_tokens=host, disk_dir=str(store_dir), disk_tokens=disk_tokens, prefetch=True, predictor="tree_walk"
        ).replace(**(extra or {}), **VARIANTS[config])
        env.update(settings_env(s))
        env["SGLHICACHE_PREFETCH"] = "1"  # explicit, though it is the default
    return env


def _server_info(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=10) as r:
            info = json.loads(r.read())
    except Exception:  # noqa: BLE001  (figures only; a run does not fail on it)
        return {}
    st = (info.get("internal_states") or [{}])[0] or {}
    out = {k: st.get(k) for k in ("max_total_num_tokens", "radix_cache_backend") if k in st}
    for k in (
        "max_total_tokens",
        "hicache_ratio",
        "hicache_storage_backend",
        "hicache_write_policy",
        "chunked_prefill_size",
        "max_running_requests",
        "radix_cache_backend",
    ):
        if k in info and k not in out:
            out[k] = info.get(k)
    return out


def _summary(rep: dict[str, Any]) -> dict[str, Any]:
    t = rep["ttft_s"]
    out = {
        "requests": rep["requests"],
        "requests_failed": rep["requests_failed"],
        "first_error": rep["errors"].get("first_error"),
        "prompt_tokens": rep["prompt_tokens"],
        "output_tokens": rep["output_tokens"],
        "ttft_mean_s": t["mean"],
        "ttft_p50_s": t["p50"],
        "ttft_p90_s": t["p90"],
        "ttft_p99_s": t["p99"],
        "latency_mean_s": rep["latency_s"]["mean"],
        "throughput_tok_s": rep["throughput_tok_s"],
        "duration_s": rep["duration_s"],
        "hit_tokens": dict(rep["hit_tokens"]),
        "hit_rate": rep["hit_rate"],
        "ttft_samples_s": rep.get("ttft_samples_s", []),
    }
    if rep.get("server_stats"):  # sgl_hicache only
        out["sgl_hicache"] = {
            "prefetch": rep.get("prefetch"),
            "predict": rep.get("predict"),
            "bytes_moved": rep.get("bytes_moved"),
            "stored_tokens": rep.get("stored_tokens"),
            "capacity_tokens": rep.get("capacity_tokens"),
            "errors": rep.get("errors"),
        }
        backend = (rep["server_stats"].get("backend") or {}) if isinstance(rep["server_stats"], dict) else {}
        out["sgl_hicache"]["admission"] = {
            "holds": backend.get("admission_holds"),
            "reorders": backend.get("queue_reorders"),
            "prefill_cost": backend.get("prefill_cost"),
        }
    return out


_PREFILL_LINE = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


def prefill_batches(log_text: str) -> dict[str, Any]:
    """How SGLang composed its prefill batches, from its own log lines: batches by number of new
    sequences, and new / cached tokens. Equal tokens with fewer, larger batches means requests were
    admitted together, so each waits for the others' prefill too (on a CPU a batch's time is about
    the sum of its sequences'), which raises TTFT without changing throughput."""
    sizes: dict[str, int] = {}
    new = cached = 0
    for m in _PREFILL_LINE.finditer(log_text):
        sizes[m.group(1)] = sizes.get(m.group(1), 0) + 1
        new += int(m.group(2))
        cached += int(m.group(3))
    batches = sum(sizes.values())
    seqs = sum(int(k) * v for k, v in sizes.items())
    return {
        "batches": batches,
        "by_new_seqs": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))),
        "mean_new_seqs": seqs / batches if batches else None,
        "new_tokens": new,
        "cached_tokens": cached,
    }


def run_one(
    config: str,
    pool: int,
    reqs: list,
    a: argparse.Namespace,
    workdir: Path,
    tag: str,
    replay: Callable[[SGLangServer], dict[str, Any]] | None = None,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One run on a fresh server of `config` (`server_args` + `extra_args`, `server_env`; its own temp
    dir, stopped and cleaned in every path): `replay(server)` gives the run's figures (default:
    `replay_http` of `reqs` as `a` says, summarised by `_summary`). Never raises for a failed run:
    `error` says why."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=workdir))
    store = run_dir / "store"
    log = run_dir / "server.log"
    sample: dict[str, Any] = {"config": config, "max_total_tokens": pool, "loadavg_before": os.getloadavg()}
    srv = None
    t0 = time.monotonic()
    try:
        srv = start_server(
            a.model,
            extra_args=[*server_args(config, pool, a.page_size, a.host_ratio), *extra_args],
            env=server_env(config, pool, a.host_ratio, store, a.disk_tokens, a.page_size, a.sgl_hicache_extra),
            log_path=log,
            load_format="dummy",
            timeout_s=a.start_timeout,
        )
        sample["server_ready_s"] = srv.ready_after_s
        spy = start_profiler(srv.proc.pid, Path(a.profile) / f"{tag}.txt") if a.profile else None
        try:
            if replay is not None:
                sample.update(replay(srv))
            else:
                rep = replay_http(
                    reqs,
                    srv.url,
                    concurrency=a.concurrency,
                    max_new_tokens=a.output_tokens,
                    timeout_s=a.request_timeout,
                    trace_clock=a.time_scale is not None,
                    time_scale=a.time_scale or 1.0,
                )
                sample.update(_summary(rep))
        finally:
            stop_profiler(spy)
        sample["server_info"] = _server_info(srv.url)
        if not srv.alive():
            sample["error"] = "server died during the replay"
    except ServerStartError as e:
        sample["error"] = f"server did not start: {str(e)[-2000:]}"
    except Exception as e:  # noqa: BLE001  (record it, stop the server, go on with the next run)
        sample["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        if srv is not None:
            srv.stop()
        try:
            sample["prefill_batches"] = prefill_batches(log.read_text(errors="replace")) if log.exists() else None
        except OSError:
            sample["prefill_batches"] = None
        if a.keep_logs:
            dst = Path(a.keep_logs)
            dst.mkdir(parents=True, exist_ok=True)
            if log.exists():
                shutil.copy(log, dst / f"{tag}.log")
        try:
            sample["store_bytes"] = (
                sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.exists() else 0
            )
        except OSError:
            sample["store_bytes"] = None
        shutil.rmtree(run_dir, ignore_errors=True)
    sample["wall_s"] = time.monotonic() - t0
    sample["loadavg_after"] = os.getloadavg()
    return sample


def start_profiler(server_pid: int, out: Path) -> subprocess.Popen | None:
    """py-spy sampling SGLang's scheduler process (the server's child titled `sglang::scheduler`) for
    the replay, collapsed stacks to `out` (read them with `python -m benchmarks.server.profile_summary`)."""
    import psutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    sched = [
        p
        for p in psutil.Process(server_pid).children(recursive=True)
        if "scheduler" in " ".join(p.cmdline()) or "scheduler" in p.name()
    ]
    if not sched or not Path(spy).exists():
        print(f"--profile: no scheduler process or no py-spy ({spy}); not profiled", file=sys.stderr)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(sched[0].pid),
            "--rate",
            "200",
            "--format",
            "raw",
            "--nonblocking",
            "--idle",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_profiler(spy: subprocess.Popen | None) -> None:
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()


def realistic_model(dst: Path, seed: int = 0) -> Path:
    """The tiny Llama with realistic random weights written to `dst` (`scripts/cpu/realistic_weights.py`,
    loaded from its file: `scripts/` is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("realistic_weights", CPU_MODELS / "realistic_weights.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_model(dst, seed)
