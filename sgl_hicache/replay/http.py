"""The HTTP replayer: send a trace's requests to a real SGLang server and measure it.

Each request goes to SGLang's native `POST /generate` with the trace's token ids (`input_ids`),
`stream: true`, greedy sampling (`temperature 0`) and `max_new_tokens = output_length` (capped by
`max_new_tokens`, and `ignore_eos` so the length is the trace's). Times are wall-clock:

- TTFT: from sending the request to the first streamed chunk that carries an output token;
- latency: from sending to the end of the stream; throughput: (prompt + output tokens) / wall time;
- per-tier hits: the final chunk's `meta_info.cached_tokens_details` (`device`, `host`, `storage` ->
  our `disk`); a server without details reports `cached_tokens` as device hits.

Pacing: `concurrency` worker threads, closed loop (the next request starts when one finishes), or with
`trace_clock` each request is sent at its trace arrival time x `time_scale`, at most `concurrency` in
flight. A failed request (HTTP error, timeout, broken stream) is counted in `errors`, never raised.

The report has the embedded engine's format (`engine.report.policy_report`): requests, prompt_tokens,
hit_tokens{device,host,disk}, miss_tokens, hit_rate, ttft_s{mean,p50,p90,p99,max}, throughput_tok_s,
... plus `bytes_moved` and `prefetch` taken from the server's `sgl_hicache` stats (the difference
between before and after the replay) when the server runs the sgl_hicache backend, else `{}` and null
figures. Nothing here imports sglang.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..engine.report import RequestRecord
from .trace import Request


@dataclass
class HttpRecord(RequestRecord):
    """One request's outcome as `policy_report` reads it, plus what the server returned or what went wrong."""

    output_ids: list[int] = field(default_factory=list)
    error: str | None = None


