"""Same controller, same results: one trace slice through the embedded engine and through the real
SGLang server, at the same capacities and page size; per-tier hit tokens side by side.

    .venv-sglang/bin/python -m benchmarks.server.parity --json parity.json             # ~3 min here (loaded)
    .venv-sglang/bin/python -m benchmarks.server.parity --requests 150 --json p.json   # the CI test's size

Workload (defaults): the first 250 requests of the Mooncake conversation trace, every 512-token block
scaled to 4 tokens (`--scale`), page 4, one output token each, device pool at its floor (2 % of the
working set is below the longest prompt), host 16x the pool, disk 2x the working set: a slice that
hits all three tiers in a few minutes on a CPU. Both sides:

- the server: `python -m sglang.launch_server --radix-cache-backend sgl_hicache` on the tiny model
  (`scripts/cpu/tiny-llama`, dummy weights: hits do not depend on the model), `--max-total-tokens` = the device pool, page
  `--page-size`, host tier `--host-ratio` x the pool, the disk tier on (2x the working set, a fresh
  temp dir); replayed over HTTP (`replay_http`, greedy, `ignore_eos`); hits per tier are the replies'
  `meta_info.cached_tokens_details` (storage -> disk);
- the embedded engine (`EmbeddedEngine`; the served model's preset, or `--engine-model`, on `cpu-local` for its virtual times): the
  same device / host / disk tokens (the device figure is the pool the server actually built, read
  from its stats), the same page size, the same `RequestController` settings.

The exact comparison is sequential (`--concurrency 1`, the default): with several requests in flight
the server's admission order and its background copies follow real thread timing, the embedded
engine's follow its cost model, so the two interleave inserts and evictions differently (a measured
difference there is timing, not policy; `--concurrency 4` shows it). The settings where the two must
agree exactly: prefetch on, predictor off (`--predictor`: a prediction is started and lands on wall
time on the server), `eviction_demotes` `all` (`--eviction-demotes host`, the server's default,
makes host evictions drop dirty pages whose background disk write has not landed, and that write-back
is paced in time, `writeback_interval_s`: wall time on the server, the cost model's time in the engine;
on the tiny model the engine's whole replay lasts less than 0.1 virtual seconds, so it plans a handful of
rounds where the loaded server plans one a step: `--engine-model llama3-8b` gives the engine step times
of the server's order).

Output (JSON with `--json`, a summary on stdout): per side the hit tokens per tier and in total,
`relative_difference` per tier = |embedded - server| / server (0 where both are 0, inf where only the
server's is), `max_relative_difference`, the first requests whose hits differ (index in the replayed
list), and the regime. Both sides replay the same list: the requests the server takes (a prompt at or
over its input limit, which the KV pool bounds, is skipped there: `regime.skipped_by_server`).
Exit status 0 when every tier is within `--tolerance` (default 0.02), 1 otherwise; a server that does
not start or a failed request is an error (exit 1 with the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import DEFAULT_TRACE
from benchmarks.lib.server_runs import TINY_MODEL, load_slice, pool_tokens, start_server
from benchmarks.lib.slices import working_set_tokens
from sgl_hicache.client.backend_settings import BackendSettings, settings_env
from sgl_hicache.replay.http import fit_requests, probe_server, replay_http
from sgl_hicache.sim.presets import MODELS, get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig

TIERS = ("device", "host", "disk")


def run_server(reqs: list, a: argparse.Namespace, pool: int, host: int, disk: int, workdir: Path) -> dict[str, Any]:
    """Replay `reqs` on a fresh sgl_hicache server; per-request and total hits, the pool it built, the
    requests it took (`kept`) and what it skipped."""

    store = workdir / "store"
    settings = BackendSettings(
        host_tokens=host,
        disk_dir=str(store),
        disk_tokens=disk,
        prefetch=True,
        predictor=a.predictor,
        eviction_demotes=a.eviction_demotes,
    )
    args = [
        "--page-size",
        str(a.page_size),
        "--max-total-tokens",
        str(pool),
        "--radix-cache-backend",
        "sgl_hicache",
        *a.server_arg,
    ]
    log = workdir / "server.log"
    srv = start_server(
        a.model,
        extra_args=args,
        env=settings_env(settings),
        log_path=log,
        load_format="dummy",
        timeout_s=a.start_timeout,
    )
    try:
        # the requests the server takes (a prompt at or over its input limit is skipped there, so the
        # embedded engine replays the same list: `kept`)
        model = probe_server(srv.url)
        kept, skipped = fit_requests(reqs, model, a.output_tokens)
        rep = replay_http(
            kept,
            srv.url,
            concurrency=a.concurrency,
            max_new_tokens=a.output_tokens,
            keep_outputs=True,
            timeout_s=a.request_timeout,
            server=model,
        )
    finally:
        srv.stop()
        if a.keep_log and log.exists():
            Path(a.keep_log).write_bytes(log.read_bytes())
    if rep["requests_failed"]:
        raise RuntimeError(
            f"{rep['requests_failed']} requests failed on the server: {rep['errors'].get('first_error')}"
        )
    per_request = [(r["hit_device"], r["hit_host"], r["hit_disk"]) for r in rep["records"]]
    cap = rep.get("capacity_tokens") or {}
    return {
        "hit_tokens": dict(rep["hit_tokens"]),
        "per_request": per_request,
        "capacity_tokens": cap,
        "kept": kept,
        "skipped": skipped,
        "prompt_tokens": rep["prompt_tokens"],
        "wall_s": rep["duration_s"],
    }


def run_embedded(reqs: list, a: argparse.Namespace, device: int, host: int, disk: int) -> dict[str, Any]:
    """Replay `reqs` through the embedded engine at the server's capacities."""
    preset = a.engine_model or (a.model.name if a.model.name in MODELS else "bench-llama")
    cfg = EngineConfig(
        policy="predict" if a.predictor != "none" else "prefetch",
        model=get_model(preset),
        hardware=get_hardware("cpu-local"),
        device_tokens=device,
        host_tokens=host,
        disk_tokens=disk,
        page_size=a.page_size,
        concurrency=a.concurrency,
        predictor=a.predictor if a.predictor != "none" else "tree_walk",
        eviction_demotes=a.eviction_demotes,
    )
    engine = EmbeddedEngine(cfg)
    try:
        t0 = time.perf_counter()
        recs = engine.run(reqs)
        wall = time.perf_counter() - t0
        engine.cache.check()
    finally:
        engine.close()
    # records are in completion order; at concurrency 1 that is the trace's order
    per_request = list(zip(recs.hit_device, recs.hit_host, recs.hit_disk))
    hits = {t: int(sum(col)) for t, col in zip(TIERS, (recs.hit_device, recs.hit_host, recs.hit_disk))}
    return {"hit_tokens": hits, "per_request": per_request, "wall_s": wall}


