"""Cold restore with a probe on the real server: does `predict` bring a spilled session up before its
continuation arrives, on the real CPU server?

    .venv-sglang/bin/python -m benchmarks.server.chain --json out/chain_server.json
    .venv-sglang/bin/python -m benchmarks.server.chain --quick --json quick.json

The `chain` shape (`sgl_hicache/replay/shapes.py`, its own generator with sizes for the tiny model) is
replayed on its trace clock (`replay_http`, `trace_clock`) against a fresh real SGLang 0.5.23 server on
CPU per run: sessions grow a private history over a few turns, interleaved, so that the small pools
spill the early ones to disk; after a pause each session comes back with a short *probe* (the shared
system prompt, the head of its history, a question) `--lead` seconds before its *continuation* (the
whole history plus a question). Token ids are folded into the model's vocabulary (`fold_into_vocab`:
an id's image depends on the id only, so equal prefixes stay equal).

Configurations (`--configs`), each on a fresh server and a fresh disk directory:
- `prefetch`: `--radix-cache-backend sgl_hicache`, predictor off (the default): the continuation's
  history comes from disk when it arrives (queue prefetch);
- `predict`: the same with `SGLHICACHE_PREDICTOR=tree_walk`: the probe's match triggers the walk, the
  history is promoted disk -> host during the lead;
- `hints`: predictor off, each probe carrying the client's `prefetch` hint for its session (sent to
  the hint API by the replayer, `SGLHICACHE_HINT_PORT=0`);
- `scratch`: SGLang with `--disable-radix-cache` (every prompt computed from scratch).

Outputs (greedy; with the default realistic random weights, `scripts/cpu/realistic_weights.py`, an
output depends on the KV it attends over): `predict` and `hints` must equal `prefetch`'s request for
request (they change where pages come from, never their bytes). Against `scratch` a prefix cache,
SGLang's own included, can differ where two tokens tie: a prefix's KV computed in its own earlier
prefill and in one longer prefill differ in bf16 rounding (seen here: one of 25 requests, whose top
two logprobs were 0.016 apart from scratch and equal in bf16 with a cached prefix, with SGLang's own
radix cache too); those requests are listed (`differ_from_scratch`), and must be the same with and
without the predictor.

Per run: continuation TTFT (mean, median), probe TTFT, the continuations' hit tokens per tier, the
server's predictor figures (`prefetch.predict`: promoted / used / wasted tokens; hint prefetches count
there too), disk -> host bytes, the hint report, and whether every request's output equals `scratch`'s.
Runs are interleaved (round r runs the configurations rotated by r); the summary gives medians over
repeats and ratios against `prefetch`. Hit tokens are repeatable up to thread timing; times are not.
Exit 1 when a run failed or an output of `predict` or `hints` differs from `prefetch`'s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.server_runs import TINY_MODEL, realistic_model, start_server
from benchmarks.lib.traces import fold_into_vocab
from sgl_hicache.replay.shapes import chain
from sgl_hicache.replay.trace import Request

CONFIGS = ("prefetch", "predict", "hints", "scratch")


def workload(a: argparse.Namespace, hints: bool, vocab: int) -> list[Request]:
    reqs = chain(
        sessions=a.sessions,
        turns=a.turns,
        turn_tokens=a.turn_tokens,
        system_tokens=a.system_tokens,
        probe_tokens=a.page_size * 2,
        question_tokens=a.page_size * 2,
        output_tokens=a.output_tokens,
        turn_gap_s=a.turn_gap,
        session_gap_s=a.session_gap,
        pause_s=a.pause,
        lead_s=a.lead,
        page_size=a.page_size,
        seed=a.seed,
        hints=hints,
    )
    return fold_into_vocab(reqs, vocab)


def run_one(config: str, a: argparse.Namespace, model: Path, work: Path, tag: str) -> dict[str, Any]:
    """One fresh server in `config`, the chain replayed against it; its figures and outputs."""
    from sgl_hicache.client.server import ServerStartError
    from sgl_hicache.replay.http import probe_server, replay_http

    disk = Path(tempfile.mkdtemp(prefix=f"chain-{tag}-", dir=work))
    args = ["--max-total-tokens", str(a.device_tokens), "--page-size", str(a.page_size), "--log-level", "warning"]
    env: dict[str, str] = {}
    if config == "scratch":
        args.append("--disable-radix-cache")
    else:
        args += ["--radix-cache-backend", "sgl_hicache"]
        env = {
            "SGLHICACHE_HOST_TOKENS": str(a.host_tokens),
            "SGLHICACHE_DISK_DIR": str(disk),
            "SGLHICACHE_DISK_TOKENS": str(a.disk_tokens),
            "SGLHICACHE_PREDICTOR": "tree_walk" if config == "predict" else "none",
        }
        if config == "hints":
            env["SGLHICACHE_HINT_PORT"] = "0"
    try:
        srv = start_server(
            model,
            load_format=a.load_format,
            log_path=work / f"{tag}.log",
            env=env,
            timeout_s=a.start_timeout,
            extra_args=args,
        )
    except ServerStartError as e:
        shutil.rmtree(disk, ignore_errors=True)
        return {"config": config, "error": f"server not up: {str(e)[-1500:]}"}
    try:
        server = probe_server(srv.url)
        reqs = workload(a, config == "hints", server.usable_vocab)
        t0 = time.monotonic()
        rep = replay_http(
            reqs,
            srv.url,
            concurrency=a.concurrency,
            trace_clock=True,
            keep_outputs=True,
            server=server,
            timeout_s=a.request_timeout,
        )
        wall = time.monotonic() - t0
    finally:
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)
    records = rep.pop("records")
    by_role: dict[str, list[dict]] = {}
    for r in records:
        by_role.setdefault(_role(r["request_id"]), []).append(r)
    conts, probes = by_role.get("cont", []), by_role.get("probe", [])
    stats = rep.get("server_stats") or {}
    pred = (stats.get("prefetch") or {}).get("predict") or {}  # a fresh server: its totals are this run's
    ttft = [r["ttft_s"] for r in conts if r.get("error") is None]
    return {
        "config": config,
        "wall_s": wall,
        "requests": len(records),
        "failed": rep["requests_failed"],
        "first_error": (rep.get("errors") or {}).get("first_error"),
        "cont_ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "cont_ttft_p50_s": statistics.median(ttft) if ttft else None,
        "probe_ttft_p50_s": statistics.median([r["ttft_s"] for r in probes]) if probes else None,
        "cont_hits": {t: sum(r[f"hit_{t}"] for r in conts) for t in ("device", "host", "disk")},
        "cont_prompt_tokens": sum(r["prompt_tokens"] for r in conts),
        "predict": {k: pred.get(k) for k in ("promoted_tokens", "used_tokens", "wasted_tokens")},
        "speculation": stats.get("speculation"),  # why the predictor did or did not copy
        "disk_to_host_bytes": (stats.get("bytes_moved") or {}).get("disk->host"),
        "hints": rep.get("hints"),
        "dropped_dirty_tokens": stats.get("dropped_dirty_tokens"),
        "outputs": {r["request_id"]: r["output_ids"] for r in records},
    }


def _role(rid: str) -> str:
    return rid.rsplit("/", 1)[-1]


def _outputs(runs: list[dict[str, Any]], config: str) -> dict[str, list[int]] | None:
    return next((r["outputs"] for r in runs if r["config"] == config and "outputs" in r), None)


def _differ(mine: list[dict[str, Any]], ref: dict[str, list[int]] | None) -> list[str] | None:
    """The request ids whose output differs from `ref`'s in any of `mine` (None: no reference)."""
    if ref is None:
        return None
    return sorted({rid for r in mine for rid, ids in r["outputs"].items() if ref.get(rid) != ids})


