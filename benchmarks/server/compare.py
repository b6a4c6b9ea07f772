"""The real SGLang server, three ways, side by side: default cache vs SGLang's own HiCache vs sgl_hicache.

    .venv-sglang/bin/python -m benchmarks.server.compare --json server_compare.json
    .venv-sglang/bin/python -m benchmarks.server.compare --requests 150 --repeats 2 --json out.json
    .venv-sglang/bin/python -m benchmarks.server.compare --quick --json quick.json   # ~2 min here

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
import datetime as _dt
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE
from benchmarks.lib.report import fmt, git_rev, med
from benchmarks.lib.server_runs import (
    CONFIGS,
    DEFAULT_CONFIGS,
    DEFAULT_MODEL,
    LABELS,
    TIERS,
    load_slice,
    pool_tokens,
    run_one,
    server_args,
)
from benchmarks.lib.slices import working_set_tokens
from benchmarks.lib.traces import as_block_trace
from sgl_hicache.client.backend_settings import BackendSettings

# ------------------------------------------------------------------------------------------ summary
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
                **{m: med([s[m] for s in ok]) for m in METRICS},
                "hit_tokens": {t: med([s["hit_tokens"][t] for s in ok]) for t in TIERS},
                "prefill_batches": med([s["prefill_batches"]["batches"] for s in ok if s.get("prefill_batches")]),
                "mean_new_seqs_per_prefill": med(
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
            paired[key] = {m: {"median": med(v), "samples": v} for m, v in pr.items()}
        out[f"{frac:g}"] = {
            "max_total_tokens": ps[0]["max_total_tokens"] if ps else None,
            "configs": per,
            "ratios": ratios,
            "paired_ratios": paired,
        }
    return out


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
                f"  {LABELS[c]:<30} {fmt(r['ttft_mean_s'], '9.3f')} {fmt(r['ttft_p50_s'], '7.3f')} {fmt(r['ttft_p90_s'], '7.3f')} "
                f"{fmt(r['throughput_tok_s'], '7.0f')} {fmt(r.get('latency_mean_s'), '6.3f')} {fmt(h['device'], '8,.0f')} {fmt(h['host'], '7,.0f')} {fmt(h['disk'], '7,.0f')} "
                f"{fmt(r['hit_rate'] and 100 * r['hit_rate'], '6.1f')} {r['requests_failed'] + r['runs_failed']:>5} "
                f"{fmt(r.get('prefill_batches'), '8.0f')} {fmt(r.get('mean_new_seqs_per_prefill'), '6.2f')}"
            )
        for k, rr in s["ratios"].items():
            lines.append(
                f"  {k:<30} {fmt(rr['ttft_mean_s'], '9.2f')} {fmt(rr['ttft_p50_s'], '7.2f')} {fmt(rr['ttft_p90_s'], '7.2f')} "
                f"{fmt(rr['throughput_tok_s'], '7.2f')} {fmt(rr.get('latency_mean_s'), '6.2f')}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
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
        "blocks (`benchmarks.lib.traces.as_block_trace`), so --scale shrinks it like a block trace",
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
            "git": git_rev(),
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