def relative(e: int, s: int) -> float:
    if s == 0:
        return 0.0 if e == 0 else float("inf")
    return abs(e - s) / s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=250, help="first N requests of the trace (default 250)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--model", type=Path, default=TINY_MODEL)
    p.add_argument("--scale", type=int, default=4, help="tokens per 512-token trace block (default 4)")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument(
        "--pool",
        type=float,
        default=0.02,
        help="device pool as a fraction of the working set, floored at the longest prompt (default 0.02)",
    )
    p.add_argument("--host-ratio", type=float, default=16.0, help="host tier = R x device pool (default 16)")
    p.add_argument("--disk-ratio", type=float, default=2.0, help="disk tier = R x the working set (default 2)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--output-tokens", type=int, default=1)
    p.add_argument("--predictor", default="none", help="none | tree_walk (both sides; default none)")
    p.add_argument("--eviction-demotes", default="all", help="all | host | none (both sides; default all)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra SGLang server argument (repeatable), e.g. --server-arg=--disable-overlap-schedule",
    )
    p.add_argument(
        "--engine-model",
        default=None,
        help="the embedded engine's model preset (its virtual step times; default: the served model's preset). "
        "Time-paced work (background write-back every writeback_interval_s) follows it",
    )
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep-log", default=None, help="copy the server's log here")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    for k in [k for k in os.environ if k.startswith("SGLHICACHE_")]:
        del os.environ[k]  # nothing of the caller's shell changes the server's settings
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    reqs = load_slice(a.trace, a.requests, a.scale, vocab, a.output_tokens)
    ws = working_set_tokens(reqs, a.page_size)
    longest = max(len(r.input_ids) for r in reqs)
    pool = pool_tokens(a.pool, ws, longest, a.output_tokens, a.page_size)
    host = int(pool * a.host_ratio) // a.page_size * a.page_size
    disk = int(ws * a.disk_ratio) // a.page_size * a.page_size
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sgl-hicache-parity-") as tmp:
        server = run_server(reqs, a, pool, host, disk, Path(tmp))
    device = int(server["capacity_tokens"].get("device") or pool)
    embedded = run_embedded(server["kept"], a, device, host, disk)
    rel = {t: relative(embedded["hit_tokens"][t], server["hit_tokens"][t]) for t in TIERS}
    total_e, total_s = sum(embedded["hit_tokens"].values()), sum(server["hit_tokens"].values())
    rel["total"] = relative(total_e, total_s)
    diffs = [
        {"request": i, "server": list(s), "embedded": list(e)}
        for i, (s, e) in enumerate(zip(server["per_request"], embedded["per_request"]))
        if tuple(s) != tuple(e)
    ]
    worst = max(rel[t] for t in TIERS)
    out = {
        "benchmark": "engine_server_parity",
        "regime": {
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.input_ids) for r in reqs),
            "working_set_tokens": ws,
            "scale": a.scale,
            "page_size": a.page_size,
            "max_total_tokens": pool,
            "device_tokens": device,
            "host_tokens": host,
            "disk_tokens": disk,
            "concurrency": a.concurrency,
            "output_tokens": a.output_tokens,
            "predictor": a.predictor,
            "eviction_demotes": a.eviction_demotes,
            "model": str(a.model),
            "engine_model": a.engine_model,
            "server_args": a.server_arg,
            "server_capacity_tokens": server["capacity_tokens"],
            "loadavg": os.getloadavg(),
            "replayed": len(server["kept"]),
            "skipped_by_server": server["skipped"],
        },
        "server": {"hit_tokens": server["hit_tokens"], "total": total_s, "wall_s": server["wall_s"]},
        "embedded": {"hit_tokens": embedded["hit_tokens"], "total": total_e, "wall_s": round(embedded["wall_s"], 2)},
        "relative_difference": rel,
        "max_relative_difference": worst,
        "tolerance": a.tolerance,
        "within_tolerance": worst <= a.tolerance,
        "requests_differing": len(diffs),
        "first_differences": diffs[:10],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(
        json.dumps(
            {
                k: out[k]
                for k in ("server", "embedded", "relative_difference", "within_tolerance", "requests_differing")
            },
            indent=1,
        )
    )
    return 0 if out["within_tolerance"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
