"""Re-warm at start on the real SGLang server: TTFT of the first requests after a restart, with
re-warm on and off, on the same disk directory.

    .venv-sglang/bin/python -m benchmarks.server.rewarm [--repeats 3] [--json benchmarks/results/rewarm_server.json]
    .venv-sglang/bin/python -m benchmarks.server.rewarm --quick --json /tmp/q.json   # 1 repeat, 3 conversations

Each repeat (fresh token ids, seeded by the repeat) on a real SGLang 0.5.23 server on CPU with
`--radix-cache-backend sgl_hicache`, `scripts/cpu/bench-llama` with dummy weights:

1. **before the stop**: a server on a fresh disk directory, re-warm on with its record saved every
   `--record-interval` s (`SGLHICACHE_REWARM_INTERVAL_S`; 30 s by default), serves `--turns` turns of
   `--conversations` conversations (a private `--prefix`-token prompt each, then `--turn-tokens` new
   tokens a turn on top of the previous turn and its output), concurrency 4. The device pool holds
   fewer than two conversations, host all of them, and every page is written through to disk. The benchmark
   then reads the server's stats every 0.5 s (each read wakes the idle scheduler) until a re-warm
   record chosen after the last turn is written and the disk tier has not grown for 2 s. The disk
   directory is copied once per arm (a snapshot of the running server, as a crash leaves it);
2. **warm** (the reference): each conversation's next turn on that same server, then it is stopped
   (SGLang kills its scheduler: the periodic record is what the next server reads);
3. **restart**, one server per arm on its copy, in alternating order (on, off; then off, on; ...):
   `rewarm` (`SGLHICACHE_REWARM=1`) and `cold` (`=0`). In both arms the benchmark waits
   `--settle` s from the server's health answer before the first measured request, sending only the
   shared untimed warm-up prompts (`warm_up`: a fresh server's first batches of a shape are slow)
   and reading the stats once at the end; then each conversation's next turn, one at a time, in a
   seeded order. With SGLang's `--sleep-on-idle` (the CPU flags) an idle scheduler steps about once a
   second, and the re-warm brings one recorded path a step: the settle time must cover the record.

On a shared machine the measured servers (from their start in phase 3, from the warm turn in
phase 2) and this client run at `--nice` (-10; every thread, `renice`), so that other processes'
load moves their TTFT less; phase 1 runs at the caller's priority. The disk directory's files were
just written, so the restarted server reads them from the page cache; `--drop-page-cache` drops them
first (`POSIX_FADV_DONTNEED`), so that it reads them from the device, as after a reboot.

Per request: TTFT and the tier each cached token came from (`cached_tokens_details`); per arm: the
stats' `prefetch["rewarm"]` (tokens brought, used, never used, and those at the model's KV size in
bytes) and the re-warm's progress (`rewarm`: paths done, why it stopped). Per repeat: mean TTFT of
`rewarm` over `cold`, and the worst per-request ratio (the same request in both arms). The summary:
median and range over repeats. The issue's target: mean TTFT at least 30 % lower than `cold`
(ratio <= 0.70), no request more than 5 % slower (worst ratio <= 1.05). `--profile DIR`: py-spy
of the scheduler process over each restart's measured turn (`benchmarks.server.profile_summary`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from benchmarks.lib.report import fmt, git_rev, med
from benchmarks.lib.server_runs import DEFAULT_MODEL, TIERS, start_profiler, start_server, stop_profiler, warm_up
from sgl_hicache.client.server import SGLangServer
from sgl_hicache.client.stats_client import StatsError, fetch_stats
from sgl_hicache.replay.http import replay_http
from sgl_hicache.replay.trace import Request

ARMS = ("rewarm", "cold")
REWARM_KEYS = ("promoted_tokens", "used_tokens", "wasted_tokens")


# ------------------------------------------------------------------------------------------ workload
def conversations(repeat: int, a: argparse.Namespace) -> list[list[int]]:
    """Each conversation's private first prompt (`--prefix` + `--turn-tokens` ids), seeded by the repeat."""
    rng = random.Random(7000 + repeat)
    return [[rng.randrange(16, a.vocab) for _ in range(a.prefix + a.turn_tokens)] for _ in range(a.conversations)]


