"""The real SGLang server, three ways, side by side: default cache vs SGLang's own HiCache vs sgl_hicache.

    .venv-sglang/bin/python benchmarks/server_compare.py --json server_compare.json
    .venv-sglang/bin/python benchmarks/server_compare.py --requests 150 --repeats 2 --json out.json
    .venv-sglang/bin/python benchmarks/server_compare.py --quick --json quick.json   # ~2 min here

Every run starts a fresh `python -m sglang.launch_server` (its own process group, stopped in every
path) with the same model (`scripts/cpu/bench-llama`, dummy weights: hidden 1024, 8 layers, prefill
dominates on a CPU), the same page size (16), the same device pool (`--max-total-tokens`), and replays
the same trace slice over HTTP (`sgl_hicache.replay.http.replay_http`: concurrency 4, 8 output
tokens, `ignore_eos`, greedy; a closed loop: each client sends its next request when the last one ends;
`--time-scale S` makes it an open loop instead, each request sent at its trace timestamp x S, at most
`--concurrency` in flight). The slice is the first `--requests` requests of the Mooncake
conversation trace with every 512-token block scaled to 32 tokens. Three configurations:

- `default`: SGLang's default radix cache (an evicted prefix is recomputed);
- `hicache`: SGLang's own HiCache: `--enable-hierarchical-cache --hicache-io-backend direct
  --hicache-mem-layout layer_first --hicache-ratio R` (host pool = R x device pool) plus its `file`
  storage backend (`--hicache-storage-backend file`, directory in
  `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`, a fresh temp dir per run); everything else at SGLang's
  defaults (write policy `write_through`, prefetch policy `timeout`). On CPU this needs the
  workaround in `scripts/cpu/layer/sglang_cpu_layer/patches.py`, which our plugin applies in every SGLang process;
- `hicache_host` (only with `--configs`): the same HiCache without a storage backend, a control: with
  a storage backend SGLang skips a request while its storage prefetch is in flight
  (`check_prefetch_progress`), which changes how prefill batches are composed;
- `sgl_hicache`: `--radix-cache-backend sgl_hicache` with host tokens = the same host capacity as
  `hicache` (R x device pool), the disk tier on in a fresh temp dir (capacity: 2x the slice's working
  set, so like the file backend it never has to drop a page), prefetch on, predictor `tree_walk`;
- `sgl_hicache_noskip`, `sgl_hicache_hold`, `sgl_hicache_nohold` (only with
  `--configs`): the same with `skip_waiting_admission` off, or with `admission_hold` `always` (every
  new request waits a round while the prefill batch has one: the split HiCache's storage lookups
  make) or `off` (none waits; the default, `cost`, holds one where the measured prefill
  cost says it pays);
- `sgl_hicache_spf`, `hicache_spf` (only with `--configs`): `sgl_hicache` and `hicache` with SGLang's
  own `--schedule-policy shortest-prefill-first` (experimental in SGLang; by uncached tokens).

Device pool sizes (`--pools`) are fractions of the slice's working set = its distinct prompt tokens at
page granularity (distinct chained pages x 16), never below the longest request + its output.

Runs are interleaved: for each repeat r, for each pool size, the three configurations run in rotated
order (r=0: A B C, r=1: B C A, r=2: C A B, ...). Per configuration and pool the report gives medians
across repeats of TTFT mean / p50 / p90, throughput ((prompt + output tokens) / wall time), hit tokens
per tier (from each reply's `meta_info.cached_tokens_details`: device / host / storage -> disk) and
failures; and the ratios of `sgl_hicache` against both peers (ratio of medians; the per-repeat paired
ratios are in the JSON too). TTFT ratio < 1 and throughput ratio > 1 mean sgl_hicache is better.
Hit counts are nearly repeatable (concurrency 4 reorders inserts a little); times drift by up to ~25 %
on this shared machine, which is why the rounds are interleaved and repeated.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sgl_hicache.client.backend_settings import BackendSettings, settings_env  # noqa: E402
from sgl_hicache.client.server import ServerStartError, SGLangServer  # noqa: E402
from sgl_hicache.replay import load_trace  # noqa: E402
from sgl_hicache.replay.http import replay_http  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
if not DEFAULT_TRACE.exists():
    DEFAULT_TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_MODEL = REPO / "scripts" / "cpu" / "bench-llama"
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


# ------------------------------------------------------------------------------------------ workload
def load_slice(trace: Path, n: int, scale: int, vocab: int, output_tokens: int) -> list:
    reqs = load_trace(str(trace), limit=n, scale=scale, vocab_size=vocab)
    # Same output length for every request (the trace's own lengths are capped at `output_tokens`
    # by the replayer anyway; this also lifts the few shorter ones).
    return [dataclasses.replace(r, output_length=output_tokens) for r in reqs]


def working_set_tokens(reqs: list, page: int) -> int:
    """Distinct prompt tokens at page granularity: distinct chained (prefix-identified) whole pages x page."""
    seen: set[int] = set()
    for r in reqs:
        ids = r.input_ids
        key = 0
        for i in range(len(ids) // page):
            key = hash((key, tuple(ids[i * page : (i + 1) * page])))
            seen.add(key)
    return len(seen) * page


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
        srv = SGLangServer.start(
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
    the replay, collapsed stacks to `out` (read them with `benchmarks/profile_summary.py`)."""
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