def summarise(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """Medians over repeats per configuration; outputs against `scratch`'s and against `prefetch`'s."""
    ref, base_outputs = _outputs(runs, "scratch"), _outputs(runs, "prefetch")
    out: dict[str, Any] = {}
    for c in configs:
        mine = [r for r in runs if r["config"] == c and "error" not in r]
        if not mine:
            out[c] = {"runs": 0}
            continue

        def med(key: str, mine: list[dict[str, Any]] = mine) -> Any:
            return (
                statistics.median(r[key] for r in mine if r[key] is not None)
                if any(r[key] is not None for r in mine)
                else None
            )

        vs_scratch, vs_prefetch = _differ(mine, ref), _differ(mine, base_outputs)
        out[c] = {
            "runs": len(mine),
            "cont_ttft_mean_s": med("cont_ttft_mean_s"),
            "cont_ttft_p50_s": med("cont_ttft_p50_s"),
            "probe_ttft_p50_s": med("probe_ttft_p50_s"),
            "cont_hits": mine[0]["cont_hits"],
            "predict": mine[0]["predict"],
            "speculation": mine[0].get("speculation"),
            "outputs_equal_scratch": None if vs_scratch is None else not vs_scratch,
            "differ_from_scratch": vs_scratch,
            "outputs_equal_prefetch": None if vs_prefetch is None else not vs_prefetch,
            "differ_from_prefetch": vs_prefetch,
        }
    base = out.get("prefetch", {}).get("cont_ttft_mean_s")
    for s in out.values():
        if base and s.get("cont_ttft_mean_s") is not None:
            s["cont_ttft_mean_over_prefetch"] = s["cont_ttft_mean_s"] / base
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat, 5 sessions, a shorter pause")
    ap.add_argument(
        "--model",
        type=Path,
        help="a model folder (default: the tiny Llama, with --realistic-weights written to the work dir)",
    )
    ap.add_argument(
        "--load-format",
        default=None,
        help="SGLang --load-format (default: the folder's weights; 'dummy' with the bare config)",
    )
    ap.add_argument(
        "--dummy-weights",
        action="store_true",
        help="serve the tiny Llama with dummy weights (the output check is then weak)",
    )
    ap.add_argument("--device-tokens", type=int, default=1024)
    ap.add_argument("--host-tokens", type=int, default=2048)
    ap.add_argument("--disk-tokens", type=int, default=65536)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=192)
    ap.add_argument("--system-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--turn-gap", type=float, default=1.0)
    ap.add_argument("--session-gap", type=float, default=2.5)
    ap.add_argument("--pause", type=float, default=14.0)
    ap.add_argument("--lead", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--work-dir", type=Path, help="logs and the model go here (default: a temporary folder, removed)")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.sessions, a.pause = 1, 5, 10.0
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or a.repeats < 1:
        ap.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}" if bad else "--repeats must be >= 1")
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="chain-server-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if a.model is not None:
            model, load_format = a.model, a.load_format
        elif a.dummy_weights:
            model, load_format = TINY_MODEL, "dummy"
        else:
            model, load_format = realistic_model(work / "model"), None
        a.load_format = load_format
        runs = []
        for r in range(a.repeats):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for c in order:
                res = run_one(c, a, model, work, f"{c}-{r}")
                res["repeat"] = r
                runs.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "outputs"}), file=sys.stderr)
        summary = summarise(runs, configs)
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    regime = {
        "model": str(a.model or "tiny-llama (hidden 128, 2 layers, 2 KV heads x 32, bf16)"),
        "weights": "dummy"
        if a.dummy_weights
        else ("given" if a.model else "realistic random (scripts/cpu/realistic_weights.py)"),
        "device_tokens": a.device_tokens,
        "host_tokens": a.host_tokens,
        "disk_tokens": a.disk_tokens,
        "page_size": a.page_size,
        "chain": {
            "sessions": a.sessions,
            "turns": a.turns,
            "turn_tokens": a.turn_tokens,
            "system_tokens": a.system_tokens,
            "probe_tokens": 2 * a.page_size,
            "question_tokens": 2 * a.page_size,
            "output_tokens": a.output_tokens,
            "turn_gap_s": a.turn_gap,
            "session_gap_s": a.session_gap,
            "pause_s": a.pause,
            "lead_s": a.lead,
            "seed": a.seed,
        },
        "concurrency": a.concurrency,
        "repeats": a.repeats,
        "machine": "CPU, SGLang 0.5.23, torch_native attention",
    }
    result = {
        "benchmark": "chain_server",
        "regime": regime,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
    }
    text = json.dumps(result, indent=2)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text)
    print(json.dumps(summary, indent=2))
    failed = any("error" in r or r.get("failed") for r in runs)
    # the predictor and the hints move bytes between tiers; they must not change an output
    differ = any(summary.get(c, {}).get("outputs_equal_prefetch") is False for c in ("predict", "hints"))
    return 1 if failed or differ else 0


if __name__ == "__main__":
    sys.exit(main())