def turn(prompts: list[list[int]], tag: str, out: int) -> list[Request]:
    """One turn of every conversation, as requests (`<tag>-<conversation>`)."""
    return [Request(f"{tag}-{i}", f"c{i}", 0.0, array("q", p), out, i + 1) for i, p in enumerate(prompts)]


def next_turn(
    prompts: list[list[int]], rep: dict[str, Any], tag: str, rng: random.Random, a: argparse.Namespace
) -> list[list[int]]:
    """Each conversation's next prompt: its last prompt, the reply, `--turn-tokens` new ids."""
    outs = {r["request_id"]: r["output_ids"] for r in rep["records"]}
    new = a.turn_tokens
    return [
        p + outs.get(f"{tag}-{i}", []) + [rng.randrange(16, a.vocab) for _ in range(new)] for i, p in enumerate(prompts)
    ]


# ------------------------------------------------------------------------------------------ servers
def server_env(a: argparse.Namespace, disk: Path, rewarm: bool) -> dict[str, str]:
    return {
        "SGLHICACHE_HOST_TOKENS": str(a.host_tokens),
        "SGLHICACHE_DISK_DIR": str(disk),
        "SGLHICACHE_DISK_TOKENS": str(a.disk_tokens),
        "SGLHICACHE_REWARM": "1" if rewarm else "0",
        "SGLHICACHE_REWARM_INTERVAL_S": f"{a.record_interval:g}",
    }


def start(a: argparse.Namespace, disk: Path, rewarm: bool, log: Path) -> SGLangServer:
    return start_server(
        a.model,
        load_format="dummy",
        log_path=log,
        env=server_env(a, disk, rewarm),
        timeout_s=a.start_timeout,
        extra_args=[
            "--max-total-tokens",
            str(a.device_tokens),
            "--page-size",
            str(a.page_size),
            "--radix-cache-backend",
            "sgl_hicache",
            "--log-level",
            "warning",
        ],
    )


def renice(srv: SGLangServer | None, nice: int) -> bool:
    """Every thread of this process and of `srv`'s processes to `nice` (threads started later inherit
    it from the thread that starts them); False where the system refuses (no CAP_SYS_NICE). Linux
    keeps a nice value per thread, so each thread is set."""
    import psutil

    procs = [psutil.Process()]
    if srv is not None:
        root = psutil.Process(srv.proc.pid)
        procs += [root, *root.children(recursive=True)]
    try:
        for proc in procs:
            for t in proc.threads():
                os.setpriority(os.PRIO_PROCESS, t.id, nice)
    except (PermissionError, psutil.Error, ProcessLookupError):
        return False
    return True


def stats(url: str) -> dict[str, Any]:
    try:
        return fetch_stats(url)
    except StatsError:
        return {}


def wait_for_record(url: str, interval_s: float, timeout_s: float) -> dict[str, Any]:
    """Read the stats every 0.5 s (each read wakes the idle scheduler, which ticks the recorder and
    applies finished writes) for at least two record intervals, until every record handed over is
    written and the disk tier has not grown for 2 s. The recorder writes a record only when its choice
    changed, so after two intervals the last one written is the tree's final choice."""
    t0 = time.monotonic()
    disk, still_since = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
        st = stats(url)
        now = (st.get("stored_tokens") or {}).get("disk")
        if now != disk:
            disk, still_since = now, time.monotonic()
        rw = st.get("rewarm") or {}
        written = rw.get("records_written", 0)
        if (
            time.monotonic() - t0 >= 2 * interval_s
            and written >= 1
            and written == rw.get("records_saved")
            and time.monotonic() - still_since >= 2.0
        ):
            return {"wait_s": time.monotonic() - t0, "disk_tokens": disk, "rewarm": rw, "timed_out": False}
    return {"wait_s": time.monotonic() - t0, "disk_tokens": disk, "timed_out": True}