# ------------------------------------------------------------------------------------------ summary
def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


METRICS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "latency_mean_s", "hit_rate")
RATIO_METRICS = METRICS[:5]  # hit rates are compared as tokens, not as a ratio


def summarize(samples: list[dict[str, Any]], pools: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for frac in pools:
        ps = [s for s in samples if s["pool_frac"] == frac]
        ran = [c for c in CONFIGS if c in {s["config"] for s in samples}]
        per: dict[str, Any] = {}
        for c in ran:
            ok = [s for s in ps if s["config"] == c and "error" not in s]
            per[c] = {
                "runs": len(ok),
                "runs_failed": len([s for s in ps if s["config"] == c]) - len(ok),
                "requests_failed": sum(s["requests_failed"] for s in ok),
                **{m: _med([s[m] for s in ok]) for m in METRICS},
                "hit_tokens": {t: _med([s["hit_tokens"][t] for s in ok]) for t in TIERS},
                "prefill_batches": _med([s["prefill_batches"]["batches"] for s in ok if s.get("prefill_batches")]),
                "mean_new_seqs_per_prefill": _med(
                    [
                        s["prefill_batches"]["mean_new_seqs"]
                        for s in ok
                        if s.get("prefill_batches") and s["prefill_batches"]["mean_new_seqs"]
                    ]
                ),
            }
        ratios: dict[str, Any] = {}
        paired: dict[str, Any] = {}
        for peer in (c for c in ran if c != "sgl_hicache" and "sgl_hicache" in ran):
            key = f"sgl_hicache / {peer}"
            ratios[key] = {
                m: (per["sgl_hicache"][m] / per[peer][m]) if per["sgl_hicache"][m] and per[peer][m] else None
                for m in RATIO_METRICS
            }
            pr: dict[str, list[float]] = {m: [] for m in RATIO_METRICS}
            for r in sorted({s["repeat"] for s in ps}):
                mine = [s for s in ps if s["repeat"] == r and s["config"] == "sgl_hicache" and "error" not in s]
                theirs = [s for s in ps if s["repeat"] == r and s["config"] == peer and "error" not in s]
                if mine and theirs:
                    for m in pr:
                        if theirs[0][m]:
                            pr[m].append(mine[0][m] / theirs[0][m])
            paired[key] = {m: {"median": _med(v), "samples": v} for m, v in pr.items()}
        out[f"{frac:g}"] = {
            "max_total_tokens": ps[0]["max_total_tokens"] if ps else None,
            "configs": per,
            "ratios": ratios,
            "paired_ratios": paired,
        }
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(summary: dict[str, Any], ws: int) -> str:
    lines = []
    for frac, s in summary.items():
        lines.append(
            f"device pool {float(frac):.0%} of the working set ({ws:,} tokens): --max-total-tokens {s['max_total_tokens']}"
        )
        lines.append(
            f"  {'config':<30} {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'tok/s':>7} {'e2e s':>6} {'hit dev':>8} {'host':>7} {'disk':>7} {'hit %':>6} {'fail':>5} {'prefills':>8} {'seq/pf':>6}"
        )
        for c in s["configs"]:
            r = s["configs"][c]
            h = r["hit_tokens"]
            lines.append(
                f"  {LABELS[c]:<30} {_f(r['ttft_mean_s'], '9.3f')} {_f(r['ttft_p50_s'], '7.3f')} {_f(r['ttft_p90_s'], '7.3f')} "
                f"{_f(r['throughput_tok_s'], '7.0f')} {_f(r.get('latency_mean_s'), '6.3f')} {_f(h['device'], '8,.0f')} {_f(h['host'], '7,.0f')} {_f(h['disk'], '7,.0f')} "
                f"{_f(r['hit_rate'] and 100 * r['hit_rate'], '6.1f')} {r['requests_failed'] + r['runs_failed']:>5} "
                f"{_f(r.get('prefill_batches'), '8.0f')} {_f(r.get('mean_new_seqs_per_prefill'), '6.2f')}"
            )
        for k, rr in s["ratios"].items():
            lines.append(
                f"  {k:<30} {_f(rr['ttft_mean_s'], '9.2f')} {_f(rr['ttft_p50_s'], '7.2f')} {_f(rr['ttft_p90_s'], '7.2f')} "
                f"{_f(rr['throughput_tok_s'], '7.2f')} {_f(rr.get('latency_mean_s'), '6.2f')}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def _git_rev() -> str | None:
    import subprocess

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "sgl_hicache"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty(sgl_hicache/)" if dirty else "")) or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=200, help="first N requests of the trace (default 200)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument(
        "--pools", default="0.1,0.3", help="device pool sizes as fractions of the working set (default 0.1,0.3)"
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="py-spy each run's scheduler process during the replay (collapsed stacks DIR/<run>.txt)",
    )
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"subset of {','.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)}; hicache_host: HiCache without a storage backend)",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny: 8 requests, 1 repeat, the first pool only (proves it runs)"
    )
    p.add_argument("--json", help="write all samples and the summary here")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument(
        "--as-blocks",
        action="store_true",
        help="--trace is a plain-text trace (`benchmarks/agentic_trace.py`): replay it rewritten as ~512-token "
        "blocks (`first_run_drops.as_block_trace`), so --scale shrinks it like a block trace",
    )
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--scale", type=int, default=32, help="tokens per 512-token trace block (default 32)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="requests in flight at most (default 4; a closed loop unless --time-scale is given)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="S",
        help="open loop: send each request at its trace timestamp x S (at most --concurrency in flight); "
        "default: closed loop, the next request as soon as one finishes",
    )
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument(
        "--host-ratio",
        type=float,
        default=4.0,
        help="host tier = R x device pool, for both HiCache and sgl_hicache (default 4)",
    )
    p.add_argument(
        "--disk-tokens", type=int, default=None, help="sgl_hicache disk tier capacity (default 2x the working set)"
    )
    p.add_argument(
        "--sgl-hicache-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sgl_hicache backend setting (a BackendSettings field, JSON value), repeatable",
    )
    p.add_argument("--workdir", default=None, help="where the per-run temp dirs go (default: the system temp dir)")
    p.add_argument("--keep-logs", default=None, help="copy every server log into this directory")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.repeats = 8, 1
    a.sgl_hicache_extra = {}
    for item in a.sgl_hicache_set:
        key, sep, raw = item.partition("=")
        if not sep:
            p.error(f"--sgl-hicache-set wants KEY=VALUE, got {item!r}")
        try:
            a.sgl_hicache_extra[key.strip()] = json.loads(raw)
        except ValueError:
            a.sgl_hicache_extra[key.strip()] = raw
    try:
        BackendSettings().replace(**a.sgl_hicache_extra)
    except (TypeError, ValueError) as e:
        p.error(f"--sgl-hicache-set: {e}")
    pools = [float(x) for x in a.pools.split(",") if x.strip()]
    if a.quick:
        pools = pools[:1]
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: unknown {bad}; choose from {','.join(CONFIGS)}")
    if a.repeats < 1 or a.requests < 1 or not pools or any(not 0 < f <= 1 for f in pools):
        p.error("--requests and --repeats must be >= 1, --pools fractions in (0, 1]")
    if a.time_scale is not None and a.time_scale <= 0:
        p.error(f"--time-scale must be > 0, got {a.time_scale}")

    # a clean slate: no SGLHICACHE_* / HiCache file-backend variable of the caller's shell leaks into a run
    for k in [k for k in os.environ if k.startswith("SGLHICACHE_") or k == "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]:
        del os.environ[k]
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    if a.as_blocks:
        from first_run_drops import as_block_trace  # (benchmarks/, this script's directory)

        try:
            a.trace = as_block_trace(a.trace, Path(tempfile.mkdtemp(prefix="server-compare-blocks-")) / "blocks.jsonl")
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--as-blocks: {a.trace} is not a plain-text trace: {e}")
    reqs = load_slice(a.trace, a.requests, a.scale, vocab, a.output_tokens)
    ws = working_set_tokens(reqs, a.page_size)
    longest = max(len(r.input_ids) for r in reqs)
    prompt_tokens = sum(len(r.input_ids) for r in reqs)
    if a.disk_tokens is None:
        a.disk_tokens = 2 * ws
    pool_of = {f: pool_tokens(f, ws, longest, a.output_tokens, a.page_size) for f in pools}
    workdir = Path(a.workdir or tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)

    print(
        f"slice: {len(reqs)} requests, {prompt_tokens:,} prompt tokens, working set {ws:,} tokens "
        f"(ideal hit rate {1 - ws / prompt_tokens:.1%}), longest {longest:,}; pools "
        + ", ".join(f"{f:g}: {t:,}" for f, t in pool_of.items()),
        flush=True,
    )

    def _terminate(signum, _frame):  # SIGTERM -> unwind, so every `finally` stops its server
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    samples: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for r in range(a.repeats):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for frac in pools:
            for pos, c in enumerate(order):
                tag = f"r{r}-p{frac:g}-{c}"
                s = run_one(c, pool_of[frac], reqs, a, workdir, tag)
                s.update(repeat=r, pool_frac=frac, order_pos=pos)
                samples.append(s)
                if "error" in s:
                    msg = "ERROR " + s["error"].splitlines()[0][:200]
                else:
                    h = s["hit_tokens"]
                    msg = (
                        f"TTFT mean {s['ttft_mean_s']:.3f}s p90 {s['ttft_p90_s']:.3f}s, {s['throughput_tok_s']:.0f} tok/s, "
                        f"hits {h['device']}/{h['host']}/{h['disk']} ({s['hit_rate']:.1%}), failed {s['requests_failed']}"
                    )
                print(
                    f"[{time.monotonic() - t_start:6.0f}s] {tag:<24} {msg} (run {s['wall_s']:.0f}s, load {s['loadavg_before'][0]:.1f})",
                    flush=True,
                )
                if a.json:  # partial results survive an interrupted run
                    Path(a.json).write_text(
                        json.dumps({"benchmark": "server_compare", "partial": True, "samples": samples}, indent=1)
                    )

    summary = summarize(samples, pools)
    print(render(summary, ws))
    result = {
        "benchmark": "server_compare",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": {
            "quick": a.quick,
            "requests": len(reqs),
            "repeats": a.repeats,
            "pools": pools,
            "configs": configs,
            "trace": str(a.trace),
            "scale": a.scale,
            "model": str(a.model),
            "page_size": a.page_size,
            "concurrency": a.concurrency,
            "time_scale": a.time_scale,
            "output_tokens": a.output_tokens,
            "host_ratio": a.host_ratio,
            "disk_tokens": a.disk_tokens,
            "sgl_hicache_extra": a.sgl_hicache_extra,
            "git": _git_rev(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "server_args": {c: server_args(c, 0, a.page_size, a.host_ratio) for c in configs},
        },
        "workload": {
            "prompt_tokens": prompt_tokens,
            "working_set_tokens": ws,
            "longest_prompt": longest,
            "ideal_hit_rate": 1 - ws / prompt_tokens,
            "max_total_tokens": {f"{f:g}": t for f, t in pool_of.items()},
        },
        "wall_s": time.monotonic() - t_start,
        "summary": summary,
        "samples": samples,
        "note": (
            "ratios are sgl_hicache / peer of the medians across repeats: TTFT < 1 and throughput > 1 favour "
            "sgl_hicache. Hit tokens come from each reply's cached_tokens_details (storage -> disk)."
        ),
    }
    try:
        import sglang

        result["sglang_version"] = getattr(sglang, "__version__", None)
    except Exception:  # noqa: BLE001
        result["sglang_version"] = None
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 1 if all("error" in s for s in samples) else 0


if __name__ == "__main__":
    raise SystemExit(main())
