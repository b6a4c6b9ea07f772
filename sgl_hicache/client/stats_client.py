"""Read the live stats of a server that runs the `sgl_hicache` backend (no sglang import).

`fetch_stats(target)`:
- `http://HOST:PORT` (the SGLang server's own URL): `GET /server_info`, whose `internal_states[i]`
  SGLang's scheduler builds; our plugin hooks that report so it carries `sgl_hicache`: the cache
  snapshot (per-tier hits, promotions, demotions, evictions, bytes per link, prefetch figures), the
  backend's counters, the pool accounting (allocator free tokens vs. the tree's) and the tree view,
  all computed in the scheduler thread, so the figures are exact and current.
- a file path: the JSON stats file the scheduler writes every `stats_interval_s` when
  `SGLHICACHE_STATS_FILE` (or `stats_file` in the config) is set (no pool accounting / tree there).

Prometheus: with `--enable-metrics`, SGLang's own `GET /metrics` carries
`sglang:cached_tokens_total{cache_source="device"|"host"|"storage"}` (from our per-request
`cached_tokens_details`) plus our `sgl_hicache_*` counters and gauges. `fetch_metrics(url)` returns
those lines.

`render(stats)` formats a snapshot as the per-tier table + tree view `sgl-hicache stats` prints.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TIERS = ("device", "host", "disk")


class StatsError(RuntimeError):
    """The target could not be read, or it does not run the sgl_hicache backend."""


def http_get(url: str, timeout: float) -> bytes:
    """The body of ``GET url``; StatsError with a one-line reason when the server cannot be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        raise StatsError(f"GET {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise StatsError(f"cannot reach {url}: {getattr(e, 'reason', e)}; is the server running?") from None


def fetch_stats(target: str, timeout: float = 10.0) -> dict[str, Any]:
    """Stats of one server (URL) or from a stats file (path); see the module docstring.
    With several scheduler ranks the first one that reports is returned, under `ranks` all of them."""
    if target.startswith(("http://", "https://")):
        base = target.rstrip("/")
        raw = http_get(f"{base}/server_info", timeout)
        try:
            info = json.loads(raw)
        except ValueError as e:
            raise StatsError(f"{base}/server_info is not JSON: {e}") from None
        ranks = [
            s["sgl_hicache"] for s in info.get("internal_states") or [] if isinstance(s, dict) and "sgl_hicache" in s
        ]
        if not ranks:
            backend = next(
                (s.get("radix_cache_backend") for s in info.get("internal_states") or [] if isinstance(s, dict)), None
            )
            raise StatsError(
                f"{base} does not report sgl_hicache stats (radix_cache_backend={backend!r}); start it with --radix-cache-backend sgl_hicache"
            )
        out = dict(ranks[0])
        out["source"] = f"{base}/server_info"
        if len(ranks) > 1:
            out["ranks"] = ranks
        return out
    path = Path(target).expanduser()
    try:
        out = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatsError(f"no stats file {str(path)!r} (set SGLHICACHE_STATS_FILE on the server)") from None
    except (OSError, ValueError) as e:
        raise StatsError(f"cannot read stats file {str(path)!r}: {e}") from None
    out["source"] = str(path)
    return out


def fetch_metrics(url: str, timeout: float = 10.0) -> list[str]:
    """The `sglang:cached_tokens_total` and `sgl_hicache_*` sample lines of SGLang's `/metrics`."""
    text = http_get(url.rstrip("/") + "/metrics", timeout).decode("utf-8", "replace")
    return [ln for ln in text.splitlines() if ln.startswith(("sglang:cached_tokens_total", "sgl_hicache_"))]


def render(stats: dict[str, Any], tree: bool = True) -> str:
    """A per-tier table (hits, stored / capacity, promoted, demoted, evicted) and the tree view."""
    lines = []
    req = stats.get("requests", 0)
    prompt = stats.get("prompt_tokens", 0)
    lines.append(
        f"requests {req}   prompt tokens {prompt}   hit rate {stats.get('hit_rate', 0.0):.1%}   miss tokens {stats.get('miss_tokens', 0)}"
    )
    hdr = f"{'tier':<7}{'hit tok':>10}{'stored':>10}{'capacity':>11}{'promoted':>10}{'demoted':>10}{'evicted':>10}"
    lines.append(hdr)
    for t in TIERS:
        lines.append(
            f"{t:<7}{stats.get('hit_tokens', {}).get(t, 0):>10}{stats.get('stored_tokens', {}).get(t, 0):>10}"
            f"{stats.get('capacity_tokens', {}).get(t, 0):>11}{stats.get('promoted_tokens', {}).get(t, 0):>10}"
            f"{stats.get('demoted_tokens', {}).get(t, 0):>10}{stats.get('evicted_tokens', {}).get(t, 0):>10}"
        )
    moved = stats.get("bytes_moved") or {}
    if moved:
        lines.append("bytes moved: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in moved.items()))
    for kind, d in (stats.get("prefetch") or {}).items():
        prec = d.get("precision")
        lines.append(
            f"{kind}: promoted {d.get('promoted_tokens', 0)} used {d.get('used_tokens', 0)} wasted {d.get('wasted_tokens', 0)}"
            + (f" precision {prec:.1%}" if prec is not None else "")
        )
    b = stats.get("backend") or {}
    if b:
        lines.append(
            f"load-backs {b.get('load_backs', 0)} ({b.get('load_back_tokens', 0)} tok, {b.get('load_back_seconds', 0.0):.3f} s), "
            f"declined {b.get('load_back_declined', 0)}, retries {b.get('load_back_retries', 0)}, timeouts {b.get('load_back_timeouts', 0)}, "
            f"prefetch jobs {b.get('prefetch_jobs', 0)} ({b.get('prefetch_tokens', 0)} tok)"
        )
    pool = stats.get("pool")
    if pool:
        lines.append(
            f"device pool {pool['device_pool_tokens']} tok: free {pool['device_free_tokens']}, cache {pool['device_cache_owned_tokens']}, "
            f"requests {pool['request_held_tokens']}; evictable {pool['evictable_tokens']}, protected {pool['protected_tokens']}; check {pool['check']}"
        )
    hints = stats.get("hints")
    if hints:
        applied = ", ".join(f"{k} {v}" for k, v in (hints.get("applied") or {}).items())
        lines.append(
            f"hint API :{hints.get('port')}: applied {applied}; acted on {hints.get('acted_tokens', 0)} tok, "
            f"rejected {hints.get('rejected', 0)}, pins {hints.get('pins', 0)} ({hints.get('pinned_tokens', 0)} tok)"
            + (f"; last error: {hints['last_error']}" if hints.get("last_error") else "")
        )
    if stats.get("errors"):
        lines.append("errors: " + ", ".join(f"{k}={v}" for k, v in stats["errors"].items()))
    if tree and stats.get("tree_text"):
        lines.append("tree ([DHK] = device/host/disk):")
        lines.append(stats["tree_text"])
    return "\n".join(lines)


__all__ = ["StatsError", "fetch_metrics", "fetch_stats", "http_get", "render"]