def drop_page_cache(folder: Path) -> int:
    """Flush `folder`'s files and ask the kernel to drop them from the page cache (POSIX_FADV_DONTNEED,
    no root needed): the restarted server then reads its disk tier from the device, as after a reboot
    or on a machine whose page cache no longer holds them. Returns the bytes dropped."""
    total = 0
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def measured_turn(url: str, reqs: list[Request], a: argparse.Namespace) -> dict[str, Any]:
    """The requests one at a time: per request TTFT and hits per tier; the report's totals."""
    rep = replay_http(reqs, url, concurrency=1, max_new_tokens=a.output_tokens, keep_outputs=True)
    return {
        "requests_failed": rep["requests_failed"],
        "first_error": rep["errors"].get("first_error"),
        "ttft_mean_s": rep["ttft_s"]["mean"],
        "ttft_s": {r["request_id"]: r["ttft_s"] for r in rep["records"] if r["error"] is None},
        "hits": {r["request_id"]: {t: r[f"hit_{t}"] for t in TIERS} for r in rep["records"]},
        "hit_tokens": {t: rep["hit_tokens"][t] for t in TIERS},
        "prompt_tokens": rep["prompt_tokens"],
        "outputs": {r["request_id"]: r["output_ids"] for r in rep["records"]},
    }


# ------------------------------------------------------------------------------------------ one repeat
def before_stop(r: int, a: argparse.Namespace, work: Path) -> tuple[dict[str, Any], list[Request], list[Path]]:
    """Phase 1 and 2 (module docstring): the figures, the measured next turns, a disk copy per arm."""
    disk = work / f"r{r}-disk"
    rng = random.Random(9000 + r)
    prompts = conversations(r, a)
    out: dict[str, Any] = {}
    srv = start(a, disk, True, work / f"r{r}-before.log")
    try:
        warm_up(srv.url, a.vocab, a.output_tokens)
        for k in range(a.turns):
            rep = replay_http(
                turn(prompts, f"t{k}", a.output_tokens),
                srv.url,
                concurrency=4,
                max_new_tokens=a.output_tokens,
                keep_outputs=True,
            )
            out[f"turn{k}"] = {
                "ttft_mean_s": rep["ttft_s"]["mean"],
                "hit_tokens": {t: rep["hit_tokens"][t] for t in TIERS},
            }
            if rep["requests_failed"]:
                raise RuntimeError(f"turn {k}: {rep['errors'].get('first_error')}")
            prompts = next_turn(prompts, rep, f"t{k}", rng, a)
        out["record"] = wait_for_record(srv.url, a.record_interval, a.record_timeout)
        if out["record"]["timed_out"]:
            raise RuntimeError(f"no re-warm record settled in {a.record_timeout:g} s: {out['record']}")
        st = stats(srv.url)
        out["stored_tokens"] = st.get("stored_tokens")
        copies = [work / f"r{r}-{arm}" for arm in ARMS]
        for c in copies:
            shutil.copytree(disk, c)
        order = list(range(len(prompts)))
        random.Random(r).shuffle(order)
        nxt = turn(prompts, "next", a.output_tokens)
        reqs = [nxt[i] for i in order][: a.first]
        out["reniced"] = a.nice != 0 and renice(srv, a.nice)
        out["warm"] = measured_turn(srv.url, reqs, a)
    finally:
        renice(None, 0)
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)
    return out, reqs, copies


def restart(arm: str, disk: Path, reqs: list[Request], a: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    """Phase 3 for one arm: a server on `disk`, the settle time, the measured turn; its figures."""
    dropped = drop_page_cache(disk) if a.drop_page_cache else None
    srv = start(a, disk, arm == "rewarm", work / f"{tag}.log")
    t_ready = time.monotonic()
    out: dict[str, Any] = {"arm": arm, "server_ready_s": srv.ready_after_s, "page_cache_dropped_bytes": dropped}
    spy = None
    try:
        out["reniced"] = a.nice != 0 and renice(srv, a.nice)
        warm_up(srv.url, a.vocab, a.output_tokens)
        out["warm_up_s"] = time.monotonic() - t_ready
        time.sleep(max(0.0, a.settle - (time.monotonic() - t_ready)))
        st = stats(srv.url)
        out["at_first_request"] = {"rewarm": st.get("rewarm"), "stored_tokens": st.get("stored_tokens")}
        out["settle_s"] = time.monotonic() - t_ready
        if a.profile:
            spy = start_profiler(srv.proc.pid, Path(a.profile) / f"{tag}.txt")
        out.update(measured_turn(srv.url, reqs, a))
        stop_profiler(spy)
        spy = None
        st = stats(srv.url)
        pf = (st.get("prefetch") or {}).get("rewarm") or {}
        out["rewarm_tokens"] = {k: pf.get(k) for k in REWARM_KEYS}
        out["rewarm"] = st.get("rewarm")
        out["bytes_moved"] = st.get("bytes_moved")
        if not srv.alive():
            out["error"] = "server died during the measured turn"
    finally:
        stop_profiler(spy)
        renice(None, 0)
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)
    return out


