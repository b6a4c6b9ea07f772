"""The fleet what-if: "what would a shared store give my fleet?"

N embedded engines (simulated servers, each its own device, host and lower tier) replay one trace
together on one virtual timeline: requests are routed round-robin or by session (every turn of a
conversation to one server), and the engine whose clock is furthest behind always steps next, so
pages one server writes to the store are there for the others exactly when they would be.

- `local`: each server has its own disk tier (as configured): a conversation moved to another server
  recomputes its prefix there.
- `store`: a shared store (an in-process `MemoryBackend` behind the real `SharedStoreTier`) takes the
  disk tier's place on every server; each server reaches it over its own link at `store_bandwidth`
  with `store_latency_s` per transfer (the cost model's store link, `VirtualLinks`).

Everything else (policies, capacities, write-back pacing) is the same in both runs, so the
difference is the store's. Deterministic: the same inputs give the same report.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from ..hashing import Namespace
from ..records import RequestRecord
from ..replay.trace import Request
from ..report import REPORT_VERSION, policy_report
from ..tiers.shared_store import SharedStoreTier
from ..tiers.store_backends import MemoryBackend
from .run import settings_of
from .simulator import EmbeddedEngine, EngineConfig

ROUTES = ("round_robin", "session")


def route(requests: Sequence[Request], servers: int, how: str) -> list[list[Request]]:
    """Split `requests` over `servers`: `round_robin` by arrival order, or `session` (a stable hash of
    the conversation; requests without a session go round-robin)."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if how not in ROUTES:
        raise ValueError(f"unknown routing {how!r}; choose one of {', '.join(ROUTES)}")
    groups: list[list[Request]] = [[] for _ in range(servers)]
    for i, req in enumerate(sorted(requests, key=lambda r: r.arrival_s)):
        if how == "session" and req.session is not None:
            groups[zlib.crc32(req.session.encode()) % servers].append(req)
        else:
            groups[i % servers].append(req)
    return groups


def _merged_snapshot(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures `policy_report` reads from a snapshot, summed over the servers."""

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {k: add(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return a + b
        return a

    keys = ("prefetch", "bytes_moved", "stored_tokens", "capacity_tokens", "errors", "loads_waited", "loads_recomputed")
    out: dict[str, Any] = {k: snaps[0].get(k, {}) for k in keys}
    for snap in snaps[1:]:
        out = {k: add(out[k], snap.get(k, {})) for k in keys}
    for kind in out.get("prefetch", {}).values():
        if isinstance(kind, dict):
            kind["precision"] = None  # a ratio does not sum; the per-server reports have it
    return out


def run_fleet(
    requests: Sequence[Request],
    config: EngineConfig,
    servers: int,
    how: str,
    store: bool,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """One fleet run (see the module docstring); a `policy_report` over every server's requests."""
    groups = route(requests, servers, how)
    backend = MemoryBackend() if store else None
    cfg = dataclasses.replace(config, disk_tokens=0) if store else config
    engines: list[EmbeddedEngine] = []
    done = [0] * servers
    total = len(requests)
    try:
        for i in range(servers):
            tier = None
            if backend is not None:
                ns = Namespace.for_model(cfg.storage_layout, cfg.page_size)
                tier = SharedStoreTier(
                    cfg.storage_layout, cfg.page_size, max(1, config.disk_tokens // cfg.page_size), backend, ns
                )

            def cb(n: int, _t: int | None, _hit_rate: float | None = None, *, i: int = i) -> None:
                done[i] = n
                if progress:
                    progress(sum(done), total)

            engines.append(EmbeddedEngine(cfg, progress=cb, store=tier))
        for engine, group in zip(engines, groups):
            engine.begin(group)
        wall = time.perf_counter()
        live = [e for e in engines if e.busy]
        while live:
            engine = min(live, key=lambda e: e.now)  # the one furthest behind moves next
            if not engine.step():
                live.remove(engine)
        wall = time.perf_counter() - wall
        records: list[RequestRecord] = []
        for engine in engines:
            records += engine.end()
            engine.cache.check()
        duration = max((r.finish_s for r in records), default=0.0) - min((r.arrival_s for r in records), default=0.0)
        settings = settings_of(cfg) | {
            "servers": servers,
            "route": how,
            "store": store,
            "store_bandwidth": config.store_bandwidth if store else None,
            "store_latency_s": config.store_latency_s if store else None,
        }
        report = policy_report(
            records=records,
            snapshot=_merged_snapshot([e.cache.snapshot() for e in engines]),
            duration_s=duration,
            settings=settings,
        )
        report["engine"] = {
            "wall_s": wall,
            "virtual_s": max(e.now for e in engines),
            "steps": sum(e.steps for e in engines),
            "requests_per_server": [len(g) for g in groups],
        }
        if store:
            report["store"] = _merged_snapshot([{"errors": e.cache.snapshot()["store"]} for e in engines])["errors"]
            report["store"].pop("url", None)
        return report
    finally:
        for engine in engines:
            engine.close()


def fleet_whatif(
    requests: Sequence[Request],
    config: EngineConfig,
    servers: int,
    how: str,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """The fleet without and with a shared store, side by side, with ratios store / local."""
    out: dict[str, Any] = {"version": REPORT_VERSION, "kind": "fleet", "policies": {}}
    for name, store in (("local", False), ("store", True)):
        cb = (lambda d, t, n=name: progress(n, d, t)) if progress else None
        out["policies"][name] = run_fleet(requests, config, servers, how, store, cb)
    loc, sto = out["policies"]["local"], out["policies"]["store"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    out["ratios"] = {
        "store/local": {
            "hit_rate": ratio(sto["hit_rate"], loc["hit_rate"]),
            "ttft_mean": ratio(sto["ttft_s"]["mean"], loc["ttft_s"]["mean"]),
            "ttft_p50": ratio(sto["ttft_s"]["p50"], loc["ttft_s"]["p50"]),
            "ttft_p90": ratio(sto["ttft_s"]["p90"], loc["ttft_s"]["p90"]),
            "throughput": ratio(sto["throughput_tok_s"], loc["throughput_tok_s"]),
        }
    }
    return out


__all__ = ["ROUTES", "fleet_whatif", "route", "run_fleet"]
