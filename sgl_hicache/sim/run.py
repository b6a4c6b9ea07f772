"""Run one policy, or compare several on the same trace and capacities, into a report.

`compare` runs the policies in parallel processes (one per policy, up to the CPUs there are) and
merges their reports in policy order; the merged report is the one the policies would give one
after another (every figure but `engine.wall_s` is deterministic). `run_policy` can write a partial
report every N completed requests (`checkpoint_every`), so a long run killed midway is not lost.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..replay.trace import Request
from ..report import REPORT_VERSION, policy_report
from ..tree.view import largest_subtrees
from .simulator import POLICIES, EmbeddedEngine, EngineConfig


def settings_of(config: EngineConfig) -> dict[str, Any]:
    return {
        "policy": config.policy,
        "model": config.model.name,
        "hardware": config.hardware.name,
        "device_tokens": config.device_tokens,
        "host_tokens": config.host_tokens,
        "disk_tokens": config.disk_tokens,
        "page_size": config.page_size,
        "concurrency": config.concurrency,
        "time_scale": config.time_scale,
        "max_batch_tokens": config.max_batch_tokens,
        "eviction_policy": config.eviction_policy,
        "write_policy": config.write_policy,
        "predictor_budget_tokens": config.predictor_budget_tokens,
        "predictor": config.predictor,
        "admission_min_probability": config.admission_min_probability,
        "prefetch_window": config.prefetch_window,
        "storage_bytes_per_token": config.storage_layout.bytes_per_token,
        "model_kv_bytes_per_token": config.model.kv_bytes_per_token,
        "bytes": config.byte_mode,
    }


def _report(engine: EmbeddedEngine, config: EngineConfig, wall: float, cpu: float = 0.0) -> dict[str, Any]:
    records = engine.records
    duration = (max(records.finish_s) - min(records.arrival_s)) if len(records) else 0.0
    report = policy_report(
        records=records, snapshot=engine.cache.snapshot(), duration_s=duration, settings=settings_of(config)
    )
    report["engine"] = {
        "steps": engine.steps,
        "wall_s": wall,
        "virtual_s": engine.now,
        "demote_seconds": engine.demote_seconds,
        "disk_write_seconds": engine.disk_write_seconds,
        "bytes": config.byte_mode,
        "cpu_s": cpu,
        "hints": dict(engine.controller.hints.counts),
        "hints_rejected": engine.hints_rejected,
    }
    report["tree"] = largest_subtrees(
        engine.cache.tree, config.model.kv_bytes_per_token * config.page_size, now=engine.now
    )
    return report


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write `obj` as JSON atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def checkpoint_path(report: Path, policy: str) -> Path:
    """Where a run writes its partial reports: ``REPORT.<policy>.partial.json`` beside the report."""
    return report.with_name(f"{report.name}.{policy}.partial.json")


def run_policy(
    requests: Iterable[Request],
    config: EngineConfig,
    progress: Callable[..., None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 0,
) -> dict[str, Any]:
    """One policy's report. `requests` is a sequence or a streamed source (an iterable in arrival
    order; its `len()` when it has one feeds the progress). With `checkpoint` and
    `checkpoint_every` N, a partial report (a valid replay report of the requests finished so far,
    with ``"partial": {"requests_done": n, "requests_total": N}``) is written there every N
    completions; it is removed when the run ends normally."""
    wall0, cpu0 = time.perf_counter(), time.process_time()

    def save(engine: EmbeddedEngine) -> None:
        rep = _report(engine, config, time.perf_counter() - wall0, time.process_time() - cpu0)
        partial = {
            "version": REPORT_VERSION,
            "kind": "replay",
            "policies": {config.policy: rep},
            "partial": {"requests_done": len(engine.records), "requests_total": engine.total},
        }
        write_json(checkpoint, partial)  # type: ignore[arg-type]

    engine = EmbeddedEngine(
        config,
        progress=progress,
        checkpoint=save if checkpoint is not None else None,
        checkpoint_every=checkpoint_every,
    )
    try:
        total = len(requests) if hasattr(requests, "__len__") else None  # type: ignore[arg-type]
        engine.run(requests, total=total)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        engine.cache.check()  # a replay that broke an invariant must not produce a report
        report = _report(engine, config, wall, cpu)
        if checkpoint is not None and checkpoint.exists():
            checkpoint.unlink()
        return report
    finally:
        engine.close()


_QUEUE: Any = None  # a worker's progress queue to the parent (set by `_init_worker`)


def _init_worker(queue: Any) -> None:
    global _QUEUE
    _QUEUE = queue
    import torch

    # one thread each: the workers already share the cores, and a forked worker must not enter an
    # OpenMP region with the parent's thread pool, whose threads it did not inherit (it hangs)
    torch.set_num_threads(1)


def _run_in_worker(
    requests: Iterable[Request], config: EngineConfig, checkpoint: Path | None, checkpoint_every: int
) -> dict[str, Any]:
    """One policy in a worker process; progress goes back to the parent over the queue, throttled."""
    last = [0.0]
    queue = _QUEUE

    def progress(done: int, total: int | None, hit_rate: float | None = None) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or (total is not None and done >= total):
            last[0] = now
            queue.put((config.policy, done, total, hit_rate))

    return run_policy(requests, config, progress if queue is not None else None, checkpoint, checkpoint_every)


def compare(
    requests: Iterable[Request],
    base: EngineConfig,
    policies: Sequence[str] = POLICIES,
    progress: Callable[..., None] | None = None,
    workers: int | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 0,
) -> dict[str, Any]:
    """Every policy on the same requests and capacities; ratios against `recompute` and `demote`.

    `workers` processes run the policies side by side (default: one per policy, at most the CPUs
    this process may use; 1 runs them one after another here). `progress(label, done, total,
    hit_rate)` is called in this process. `checkpoint` is the report path: each policy writes its
    partial reports to `checkpoint_path(checkpoint, policy)`."""
    if workers is None:
        workers = min(
            len(policies), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        )
    out: dict[str, Any] = {"version": REPORT_VERSION, "kind": "compare", "policies": {}}
    configs = {name: dataclasses.replace(base, policy=name) for name in policies}
    ckpt = {name: checkpoint_path(checkpoint, name) if checkpoint is not None else None for name in policies}
    if workers <= 1 or len(policies) <= 1:
        for name in policies:
            cb = (lambda done, total, hit_rate=None, n=name: progress(n, done, total, hit_rate)) if progress else None
            out["policies"][name] = run_policy(requests, configs[name], cb, ckpt[name], checkpoint_every)
    else:
        out["policies"] = _compare_parallel(requests, configs, workers, progress, ckpt, checkpoint_every)
    ratios: dict[str, Any] = {}
    for base_name in ("recompute", "demote"):
        ref = out["policies"].get(base_name)
        if not ref:
            continue
        for name, rep in out["policies"].items():
            if name == base_name:
                continue
            ratios[f"{name}/{base_name}"] = {
                "ttft_mean": _ratio(rep["ttft_s"]["mean"], ref["ttft_s"]["mean"]),
                "ttft_p50": _ratio(rep["ttft_s"]["p50"], ref["ttft_s"]["p50"]),
                "ttft_p90": _ratio(rep["ttft_s"]["p90"], ref["ttft_s"]["p90"]),
                "throughput": _ratio(rep["throughput_tok_s"], ref["throughput_tok_s"]),
            }
    out["ratios"] = ratios
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# Relative work of a policy's replay, from the engine CPU seconds each took on the shipped trace's
# first 2,000 requests (oracle 6.9, predict 4.6, prefetch 4.3, demote 3.8, recompute 2.2): the more
# a policy moves and looks ahead, the longer it runs, whatever the trace.
_EXPECTED_WORK = {"oracle": 5, "predict": 4, "prefetch": 3, "demote": 2, "recompute": 1}


def longest_first(policies: Iterable[str]) -> list[str]:
    """`policies` in the order a pool should start them: the most work first (a greedy
    longest-processing-time schedule); unknown names first, in their given order."""
    return sorted(policies, key=lambda name: -_EXPECTED_WORK.get(name, len(_EXPECTED_WORK) + 1))


def _compare_parallel(
    requests: Iterable[Request],
    configs: dict[str, EngineConfig],
    workers: int,
    progress: Callable[..., None] | None,
    ckpt: dict[str, Path | None],
    checkpoint_every: int,
) -> dict[str, Any]:
    """The policies in `workers` processes; reports merged in the order of `configs`.

    Workers are forked when that is safe: on a platform that can (Linux) and while this process
    runs no other Python thread (one holding a lock at the fork would leave it held forever in the
    worker: the command line has none; a caller's threads, a test runner's, do). Forked, they start
    with this process's imports (~2 s of torch and the package a spawned interpreter spends before
    its first request). The fork happens at the first submission, before this function starts its
    progress thread; each worker runs torch on one thread (`_init_worker`), so the parent's OpenMP
    pool, if it made one, is never entered. Otherwise they are spawned."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    fork = "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    queue = ctx.Queue() if progress else None  # inherited by the workers (no manager process)
    stop = threading.Event()

    def drain() -> None:  # progress lines from the workers, shown here
        while not stop.is_set() or (queue is not None and not queue.empty()):
            try:
                label, done, total, hit = queue.get(timeout=0.2)  # type: ignore[union-attr]
            except Exception:
                continue
            progress(label, done, total, hit)  # type: ignore[misc]

    reader = threading.Thread(target=drain, name="compare-progress", daemon=True) if queue is not None else None
    try:
        with ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)
        ) as pool:
            # the pool runs submissions in order as workers free up: longest first keeps the last
            # worker from starting a long policy when the others are nearly done
            futures = {
                name: pool.submit(_run_in_worker, requests, configs[name], ckpt[name], checkpoint_every)
                for name in longest_first(configs)
            }
            if reader:  # after the first submission forked every worker: no thread of ours is copied
                reader.start()
            return {name: futures[name].result() for name in configs}
    finally:
        stop.set()
        if reader and reader.is_alive():
            reader.join(timeout=5)
        if queue is not None:
            queue.close()
