"""Counters of a tiered cache and their snapshots: plain dict, JSON, Prometheus text.

Counters only ever grow (Prometheus counters); gauges (stored pages) are read from the tree at
snapshot time, so no batch can overwrite another's figure.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from typing import Any

from .tiers.base import DEVICE, DISK, HOST, TIERS

LINKS = ("device->host", "host->device", "host->disk", "disk->host")
PREFETCH_KINDS = ("prefetch", "predict", "rewarm")


class CacheStats:
    """Thread-safe counters of one cache.

    - `hit_tokens[tier]`: prompt tokens served from each tier, counted once per scheduled request;
      `miss_tokens` the rest of the prompt; `requests`, `prompt_tokens`.
    - `evicted_tokens[tier]` (left the tier), `demoted_tokens[tier]` (copied down from that tier on
      eviction), `promoted_tokens[tier]` (copied up into that tier), `dropped_tokens` (left the tree),
      `dropped_dirty_tokens[tier]` (evicted from that tier with no copy one tier down: lost to it).
    - `bytes_moved[link]`, `transfer_seconds[link]` (measured wall time of the copies).
    - `prefetch[kind]`: promoted_tokens, used_tokens (used by a request before being evicted),
      wasted_tokens, covered_tokens / needed_tokens for coverage; kinds are "prefetch", "predict" and
      "rewarm" (brought disk -> host at start from the re-warm record, `control/rewarm.py`).
    - `errors[name]`: corrupt pages, failed reads and writes, ...
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.prompt_tokens = 0
        self.miss_tokens = 0
        self.hit_tokens = dict.fromkeys(TIERS, 0)
        self.evicted_tokens = dict.fromkeys(TIERS, 0)
        self.demoted_tokens = dict.fromkeys(TIERS, 0)
        self.promoted_tokens = dict.fromkeys(TIERS, 0)
        self.dropped_tokens = 0
        self.dropped_dirty_tokens = dict.fromkeys(TIERS, 0)  # evicted without a copy below (eviction_demotes)
        self.bytes_moved = dict.fromkeys(LINKS, 0)
        self.transfer_seconds = dict.fromkeys(LINKS, 0.0)
        self.prefetch = {kind: {"promoted_tokens": 0, "used_tokens": 0, "wasted_tokens": 0} for kind in PREFETCH_KINDS}
        # the same used / wasted figures per prediction trigger (`TreeNode.prefetch_trigger`), for the guard
        self.triggers: dict[str, dict[str, int]] = defaultdict(
            lambda: {"promoted_tokens": 0, "used_tokens": 0, "wasted_tokens": 0}
        )
        self.lower_tier_hit_tokens = 0  # host+disk hits of scheduled requests
        self.lower_tier_covered_tokens = 0  # ... of which already promoted to device when needed
        self.load_wait_seconds = 0.0
        self.loads_waited = 0
        self.loads_recomputed = 0
        self.errors: dict[str, int] = defaultdict(int)

    def add(self, field: str, amount: float = 1, key: str | None = None) -> None:
        with self._lock:
            if key is None:
                setattr(self, field, getattr(self, field) + amount)
            else:
                getattr(self, field)[key] += amount

    def add_prefetch(self, kind: str, field: str, amount: int, trigger: str | None = None) -> None:
        with self._lock:
            self.prefetch[kind][field] += amount
            if trigger is not None:
                self.triggers[trigger][field] += amount

    def record_request(
        self, prompt_tokens: int, device: int, host: int, disk: int, covered_by_prefetch: int = 0
    ) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.hit_tokens[DEVICE] += device
            self.hit_tokens[HOST] += host
            self.hit_tokens[DISK] += disk
            self.miss_tokens += prompt_tokens - device - host - disk
            self.lower_tier_hit_tokens += host + disk
            self.lower_tier_covered_tokens += covered_by_prefetch

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            hits = sum(self.hit_tokens.values())
            prefetch = {}
            for kind, d in self.prefetch.items():
                promoted = d["promoted_tokens"]
                prefetch[kind] = dict(d, precision=(d["used_tokens"] / promoted) if promoted else None)
            return {
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "hit_tokens": dict(self.hit_tokens),
                "miss_tokens": self.miss_tokens,
                "hit_rate": hits / self.prompt_tokens if self.prompt_tokens else 0.0,
                "evicted_tokens": dict(self.evicted_tokens),
                "demoted_tokens": dict(self.demoted_tokens),
                "promoted_tokens": dict(self.promoted_tokens),
                "dropped_tokens": self.dropped_tokens,
                "dropped_dirty_tokens": dict(self.dropped_dirty_tokens),
                "bytes_moved": dict(self.bytes_moved),
                "transfer_seconds": dict(self.transfer_seconds),
                "prefetch": prefetch,
                "coverage": (self.lower_tier_covered_tokens / self.lower_tier_hit_tokens)
                if self.lower_tier_hit_tokens
                else None,
                "load_wait_seconds": self.load_wait_seconds,
                "loads_waited": self.loads_waited,
                "loads_recomputed": self.loads_recomputed,
                "errors": dict(self.errors),
            }

    def to_json(self, **extra: Any) -> str:
        return json.dumps({**self.snapshot(), **extra}, indent=2, sort_keys=True)