def _split_url(url: str) -> tuple[str, str, int, str]:
    u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    if u.scheme not in ("http", "https"):
        raise ValueError(f"--url must be http://HOST:PORT, got {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    return u.scheme, u.hostname or "127.0.0.1", port, u.path.rstrip("/")


def generate_stream(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    timeout_s: float = 600.0,
    extra_sampling: dict | None = None,
) -> dict[str, Any]:
    """One streamed greedy `/generate`. Returns {ttft_s, latency_s, output_ids, meta_info}; raises on
    a transport or HTTP error (the replayer counts those)."""
    scheme, host, port, base = _split_url(url)
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    sampling = {"max_new_tokens": int(max_new_tokens), "temperature": 0.0, "ignore_eos": True, **(extra_sampling or {})}
    body = json.dumps({"input_ids": [int(t) for t in input_ids], "sampling_params": sampling, "stream": True}).encode()
    conn = conn_cls(host, port, timeout=timeout_s)
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] | None = None
    out_ids: list[int] = []
    try:
        conn.request("POST", f"{base}/generate", body, {"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(2000).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {resp.status}: {detail.strip()[:300]}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk and "meta_info" not in chunk:
                raise RuntimeError(f"server error: {str(chunk['error'])[:300]}")
            ids = chunk.get("output_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            if ids:
                # SGLang streams the cumulative output by default, increments with
                # --incremental-streaming-output; the completion count tells which.
                done = (chunk.get("meta_info") or {}).get("completion_tokens")
                if done is not None and len(ids) == done:
                    out_ids = list(ids)
                else:
                    out_ids.extend(ids)
            last = chunk
    finally:
        conn.close()
    latency = time.perf_counter() - t0
    if last is None:
        raise RuntimeError("empty stream")
    meta = last.get("meta_info") or {}
    if ttft is None:  # no output token streamed (max_new_tokens=0): the end is the first answer
        ttft = latency
    return {"ttft_s": ttft, "latency_s": latency, "output_ids": out_ids, "meta_info": meta}


def hits_from_meta(meta: dict[str, Any]) -> tuple[int, int, int]:
    """(device, host, disk) cached tokens of one reply."""
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict):
        return int(details.get("device", 0) or 0), int(details.get("host", 0) or 0), int(details.get("storage", 0) or 0)
    return int(meta.get("cached_tokens", 0) or 0), 0, 0


def _server_stats(url: str) -> dict[str, Any] | None:
    try:
        from ..sglang.stats_client import StatsError, fetch_stats
    except ImportError:  # pragma: no cover
        return None
    try:
        return fetch_stats(url, timeout=10.0)
    except StatsError:
        return None


def _diff(after: Any, before: Any) -> Any:
    """after - before for nested dicts of numbers (ratios recomputed by the caller)."""
    if isinstance(after, dict):
        return {k: _diff(v, before.get(k) if isinstance(before, dict) else None) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def replay_http(
    requests: Sequence[Request],
    url: str,
    concurrency: int = 4,
    *,
    max_new_tokens: int | None = None,
    trace_clock: bool = False,
    time_scale: float = 1.0,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
    keep_outputs: bool = False,
) -> dict[str, Any]:
    """Replay `requests` against the server at `url`; returns the report (see the module docstring).

    `max_new_tokens` caps each request's output length; `keep_outputs` adds per-request records
    (`records`: id, ttft, hits, output ids, error) to the report."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    _split_url(url)
    from ..engine.report import policy_report

    before = _server_stats(url)
    reqs = sorted(requests, key=lambda r: r.arrival_s) if trace_clock else list(requests)
    total = len(reqs)
    records: list[HttpRecord] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def one(req: Request) -> None:
        n_out = req.output_length if max_new_tokens is None else min(req.output_length, max_new_tokens)
        sent = time.perf_counter() - start
        try:
            r = generate_stream(url, req.input_ids, n_out, timeout_s=timeout_s)
            d, h, k = hits_from_meta(r["meta_info"])
            rec = HttpRecord(req.request_id, sent, r["ttft_s"], sent + r["latency_s"], len(req.input_ids),
                             len(r["output_ids"]), d, h, k, r["output_ids"] if keep_outputs else [])
        except Exception as e:  # counted, never raised: one bad request must not end the replay
            now = time.perf_counter() - start
            rec = HttpRecord(req.request_id, sent, 0.0, now, len(req.input_ids), 0, error=f"{type(e).__name__}: {e}"[:500])
        with lock:
            records.append(rec)
            done = len(records)
        if progress is not None:
            progress(done, total)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sgl-hicache-replay") as pool:
        if trace_clock:
            t_first = reqs[0].arrival_s if reqs else 0.0
            sem = threading.Semaphore(concurrency)

            def paced(req: Request) -> None:
                try:
                    one(req)
                finally:
                    sem.release()

            futures = []
            for req in reqs:
                delay = (req.arrival_s - t_first) * time_scale - (time.perf_counter() - start)
                if delay > 0:
                    time.sleep(delay)
                sem.acquire()
                futures.append(pool.submit(paced, req))
            for f in futures:
                f.result()
        else:
            list(pool.map(one, reqs))
    duration = time.perf_counter() - start
    after = _server_stats(url)
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    snapshot: dict[str, Any] = {}
    if before is not None and after is not None:
        delta = _diff(after, before)
        snapshot = {"bytes_moved": delta.get("bytes_moved", {}), "prefetch": delta.get("prefetch", {}),
                    "loads_waited": delta.get("loads_waited", 0), "loads_recomputed": delta.get("loads_recomputed", 0),
                    "stored_tokens": after.get("stored_tokens", {}), "capacity_tokens": after.get("capacity_tokens", {}),
                    "errors": delta.get("errors", {}), "coverage": after.get("coverage")}
        for d in snapshot["prefetch"].values():
            if isinstance(d, dict):
                d["precision"] = (d.get("used_tokens", 0) / d["promoted_tokens"]) if d.get("promoted_tokens") else None
    settings = {"url": url, "concurrency": concurrency, "max_new_tokens": max_new_tokens, "trace_clock": trace_clock, "time_scale": time_scale}
    report = policy_report(records=ok, snapshot=snapshot, duration_s=duration, settings=settings)
    if after is None:
        report["bytes_moved"] = {}
        report["prefetch"] = {k: None for k in report["prefetch"]}
        report["predict"] = {k: None for k in report["predict"]}
    report["errors"] = {"requests_failed": len(failed), **({"first_error": failed[0].error} if failed else {}), **snapshot.get("errors", {})}
    report["requests_sent"] = total
    report["requests_failed"] = len(failed)
    report["server_stats"] = after
    if keep_outputs:
        report["records"] = [vars(r) for r in sorted(records, key=lambda r: r.arrival_s)]
    return report


__all__ = ["HttpRecord", "generate_stream", "hits_from_meta", "replay_http"]
