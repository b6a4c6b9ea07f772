"""Run one policy, or compare several on the same trace and capacities, into a report."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..replay.trace import Request
from ..tree.view import largest_subtrees
from .report import REPORT_VERSION, policy_report
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
    }


def run_policy(requests: Sequence[Request], config: EngineConfig, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    engine = EmbeddedEngine(config, progress=progress)
    try:
        wall = time.perf_counter()
        records = engine.run(requests)
        wall = time.perf_counter() - wall
        engine.cache.check()  # a replay that broke an invariant must not produce a report
        duration = max((r.finish_s for r in records), default=0.0) - min((r.arrival_s for r in records), default=0.0)
        report = policy_report(records=records, snapshot=engine.cache.snapshot(), duration_s=duration, settings=settings_of(config))
        report["engine"] = {"steps": engine.steps, "wall_s": wall, "virtual_s": engine.now, "demote_seconds": engine.demote_seconds,
                            "disk_write_seconds": engine.disk_write_seconds}
        report["tree"] = largest_subtrees(engine.cache.tree, config.model.kv_bytes_per_token * config.page_size, now=engine.now)
        return report
    finally:
        engine.close()


def compare(requests: Sequence[Request], base: EngineConfig, policies: Sequence[str] = POLICIES,
            progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Every policy on the same requests and capacities; ratios against `recompute` and `demote`."""
    out: dict[str, Any] = {"version": REPORT_VERSION, "kind": "compare", "policies": {}}
    for name in policies:
        cb = (lambda done, total, n=name: progress(n, done, total)) if progress else None
        out["policies"][name] = run_policy(requests, dataclasses.replace(base, policy=name), cb)
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