def prometheus_text(
    snapshot: dict[str, Any],
    stored_pages: dict[str, int] | None = None,
    page_size: int = 1,
    prefix: str = "sgl_hicache",
) -> str:
    """Prometheus exposition of a snapshot. Hit counters also use SGLang's own name,
    `sglang:cached_tokens_total{cache_source=...}`, so existing dashboards keep working."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    source = {DEVICE: "device", HOST: "host", DISK: "storage"}
    # the lower-tier slot is labelled by what holds it: "disk", or "store" for a shared store
    tier_label = {DEVICE: DEVICE, HOST: HOST, DISK: snapshot.get("lower_tier", DISK)}
    metric(
        "sglang:cached_tokens_total",
        "counter",
        "Prompt tokens served from cache, by source",
        [(f'{{cache_source="{source[t]}"}}', snapshot["hit_tokens"][t]) for t in TIERS],
    )
    metric(
        f"{prefix}_hit_tokens_total",
        "counter",
        "Prompt tokens served per tier",
        [(f'{{tier="{tier_label[t]}"}}', snapshot["hit_tokens"][t]) for t in TIERS],
    )
    metric(f"{prefix}_miss_tokens_total", "counter", "Prompt tokens computed", [("", snapshot["miss_tokens"])])
    metric(f"{prefix}_prompt_tokens_total", "counter", "Prompt tokens seen", [("", snapshot["prompt_tokens"])])
    metric(f"{prefix}_requests_total", "counter", "Requests scheduled", [("", snapshot["requests"])])
    for field in ("evicted_tokens", "demoted_tokens", "promoted_tokens"):
        metric(
            f"{prefix}_{field}_total",
            "counter",
            f"{field.replace('_', ' ')} per tier",
            [(f'{{tier="{t}"}}', snapshot[field][t]) for t in TIERS],
        )
    metric(
        f"{prefix}_bytes_moved_total",
        "counter",
        "Bytes copied per link",
        [(f'{{link="{link}"}}', v) for link, v in snapshot["bytes_moved"].items()],
    )
    for kind, d in snapshot["prefetch"].items():
        for field in ("promoted_tokens", "used_tokens", "wasted_tokens"):
            metric(f"{prefix}_{kind}_{field}_total", "counter", f"{kind} {field.replace('_', ' ')}", [("", d[field])])
    metric(
        f"{prefix}_errors_total",
        "counter",
        "Tier errors by kind",
        [(f'{{error="{k}"}}', v) for k, v in sorted(snapshot["errors"].items())] or [('{error="none"}', 0)],
    )
    stored = (
        {t: stored_pages[t] * page_size for t in TIERS} if stored_pages is not None else snapshot.get("stored_tokens")
    )
    if stored is not None:
        metric(
            f"{prefix}_stored_tokens",
            "gauge",
            "Tokens resident per tier",
            [(f'{{tier="{t}"}}', stored.get(t, 0)) for t in TIERS],
        )
    calls = snapshot.get("scheduler_calls")
    if calls:  # per-call wall time on SGLang's scheduler thread (sglang.call_timer)
        metric(
            f"{prefix}_scheduler_call_count",
            "counter",
            "Cache calls made by the scheduler thread",
            [(f'{{call="{c}"}}', d["count"]) for c, d in calls.items()],
        )
        for q in ("p50", "p99", "max"):
            metric(
                f"{prefix}_scheduler_call_{q}_seconds",
                "gauge",
                f"{q} wall time of a cache call on the scheduler thread",
                [(f'{{call="{c}"}}', d[f"{q}_us"] / 1e6) for c, d in calls.items()],
            )
    if snapshot.get("capacity_tokens") is not None:
        metric(
            f"{prefix}_capacity_tokens",
            "gauge",
            "Tier capacity in tokens",
            [(f'{{tier="{t}"}}', snapshot["capacity_tokens"].get(t, 0)) for t in TIERS],
        )
    store = snapshot.get("store")
    if store:
        for name, value in sorted(store.items()):
            if isinstance(value, int) and not isinstance(value, bool) and name != "tracked_pages":
                metric(
                    f"{prefix}_store_{name}_total",
                    "counter",
                    f"shared store tier: {name.replace('_', ' ')}",
                    [("", value)],
                )
        metric(
            f"{prefix}_store_tracked_pages",
            "gauge",
            "store pages this server's tree tracks",
            [("", store.get("tracked_pages", 0))],
        )
        metric(
            f"{prefix}_store_available",
            "gauge",
            "1 while the shared store answers, 0 while it is backed off",
            [("", int(bool(store.get("available"))))],
        )
    return "\n".join(lines) + "\n"