def one_repeat(r: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    sample: dict[str, Any] = {"repeat": r, "loadavg_before": os.getloadavg()}
    try:
        sample["before_stop"], reqs, copies = before_stop(r, a, work)
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        sample["order"] = list(order)
        for arm in order:
            sample[arm] = restart(arm, copies[ARMS.index(arm)], reqs, a, work, f"r{r}-{arm}")
    except Exception as e:  # noqa: BLE001  (record it, go on with the next repeat)
        sample["error"] = f"{type(e).__name__}: {e}"[:2000]
    sample["loadavg_after"] = os.getloadavg()
    if "error" not in sample:
        sample.update(ratios(sample))
    return sample


def ratios(s: dict[str, Any]) -> dict[str, Any]:
    """`rewarm` over `cold` of one repeat: mean TTFT, each request's, and whether outputs agree."""
    on, off = s["rewarm"]["ttft_s"], s["cold"]["ttft_s"]
    per = {k: on[k] / off[k] for k in on if k in off and off[k] > 0}
    same = {k for k, v in s["rewarm"]["outputs"].items() if s["cold"]["outputs"].get(k) == v}
    return {
        "mean_ratio": s["rewarm"]["ttft_mean_s"] / s["cold"]["ttft_mean_s"],
        "worst_ratio": max(per.values()) if per else None,
        "per_request_ratio": per,
        "outputs_equal": len(same) == len(s["rewarm"]["outputs"]),
    }


# ------------------------------------------------------------------------------------------ summary
def _spread(xs: list[float | None]) -> dict[str, float | None]:
    vals = [x for x in xs if x is not None]
    return {"median": med(xs), "min": min(vals) if vals else None, "max": max(vals) if vals else None}


def summarize(samples: list[dict[str, Any]], kv_bytes_per_token: int) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    out: dict[str, Any] = {"runs": len(ok), "runs_failed": len(samples) - len(ok)}
    out["ttft_mean_s"] = {
        "warm": _spread([s["before_stop"]["warm"]["ttft_mean_s"] for s in ok]),
        **{arm: _spread([s[arm]["ttft_mean_s"] for s in ok]) for arm in ARMS},
    }
    out["rewarm_over_cold_mean_ttft"] = _spread([s["mean_ratio"] for s in ok])
    out["rewarm_over_cold_worst_request"] = _spread([s["worst_ratio"] for s in ok])
    out["hit_tokens"] = {
        "warm": {t: med([s["before_stop"]["warm"]["hit_tokens"][t] for s in ok]) for t in TIERS},
        **{arm: {t: med([s[arm]["hit_tokens"][t] for s in ok]) for t in TIERS} for arm in ARMS},
    }
    unused = [
        (s["rewarm"]["rewarm_tokens"]["promoted_tokens"] or 0) - (s["rewarm"]["rewarm_tokens"]["used_tokens"] or 0)
        for s in ok
    ]
    out["rewarm_tokens"] = {k: _spread([s["rewarm"]["rewarm_tokens"][k] for s in ok]) for k in REWARM_KEYS}
    out["rewarm_unused_bytes"] = _spread([u * kv_bytes_per_token for u in unused])
    out["outputs_equal"] = all(s["outputs_equal"] for s in ok)
    out["target_met"] = bool(ok) and all(
        s["mean_ratio"] <= 0.70 and s["worst_ratio"] is not None and s["worst_ratio"] <= 1.05 for s in ok
    )
    return out


def render(summary: dict[str, Any]) -> str:
    def row(d: dict[str, Any], spec: str) -> str:
        return f"{fmt(d['median'], spec)} ({fmt(d['min'], spec)}-{fmt(d['max'], spec)})"

    t = summary["ttft_mean_s"]
    lines = [f"{arm:7s} mean TTFT: {row(t[arm], '.4f')} s, hits {summary['hit_tokens'][arm]}" for arm in t]
    lines.append(f"re-warm / cold, mean TTFT: {row(summary['rewarm_over_cold_mean_ttft'], '.3f')}")
    lines.append(f"re-warm / cold, worst request: {row(summary['rewarm_over_cold_worst_request'], '.3f')}")
    lines.append(f"re-warmed, never used: {row(summary['rewarm_unused_bytes'], ',.0f')} bytes")
    lines.append(f"runs {summary['runs']} (failed {summary['runs_failed']}); target met: {summary['target_met']}")
    return "\n".join(lines)


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer, bf16 (the model's config)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats, arms in alternating order (default 3)")
    p.add_argument("--conversations", type=int, default=8, help="conversations (default 8)")
    p.add_argument("--prefix", type=int, default=1024, help="tokens of each conversation's own first prompt")
    p.add_argument("--turn-tokens", type=int, default=32, help="new tokens a turn (default 32)")
    p.add_argument("--turns", type=int, default=2, help="turns before the stop (default 2)")
    p.add_argument("--first", type=int, default=None, help="measured requests after the restart (default: all)")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-tokens", type=int, default=2048, help="SGLang's --max-total-tokens (default 2048)")
    p.add_argument("--host-tokens", type=int, default=16384, help="host tier (default 16384: every conversation)")
    p.add_argument("--disk-tokens", type=int, default=65536)
    p.add_argument("--record-interval", type=float, default=2.0, help="SGLHICACHE_REWARM_INTERVAL_S (default 2)")
    p.add_argument("--record-timeout", type=float, default=120.0)
    p.add_argument("--settle", type=float, default=20.0, help="seconds from health to the first request (default 20)")
    p.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="drop the disk directory from the page cache before each restart (reads from the device)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="nice value of the measured servers and of this client while they run (default -10: on a "
        "shared machine the measured server gets the CPU first; 0 leaves it)",
    )
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--profile", default=None, help="py-spy the scheduler over each measured turn into this folder")
    p.add_argument("--quick", action="store_true", help="1 repeat, 3 conversations, 256-token prefixes")
    p.add_argument("--json", type=Path, default=None, help="write all samples and the summary here")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.conversations, a.prefix, a.settle = 1, 3, 256, 8.0
    a.first = a.first or a.conversations
    if min(a.repeats, a.conversations, a.turns, a.first) < 1:
        p.error("--repeats, --conversations, --turns and --first must be >= 1")
    for k in [k for k in os.environ if k.startswith("SGLHICACHE_")]:
        del os.environ[k]  # a clean slate: nothing of the caller's shell leaks into a server
    a.vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    kv = kv_bytes_per_token(a.model)

    def _terminate(signum, _frame):  # SIGTERM -> unwind, so every `finally` stops its server
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    work = Path(tempfile.mkdtemp(prefix="rewarm-server-"))
    t_start = time.monotonic()
    samples: list[dict[str, Any]] = []
    base = {
        "benchmark": "rewarm_server",
        "command": " ".join(["python -m benchmarks.server.rewarm", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "json"},
        "kv_bytes_per_token": kv,
    }
    try:
        for r in range(a.repeats):
            s = one_repeat(r, a, work)
            samples.append(s)
            if "error" in s:
                msg = "ERROR " + s["error"].splitlines()[0][:300]
            else:
                msg = (
                    f"warm {s['before_stop']['warm']['ttft_mean_s']:.4f}s, rewarm {s['rewarm']['ttft_mean_s']:.4f}s, "
                    f"cold {s['cold']['ttft_mean_s']:.4f}s: mean {s['mean_ratio']:.3f}, worst {s['worst_ratio']:.3f}; "
                    f"hits rewarm {s['rewarm']['hit_tokens']} cold {s['cold']['hit_tokens']}; "
                    f"re-warm {s['rewarm']['rewarm_tokens']} at first request {s['rewarm']['at_first_request']['rewarm']}"
                )
            print(f"[{time.monotonic() - t_start:6.0f}s] r{r} {msg}", flush=True)
            if a.json:  # partial results survive an interrupted run
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps({**base, "partial": True, "samples": samples}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(samples, kv)
    print(render(summary))
    result = {
        **base,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "git": git_rev(),
        "wall_s": time.monotonic() - t_start,
        "summary": summary,
        "samples": samples,
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0 if summary["runs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
