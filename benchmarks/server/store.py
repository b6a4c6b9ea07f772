"""Two real SGLang servers sharing one Mooncake Store, two ways, side by side: sgl_hicache's store tier
(`--radix-cache-backend sgl_hicache`, `SGLHICACHE_STORE=mooncake://...`) vs SGLang's own HiCache with
`--hicache-storage-backend mooncake`.

    scripts/install_hicache_peer.sh                     # once: the HiCache peer's venv (.venv-hicache-peer)
    .venv-sglang/bin/python -m benchmarks.server.store --json store_compare.json
    .venv-sglang/bin/python -m benchmarks.server.store --quick --json quick.json   # 1 repeat, 2 conversations

The run: one local Mooncake Store (a master + one holder, `sgl_hicache.tiers.store_local`), four
servers on it for the whole run (sgl_hicache A + B, HiCache A + B), the same model
(`scripts/cpu/bench-llama`, dummy weights), page size, device pool and host pool (`--host-ratio` x
the device pool for both). Each repeat makes `--conversations` fresh conversations (random token ids,
seeded by the repeat, identical for both systems) and, per system, in rotated order (A B, then B A, ...):

1. **turn N on server A**: every conversation's first prompt (`--turn1-tokens`), concurrency 4,
   `--output-tokens` greedy output tokens each;
2. **settle**: A's pages reach the store in the background. sgl_hicache's write-back advances only
   when a request reaches the cache, so (for both systems alike) A gets one fixed two-page prompt
   every 0.5 s until the master's put counter has not moved for 2 s (at most `--settle-timeout`);
3. **turn N+1 on server B**, which never saw turn N: turn N + its output + `--turn2-new-tokens` new
   tokens, concurrency 4. B's prefix can only come from the store;
4. **idle**: nothing is sent; once the master's put counter has been still for 2 s (puts B started
   during its phase land first, counted as `store_after_turn_n1`), the puts over `--idle-s` seconds.

Per phase: TTFT (mean / p50), throughput ((prompt + output tokens) / wall time), hit tokens per tier
from each reply's `cached_tokens_details` (device / host / storage), and the Mooncake master's own
counters (objects put, bytes allocated, put failures): the store's view, the same for both systems.
Ratios are sgl_hicache / HiCache of the medians across repeats (TTFT < 1, throughput > 1 favour
sgl_hicache), plus the per-repeat paired ratios.

The HiCache peer: SGLang 0.5.23's mooncake backend forces the `page_first_direct` host layout, whose
copy kernels exist only in the CUDA build; `reference/mooncake-store/hicache-peer-plugin` supplies
pure-torch versions through the `sglang.srt.plugins` entry point. It is installed into its own venv
(`scripts/install_hicache_peer.sh`), never into `.venv-sglang`, where it would load into every server.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import REPO
from benchmarks.lib.report import fmt, med
from benchmarks.lib.server_runs import DEFAULT_MODEL, start_server
from sgl_hicache.client.server import SGLangServer
from sgl_hicache.replay.http import replay_http
from sgl_hicache.replay.trace import Request
from sgl_hicache.tiers.store_local import LocalStore, start_mooncake

DEFAULT_PEER_PYTHON = REPO / ".venv-hicache-peer" / "bin" / "python"
SYSTEMS = ("sgl_hicache", "hicache")
LABELS = {"sgl_hicache": "sgl_hicache store tier", "hicache": "SGLang HiCache + mooncake"}
TIERS = ("device", "host", "disk")  # replay_http's names: "disk" is SGLang's "storage" (the store here)
PUT_ITEMS = ("master_batch_put_start_items_total", "master_put_start_requests_total")
PUT_FAILED = ("master_batch_put_start_failed_items_total", "master_put_start_failures_total")


# ------------------------------------------------------------------------------------------ servers
def server_args(
    system: str,
    pool: int,
    page: int,
    host_ratio: float,
    store: LocalStore,
    prefetch_policy: str = "timeout",
    log_level: str = "warning",
) -> list[str]:
    args = ["--page-size", str(page), "--max-total-tokens", str(pool), "--enable-metrics", "--log-level", log_level]
    if system == "hicache":
        extra = {
            "master_server_address": f"127.0.0.1:{store.ports['master']}",
            "metadata_server": f"http://127.0.0.1:{store.ports['http']}/metadata",
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": 0,
            "local_hostname": "127.0.0.1",
        }
        args += [
            "--enable-hierarchical-cache",
            "--hicache-io-backend",
            "direct",
            "--hicache-mem-layout",
            "layer_first",
            "--hicache-ratio",
            f"{host_ratio:g}",
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-storage-backend-extra-config",
            json.dumps(extra),
            "--hicache-storage-prefetch-policy",
            prefetch_policy,
        ]
    else:
        args += ["--radix-cache-backend", "sgl_hicache"]
    return args


def server_env(
    system: str, pool: int, page: int, host_ratio: float, store: LocalStore, extra: dict[str, str]
) -> dict[str, str]:
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "PYTHONPATH": str(REPO)}
    if system == "hicache":
        # HiCache wants 10 GiB free beyond its pool (a GPU-node margin) or refuses to start; this
        # shared 24 GiB machine rarely has it. Its pool is the same either way (the CPU test layer, sglang_cpu_layer.patches).
        env["SGLHICACHE_CPU_HICACHE_HOST_RESERVE_BYTES"] = str(1 << 30)
    else:
        env.update(
            {
                "SGLHICACHE_STORE": store.url,
                "SGLHICACHE_HOST_TOKENS": str(int(pool * host_ratio) // page * page),
                # HiCache's write_through sends every computed page down to host and on to its storage;
                # the same here: every computed page goes to host, and every host page to the store
                "SGLHICACHE_DEVICE_WRITEBACK_CLEAN_FRACTION": "1.0",
                "SGLHICACHE_WRITEBACK_CLEAN_FRACTION": "1.0",
            }
        )
        env.update(extra)
    return env


# ------------------------------------------------------------------------------------------ workload
def conversations(repeat: int, n: int, turn1: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1000 + repeat)
    return [[rng.randrange(16, vocab) for _ in range(turn1)] for _ in range(n)]


def _requests(prompts: list[list[int]], tag: str, out: int) -> list[Request]:
    return [
        Request(
            request_id=f"{tag}-{i}",
            session=f"{tag}-{i}",
            arrival_s=0.0,
            input_ids=array("q", p),
            output_length=out,
            line=i + 1,
        )
        for i, p in enumerate(prompts)
    ]


def _put_items(m: dict[str, float]) -> float:
    return sum(m.get(k, 0.0) for k in PUT_ITEMS)


def _store_view(m0: dict[str, float], m1: dict[str, float]) -> dict[str, float]:
    return {
        "puts": _put_items(m1) - _put_items(m0),
        "puts_failed": sum(m1.get(k, 0.0) - m0.get(k, 0.0) for k in PUT_FAILED),
        "keys_added": m1.get("master_key_count", 0.0) - m0.get("master_key_count", 0.0),
        "bytes_added": m1.get("master_allocated_bytes", 0.0) - m0.get("master_allocated_bytes", 0.0),
        "evicted_keys": m1.get("master_evicted_key_count", 0.0) - m0.get("master_evicted_key_count", 0.0),
    }


def _phase(rep: dict[str, Any]) -> dict[str, Any]:
    t = rep["ttft_s"]
    return {
        "requests": rep["requests"],
        "requests_failed": rep["requests_failed"],
        "first_error": rep["errors"].get("first_error"),
        "prompt_tokens": rep["prompt_tokens"],
        "ttft_mean_s": t["mean"],
        "ttft_p50_s": t["p50"],
        "throughput_tok_s": rep["throughput_tok_s"],
        "duration_s": rep["duration_s"],
        "hit_tokens": dict(rep["hit_tokens"]),
    }


def settle(
    srv: SGLangServer, store: LocalStore, poke: list[int], timeout_s: float, quiet_s: float = 2.0
) -> dict[str, Any]:
    """Send A one fixed prompt every 0.5 s until the master's put counter is still for `quiet_s`."""
    t0 = time.monotonic()
    last, still_since, pokes = _put_items(store.master_metrics()), time.monotonic(), 0
    while time.monotonic() - t0 < timeout_s:
        srv.post("/generate", {"input_ids": poke, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        pokes += 1
        time.sleep(0.5)
        now = _put_items(store.master_metrics())
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            return {"settle_s": time.monotonic() - t0, "pokes": pokes, "timed_out": False}
    return {"settle_s": time.monotonic() - t0, "pokes": pokes, "timed_out": True}


def run_pair(
    system: str,
    pair: tuple[SGLangServer, SGLangServer],
    store: LocalStore,
    prompts: list[list[int]],
    a: argparse.Namespace,
    repeat: int,
) -> dict[str, Any]:
    srv_a, srv_b = pair
    sample: dict[str, Any] = {"system": system, "repeat": repeat, "loadavg_before": os.getloadavg()}
    m0 = store.master_metrics()
    rep1 = replay_http(
        _requests(prompts, f"r{repeat}-t1", a.output_tokens),
        srv_a.url,
        concurrency=a.concurrency,
        max_new_tokens=a.output_tokens,
        keep_outputs=True,
        timeout_s=a.request_timeout,
    )
    sample["turn_n_on_a"] = _phase(rep1)
    m1 = store.master_metrics()
    sample["store_during_turn_n"] = _store_view(m0, m1)
    poke = [17 + (repeat * 31 + len(system)) % 50] * (2 * a.page_size)  # same per (system, repeat): written once
    sample["settle"] = settle(srv_a, store, poke, a.settle_timeout)
    m2 = store.master_metrics()
    sample["store_during_settle"] = _store_view(m1, m2)
    outs = {r["request_id"]: r["output_ids"] for r in rep1.get("records", [])}
    rng = random.Random(5000 + repeat)
    turn2 = [
        p + list(outs.get(f"r{repeat}-t1-{i}", [])) + [rng.randrange(16, a.vocab) for _ in range(a.turn2_new_tokens)]
        for i, p in enumerate(prompts)
    ]
    sample["turn_n_tokens"] = [len(p) + len(outs.get(f"r{repeat}-t1-{i}", [])) for i, p in enumerate(prompts)]
    rep2 = replay_http(
        _requests(turn2, f"r{repeat}-t2", a.output_tokens),
        srv_b.url,
        concurrency=a.concurrency,
        max_new_tokens=a.output_tokens,
        timeout_s=a.request_timeout,
    )
    sample["turn_n1_on_b"] = _phase(rep2)
    m3 = store.master_metrics()
    sample["store_during_turn_n1"] = _store_view(m2, m3)
    # puts B started during its phase land after it: wait (sending nothing) until the counter is still
    t0, last, still_since = time.monotonic(), _put_items(m3), time.monotonic()
    while time.monotonic() - still_since < 2.0 and time.monotonic() - t0 < a.settle_timeout:
        time.sleep(0.25)
        now = _put_items(store.master_metrics())
        if now != last:
            last, still_since = now, time.monotonic()
    m4 = store.master_metrics()
    sample["store_after_turn_n1"] = _store_view(m3, m4)
    time.sleep(a.idle_s)
    sample["store_during_idle"] = _store_view(m4, store.master_metrics())
    sample["idle_s"] = a.idle_s
    sample["loadavg_after"] = os.getloadavg()
    return sample


_PREFETCH_LINE = re.compile(r"HiCache prefetch (\w+) req=\S+ completed=(\d+) matched=(\d+) loaded=(\d+)")


def hicache_prefetch_lines(log: Path) -> dict[str, Any]:
    """What HiCache server B said about its storage prefetches (info log level): how many finished,
    and the tokens they completed / loaded. Prefetches that never finish log nothing."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    found = _PREFETCH_LINE.findall(text)
    return {
        "finished": len(found),
        "by_outcome": {o: sum(1 for f in found if f[0] == o) for o in {f[0] for f in found}},
        "completed_tokens": sum(int(f[1]) for f in found),
        "loaded_tokens": sum(int(f[3]) for f in found),
        "declined_lines": text.count("HiCache prefetch declined"),
    }


# ------------------------------------------------------------------------------------------ summary
def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for s_name in SYSTEMS:
        ok = [s for s in samples if s["system"] == s_name and "error" not in s]
        row: dict[str, Any] = {"runs": len(ok)}
        for phase in ("turn_n_on_a", "turn_n1_on_b"):
            row[phase] = {m: med([s[phase][m] for s in ok]) for m in ("ttft_mean_s", "ttft_p50_s", "throughput_tok_s")}
            row[phase]["hit_tokens"] = {t: med([s[phase]["hit_tokens"][t] for s in ok]) for t in TIERS}
            row[phase]["requests_failed"] = sum(s[phase]["requests_failed"] for s in ok)
        row["turn_n_tokens"] = med([sum(s["turn_n_tokens"]) for s in ok])
        for view in (
            "store_during_turn_n",
            "store_during_settle",
            "store_during_turn_n1",
            "store_after_turn_n1",
            "store_during_idle",
        ):
            row[view] = {k: med([s[view][k] for s in ok]) for k in ("puts", "puts_failed", "keys_added", "bytes_added")}
        row["settle_s"] = med([s["settle"]["settle_s"] for s in ok])
        row["settle_timed_out"] = sum(s["settle"]["timed_out"] for s in ok)
        per[s_name] = row
    ratios: dict[str, Any] = {}
    paired: dict[str, Any] = {}
    if all(per[s]["runs"] for s in SYSTEMS):
        for phase in ("turn_n_on_a", "turn_n1_on_b"):
            mine, theirs = per["sgl_hicache"][phase], per["hicache"][phase]
            ratios[phase] = {
                m: mine[m] / theirs[m] if mine[m] and theirs[m] else None
                for m in ("ttft_mean_s", "ttft_p50_s", "throughput_tok_s")
            }
            pr: dict[str, list[float]] = {m: [] for m in ratios[phase]}
            for r in sorted({s["repeat"] for s in samples}):
                x = [s for s in samples if s["repeat"] == r and s["system"] == "sgl_hicache" and "error" not in s]
                y = [s for s in samples if s["repeat"] == r and s["system"] == "hicache" and "error" not in s]
                if x and y:
                    for m in pr:
                        if y[0][phase][m]:
                            pr[m].append(x[0][phase][m] / y[0][phase][m])
            paired[phase] = {m: {"median": med(v), "samples": v} for m, v in pr.items()}
    return {"systems": per, "ratios": ratios, "paired_ratios": paired}


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"  {'system':<28} {'phase':<12} {'TTFT mean':>9} {'p50':>7} {'tok/s':>7} {'dev':>7} {'host':>7} {'storage':>8} "
        f"{'puts':>7} {'MB put':>7} {'idle puts':>9}"
    ]
    for s_name, row in summary["systems"].items():
        for phase, label in (("turn_n_on_a", "turn N, A"), ("turn_n1_on_b", "turn N+1, B")):
            r, h = row[phase], row[phase]["hit_tokens"]
            views = (
                ("store_during_turn_n1", "store_after_turn_n1")
                if phase == "turn_n1_on_b"
                else ("store_during_turn_n", "store_during_settle")
            )
            puts = sum(row[v]["puts"] or 0 for v in views)
            mb = sum(row[v]["bytes_added"] or 0 for v in views)
            lines.append(
                f"  {LABELS[s_name]:<28} {label:<12} {fmt(r['ttft_mean_s'], '9.3f')} {fmt(r['ttft_p50_s'], '7.3f')} "
                f"{fmt(r['throughput_tok_s'], '7.0f')} {fmt(h['device'], '7,.0f')} {fmt(h['host'], '7,.0f')} {fmt(h['disk'], '8,.0f')} "
                f"{fmt(puts, '7,.0f')} {fmt(mb and mb / 1e6, '7.1f')} {fmt(row['store_during_idle']['puts'], '9,.0f')}"
            )
    for phase, rr in summary["ratios"].items():
        lines.append(
            f"  {'sgl_hicache / HiCache':<28} {phase:<12} {fmt(rr['ttft_mean_s'], '9.2f')} {fmt(rr['ttft_p50_s'], '7.2f')} "
            f"{fmt(rr['throughput_tok_s'], '7.2f')}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--conversations", type=int, default=6, help="conversations per repeat (default 6)")
    p.add_argument("--turn1-tokens", type=int, default=1024, help="turn N prompt tokens (default 1024)")
    p.add_argument("--turn2-new-tokens", type=int, default=128, help="new tokens of turn N+1 (default 128)")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=12288, help="device pool of every server (default 12288)")
    p.add_argument(
        "--host-ratio", type=float, default=2.0, help="host pool = R x device pool, both systems (default 2)"
    )
    p.add_argument("--segment-mb", type=int, default=1024, help="the Mooncake holder's memory (default 1024 MiB)")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle window after each pair's turn N+1 (default 3 s)")
    p.add_argument("--settle-timeout", type=float, default=60.0)
    p.add_argument(
        "--hicache-prefetch-policy",
        default="timeout",
        choices=("timeout", "wait_complete", "best_effort"),
        help="HiCache's --hicache-storage-prefetch-policy (default timeout, SGLang's default)",
    )
    p.add_argument(
        "--hicache-log-level",
        default="info",
        help="HiCache servers' --log-level (default info: its 'HiCache prefetch' lines are counted)",
    )
    p.add_argument(
        "--sgl-hicache-env",
        action="append",
        default=[],
        metavar="SGLHICACHE_X=VALUE",
        help="extra environment for the sgl_hicache servers, repeatable",
    )
    p.add_argument("--quick", action="store_true", help="1 repeat, 2 conversations (proves it runs)")
    p.add_argument("--json", help="write all samples and the summary here")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument(
        "--peer-python",
        type=Path,
        default=DEFAULT_PEER_PYTHON,
        help="python of the HiCache peer venv (scripts/install_hicache_peer.sh)",
    )
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--keep-logs", default=None, help="copy every server log into this directory")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.conversations = 1, 2
    if min(a.repeats, a.conversations, a.turn1_tokens, a.concurrency) < 1 or a.turn2_new_tokens < 0:
        p.error("--repeats, --conversations, --turn1-tokens and --concurrency must be >= 1")
    if not a.peer_python.exists():
        p.error(
            f"--peer-python {a.peer_python}: not found; build the HiCache peer venv with scripts/install_hicache_peer.sh"
        )
    extra_env: dict[str, str] = {}
    for item in a.sgl_hicache_env:
        k, sep, v = item.partition("=")
        if not sep or not k.startswith("SGLHICACHE_"):
            p.error(f"--sgl-hicache-env wants SGLHICACHE_X=VALUE, got {item!r}")
        extra_env[k] = v
    for k in [k for k in os.environ if k.startswith("SGLHICACHE_")]:
        del os.environ[k]  # a clean slate: nothing of the caller's shell leaks into a server
    a.vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]

    def _terminate(signum, _frame):  # SIGTERM -> unwind, so every `finally` stops its processes
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    workdir = Path(tempfile.mkdtemp(prefix="store-compare-"))
    t_start = time.monotonic()
    samples: list[dict[str, Any]] = []
    servers: dict[str, list[SGLangServer]] = {s: [] for s in SYSTEMS}
    store = start_mooncake(a.segment_mb)
    try:
        pending = []
        for s_name in SYSTEMS:
            python = str(a.peer_python) if s_name == "hicache" else sys.executable
            for side in ("a", "b"):
                srv = start_server(
                    a.model,
                    python=python,
                    load_format="dummy",
                    wait=False,
                    log_path=workdir / f"{s_name}-{side}.log",
                    extra_args=server_args(
                        s_name,
                        a.max_total_tokens,
                        a.page_size,
                        a.host_ratio,
                        store,
                        a.hicache_prefetch_policy,
                        a.hicache_log_level if s_name == "hicache" else "warning",
                    ),
                    env=server_env(s_name, a.max_total_tokens, a.page_size, a.host_ratio, store, extra_env),
                )
                servers[s_name].append(srv)
                pending.append(srv)
        for srv in pending:
            srv.wait_healthy(a.start_timeout)
        print(f"[{time.monotonic() - t_start:5.0f}s] 4 servers up on {store.url}", flush=True)
        for r in range(a.repeats):
            prompts = conversations(r, a.conversations, a.turn1_tokens, a.vocab)
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for s_name in order:
                try:
                    s = run_pair(s_name, (servers[s_name][0], servers[s_name][1]), store, prompts, a, r)
                except Exception as e:  # noqa: BLE001  (record it, go on with the next run)
                    s = {"system": s_name, "repeat": r, "error": f"{type(e).__name__}: {e}"[:2000]}
                samples.append(s)
                if "error" in s:
                    print(
                        f"[{time.monotonic() - t_start:5.0f}s] r{r} {s_name:<12} ERROR {s['error'][:300]}", flush=True
                    )
                else:
                    b = s["turn_n1_on_b"]
                    print(
                        f"[{time.monotonic() - t_start:5.0f}s] r{r} {s_name:<12} A: TTFT {s['turn_n_on_a']['ttft_mean_s']:.3f}s; "
                        f"settle {s['settle']['settle_s']:.1f}s ({s['settle']['pokes']} pokes); "
                        f"B: TTFT {b['ttft_mean_s']:.3f}s, {b['throughput_tok_s']:.0f} tok/s, hits {b['hit_tokens']}, "
                        f"failed {b['requests_failed']}; store puts A/B/idle {s['store_during_turn_n']['puts'] + s['store_during_settle']['puts']:.0f}"
                        f"/{s['store_during_turn_n1']['puts'] + s['store_after_turn_n1']['puts']:.0f}/{s['store_during_idle']['puts']:.0f}",
                        flush=True,
                    )
                if a.json:
                    Path(a.json).write_text(
                        json.dumps({"benchmark": "store_compare", "partial": True, "samples": samples}, indent=1)
                    )
    finally:
        for srv in (x for v in servers.values() for x in v):
            srv.stop()
        prefetch_log = hicache_prefetch_lines(workdir / "hicache-b.log")
        if a.keep_logs:
            import shutil

            Path(a.keep_logs).mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log"):
                shutil.copy(log, Path(a.keep_logs) / log.name)
        store.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)

    summary = summarize(samples)
    print(render(summary))
    print(f"HiCache B's storage prefetches (its log): {prefetch_log}")
    result = {
        "benchmark": "store_compare",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "server_args": {
            s: server_args(s, a.max_total_tokens, a.page_size, a.host_ratio, store, a.hicache_prefetch_policy)
            for s in SYSTEMS
        },
        "hicache_b_prefetch_log": prefetch_log,
        "wall_s": time.monotonic() - t_start,
        "summary": summary,
        "samples": samples,
        "note": (
            "ratios: sgl_hicache / HiCache of the medians across repeats (TTFT < 1 and throughput > 1 favour "
            "sgl_hicache). Hit tokens from each reply's cached_tokens_details (storage -> 'disk'). Store puts, "
            "keys and bytes: the Mooncake master's own metrics, per phase."
        ),
    }
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 1 if not samples or all("error" in s for s in samples) else 0


if __name__ == "__main__":
    raise SystemExit(main())
