"""Trace slices for the embedded engine's benchmarks: a window of a trace (`load_window`), its
working set (`working_set_tokens`), capacities as a share of it (`split_capacities`), and the models
and machines they run (`MODELS`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sgl_hicache.replay import load_trace

MODELS = {"8b": ("llama3-8b", "h200"), "32b": ("qwen2.5-32b", "h200"), "480b": ("qwen3-coder-480b-a35b", "8xh200")}


def load_window(trace: Path, start: int, count: int) -> list:
    """Requests `start` .. `start + count` of `trace`, the clock rebased to the first arrival."""
    reqs = list(load_trace(trace, limit=start + count))[start:]
    t0 = min(r.arrival_s for r in reqs)
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in reqs]


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


def split_capacities(requests: list, frac: float, ws: int, page_size: int) -> tuple[int, int, int]:
    """(device, host, disk) tokens for `frac` x the working set `ws`, split 1:2:8, the device at
    least the largest prompt plus its output (and four pages)."""
    largest = max(len(r.input_ids) + r.output_length for r in requests)
    total = int(frac * ws)
    device = max(total // 11, largest + 4 * page_size)
    host, disk = 2 * total // 11, max(0, total - device - 2 * total // 11)
    return device, host, disk
