"""The replay report: a stable, documented JSON interface (see docs/report-format.md).

Both replayers (the embedded engine and the HTTP replayer against a real server) produce it, so a
report can be compared, plotted and inspected the same way whatever produced it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .records import PRECEDED_BY, RecordColumns
from .tiers.base import DEVICE, DISK, HOST

REPORT_VERSION = 1


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (q in [0, 100]); 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "mean": (sum(v) / len(v)) if v else 0.0,
        "p50": percentile(v, 50),
        "p90": percentile(v, 90),
        "p99": percentile(v, 99),
        "max": v[-1] if v else 0.0,
    }


def policy_report(
    *,
    records: Sequence[Any] | RecordColumns,
    snapshot: dict[str, Any],
    duration_s: float,
    settings: dict[str, Any],
    timeline_points: int = 50,
) -> dict[str, Any]:
    """One policy's report from per-request records (attributes: arrival_s, ttft_s, finish_s,
    prompt_tokens, output_tokens, hit_device, hit_host, hit_disk; or `RecordColumns`) and a cache
    snapshot. Sums run over columns, so a million-request report takes seconds, not minutes."""
    cols = RecordColumns.of(records)
    prompt = sum(cols.prompt_tokens)
    hits = {DEVICE: sum(cols.hit_device), HOST: sum(cols.hit_host), DISK: sum(cols.hit_disk)}
    hit_total = sum(hits.values())
    output = sum(cols.output_tokens)
    pf = snapshot.get("prefetch", {})
    pre, pred = pf.get("prefetch", {}), pf.get("predict", {})
    return {
        "requests": len(cols),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "hit_tokens": hits,
        "miss_tokens": prompt - hit_total,
        "hit_rate": hit_total / prompt if prompt else 0.0,
        "hit_rate_by_tier": {t: (hits[t] / prompt if prompt else 0.0) for t in hits},
        "ttft_s": latency_summary(cols.ttft_s),
        "latency_s": latency_summary([f - a for f, a in zip(cols.finish_s, cols.arrival_s)]),
        "duration_s": duration_s,
        "throughput_tok_s": (prompt + output) / duration_s if duration_s > 0 else 0.0,
        "output_throughput_tok_s": output / duration_s if duration_s > 0 else 0.0,
        "prefetch": {
            "promoted_tokens": pre.get("promoted_tokens", 0),
            "used_tokens": pre.get("used_tokens", 0),
            "wasted_tokens": pre.get("wasted_tokens", 0),
            "precision": pre.get("precision"),
            "coverage": snapshot.get("coverage"),
            "loads_waited": snapshot.get("loads_waited", 0),
            "loads_recomputed": snapshot.get("loads_recomputed", 0),
        },
        "predict": {
            "promoted_tokens": pred.get("promoted_tokens", 0),
            "used_tokens": pred.get("used_tokens", 0),
            "wasted_tokens": pred.get("wasted_tokens", 0),
            "precision": pred.get("precision"),
        },
        "bytes_moved": snapshot.get("bytes_moved", {}),
        "stored_tokens": snapshot.get("stored_tokens", {}),
        "capacity_tokens": snapshot.get("capacity_tokens", {}),
        "errors": snapshot.get("errors", {}),
        "settings": settings,
        "timeline": timeline(cols, timeline_points),
        "ttft_samples_s": [round(t, 6) for t in cols.ttft_s],
        **ttft_by_preceding(cols),
    }


def ttft_by_preceding(records: Any) -> dict[str, Any]:
    """``{"ttft_by_preceding": {kind: {"requests": n, **latency_summary}}}`` for every kind of
    `PRECEDED_BY` (what came before a call in its session), or ``{}`` when no record tells."""
    cols = RecordColumns.of(records)
    if not any(code >= 0 for code in cols.preceded):
        return {}
    split: dict[str, Any] = {}
    for code, kind in enumerate(PRECEDED_BY):
        values = [t for t, c in zip(cols.ttft_s, cols.preceded) if c == code]
        split[kind] = {"requests": len(values), **latency_summary(values)}
    return {"ttft_by_preceding": split}


def timeline(records: Any, points: int) -> list[dict[str, float]]:
    """Per-tier hit rate over the replay, in `points` buckets of consecutive requests (by arrival)."""
    cols = RecordColumns.of(records)
    n = len(cols)
    if not n:
        return []
    arrival = cols.arrival_s
    order = sorted(range(n), key=arrival.__getitem__)  # stable: equal arrivals keep completion order
    size = max(1, math.ceil(n / points))
    out = []
    for i in range(0, n, size):
        chunk = order[i : i + size]
        prompt = sum(cols.prompt_tokens[j] for j in chunk) or 1
        out.append(
            {
                "request": i + len(chunk),
                "time_s": arrival[chunk[-1]],
                DEVICE: sum(cols.hit_device[j] for j in chunk) / prompt,
                HOST: sum(cols.hit_host[j] for j in chunk) / prompt,
                DISK: sum(cols.hit_disk[j] for j in chunk) / prompt,
            }
        )
    return out
