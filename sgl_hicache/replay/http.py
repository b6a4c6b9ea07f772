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

The report has the embedded engine's format (`report.policy_report`): requests, prompt_tokens,
hit_tokens{device,host,disk}, miss_tokens, hit_rate, ttft_s{mean,p50,p90,p99,max}, throughput_tok_s,
... plus `bytes_moved` and `prefetch` taken from the server's `sgl_hicache` stats (the difference
between before and after the replay) when the server runs the sgl_hicache backend, else `{}` and null
figures. Nothing here imports sglang.

What the server serves (`probe_server`): the vocabulary size, context length, longest accepted prompt
(`max_req_input_len`: SGLang aborts a prompt of that length or more, bounded by the context and the KV
pool) and page size. SGLang 0.5.23's HTTP API does not publish the vocabulary (`/model_info` leaves
`hf_config` out; `/server_info` is the server arguments + `max_req_input_len` / `max_total_num_tokens`),
so it is read, in this order, from `internal_states[0]["sgl_hicache_model"]` (our plugin adds it to
`/server_info` in every SGLang process where it is installed: the scheduler's `model_config`), else from
`config.json` in the served model folder when this machine can read it; otherwise `probe_server`
raises `ServerError` asking for an explicit vocabulary size. Token ids must stay below the vocabulary
(an id outside it kills SGLang 0.5.23's scheduler with an IndexError in the embedding), so
`replay_http` refuses such a request before sending anything. `usable_vocab` also keeps synthesised
ids below the model's special tokens when those sit at the top of the vocabulary (Llama 3, Qwen):
image / audio placeholder ids there would make a multimodal model read the prompt as media.

Hints: a request's `hints` (plain JSONL, `replay/hints.py`) go to the server's hint API (`POST /hints`,
`sglang/hint_server.py`) at the request's send time + the hint's `after_s` (x `time_scale` with
`trace_clock`), or with ``at_finish`` `after_s` after its reply ended, as the embedded engine applies
them (arrival or finish + `after_s`); a hint naming a session is
resolved here to that session's latest prompt before the request (the server tracks no sessions). The
API is `hint_url`, or the one the server's stats name (`hints.port`, served with `--hint-port`). A trace
with hints and no hint API answering is a ServerError before anything is sent; a refused hint (4xx) is
counted with its reason in the report's `hints`; an API that stops answering is `hints.endpoint_error`.
With `hints_in_request` (trace clock only), the hints travel in the requests instead, as an agent
framework sends them (`replay/in_request.py`: ``custom_params.agent_hints`` on each turn of a hinted
session, and standalone one-token prefetch calls at their times); the prefetch calls are not
measured requests: the report counts them under `in_request_hints`, with the server's
`agent_hints` counters after the replay (since the server started).

Prompts longer than the server takes: like SGLang's `bench_serving` (which prunes a dataset row when
``prompt_len + output_len > context_len``), such requests are skipped, not truncated; also skipped is a
prompt of `max_req_input_len` tokens or more (SGLang would abort it). The report counts them
(`requests_skipped`, `skipped`).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..client.model_facts import model_facts, special_token_ids  # re-exported (__all__)
from ..records import RequestRecord
from .hint_client import HintApiError, HintCounts, HintSender, hint_api_status, hint_api_url, resolve_hints
from .in_request import plan_in_request_hints
from .trace import Request


class ServerError(RuntimeError):
    """The server cannot be reached, or does not say what the replay needs to know."""


@dataclass
class ServerModel:
    """What a server serves, as far as the replay needs it (see the module docstring)."""

    url: str
    vocab_size: int
    vocab_source: str
    context_len: int | None = None
    max_input_len: int | None = None
    page_size: int | None = None
    max_total_tokens: int | None = None
    special_token_ids: list[int] = field(default_factory=list)
    model_path: str | None = None

    @property
    def usable_vocab(self) -> int:
        """Ids below this are plain tokens: the vocabulary minus special tokens at its top end."""
        top = [t for t in self.special_token_ids if self.vocab_size // 2 <= t < self.vocab_size]
        return min([self.vocab_size, *top])

    def describe(self) -> str:
        parts = [f"vocab {self.vocab_size} ({self.vocab_source})"]
        if self.usable_vocab != self.vocab_size:
            parts.append(f"ids < {self.usable_vocab} (special tokens above)")
        if self.context_len is not None:
            parts.append(f"context {self.context_len}")
        if self.max_input_len is not None:
            parts.append(f"prompts < {self.max_input_len} tokens")
        if self.page_size is not None:
            parts.append(f"page {self.page_size}")
        return ", ".join(parts)


def _get_json(url: str, timeout: float) -> Any:
    from ..client.stats_client import StatsError, http_get

    try:
        raw = http_get(url, timeout)
    except StatsError as e:
        raise ServerError(str(e)) from None
    try:
        return json.loads(raw)
    except ValueError:
        raise ServerError(f"GET {url} did not return JSON; is this an SGLang server?") from None


def _local_config(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    from pathlib import Path

    file = Path(path).expanduser() / "config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def probe_server(url: str, *, vocab_size: int | None = None, timeout: float = 10.0) -> ServerModel:
    """Ask the server at `url` what it serves. `vocab_size` overrides the server's answer (and is
    the only way to replay against a server that does not tell it). Raises ServerError."""
    _split_url(url)
    base = url.rstrip("/") if "://" in url else "http://" + url.rstrip("/")
    info = _get_json(f"{base}/server_info", timeout)
    if not isinstance(info, dict):
        raise ServerError(f"GET {base}/server_info did not return an object; is this an SGLang server?")
    model_info: dict[str, Any] = {}
    try:
        got = _get_json(f"{base}/model_info", timeout)
        model_info = got if isinstance(got, dict) else {}
    except ServerError:
        pass
    model_path = model_info.get("model_path") or info.get("model_path")
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    facts = next((s["sgl_hicache_model"] for s in states if isinstance(s.get("sgl_hicache_model"), dict)), None)
    cfg = _local_config(model_path) if facts is None else None
    text_cfg = (
        cfg.get("text_config") if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict) else cfg
    ) or {}
    context = _int_or_none(info.get("context_length"))
    specials: list[int] = []
    if facts is not None:
        server_vocab, source = _int_or_none(facts.get("vocab_size")), "server"
        context = context or _int_or_none(facts.get("context_len"))
        specials = [int(t) for t in facts.get("special_token_ids") or []]
    elif cfg is not None:
        server_vocab, source = _int_or_none(text_cfg.get("vocab_size")), f"{model_path}/config.json"
        context = context or _int_or_none(text_cfg.get("max_position_embeddings"))
        specials = special_token_ids(cfg)
    else:
        server_vocab, source = None, ""
    if vocab_size is not None:
        server_vocab, source = vocab_size, "--vocab-size"
    if server_vocab is None:
        raise ServerError(
            f"{base} does not tell its vocabulary size (no sgl_hicache plugin in the server, and its model "
            f"{model_path!r} is not a folder readable here); pass --vocab-size"
        )
    return ServerModel(
        url=base,
        vocab_size=server_vocab,
        vocab_source=source,
        context_len=context,
        max_input_len=_int_or_none(info.get("max_req_input_len")),
        page_size=_int_or_none(info.get("page_size")),
        max_total_tokens=_int_or_none(info.get("max_total_num_tokens")),
        special_token_ids=specials,
        model_path=model_path,
    )


def fit_requests(
    requests: Sequence[Request], server: ServerModel, max_new_tokens: int | None = None
) -> tuple[list[Request], dict[str, Any]]:
    """The requests the server can take, and what was skipped: like SGLang's bench_serving, a request
    whose prompt + output exceeds the context is dropped (not truncated), and so is a prompt SGLang
    would abort (`max_req_input_len` tokens or more: context or KV pool too small)."""
    kept: list[Request] = []
    too_long = over_pool = 0
    first: str | None = None
    for req in requests:
        n_out = req.output_length if max_new_tokens is None else min(req.output_length, max_new_tokens)
        n_in = len(req.input_ids)
        if server.context_len is not None and n_in + n_out > server.context_len:
            too_long += 1
            first = first or f"{req.request_id}: {n_in} prompt + {n_out} output tokens > context {server.context_len}"
        elif server.max_input_len is not None and n_in >= server.max_input_len:
            over_pool += 1
            first = first or f"{req.request_id}: {n_in} prompt tokens >= the server's limit {server.max_input_len}"
        else:
            kept.append(req)
    skipped: dict[str, Any] = {
        "requests": too_long + over_pool,
        "over_context": too_long,
        "over_max_input": over_pool,
        "context_len": server.context_len,
        "max_input_len": server.max_input_len,
    }
    if first:
        skipped["first"] = first
    return kept, skipped


def check_vocab(requests: Sequence[Request], vocab_size: int) -> None:
    """Raise ValueError naming the first request with a token id outside ``[0, vocab_size)``."""
    for req in requests:
        ids = req.input_ids
        if len(ids) and (max(ids) >= vocab_size or min(ids) < 0):
            bad = next(t for t in ids if t >= vocab_size or t < 0)
            raise ValueError(
                f"request {req.request_id} has token id {bad}, outside the server's vocabulary of {vocab_size} "
                "(it would crash SGLang's scheduler); synthesise ids with the server's vocabulary size"
            )


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
        conn.request(
            "POST", f"{base}/generate", body, {"Content-Type": "application/json", "Accept": "text/event-stream"}
        )
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
        raise RuntimeError("the server closed the stream without a reply (did it crash? see its log)")
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


def _healthy(url: str, timeout: float = 5.0) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def _server_stats(url: str) -> dict[str, Any] | None:
    try:
        from ..client.stats_client import StatsError, fetch_stats
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


def _hint_api(
    url: str, hint_url: str | None, stats: dict[str, Any] | None, n_hints: int
) -> tuple[str, dict[str, Any]] | None:
    """(the hint API's URL, its counters now) when the trace carries hints or `hint_url` is given;
    ServerError when the trace carries hints and no hint API answers."""
    if not n_hints and hint_url is None:
        return None
    target = hint_url or hint_api_url(url, stats)
    if target is None:
        raise ServerError(
            f"the trace carries {n_hints} hints, but the server at {url} serves no hint API (its stats name "
            "no hint port): start it with --hint-port P (SGLHICACHE_HINT_PORT), or pass --hint-url"
        )
    try:
        return target, hint_api_status(target)
    except (HintApiError, ValueError) as e:
        raise ServerError(f"{e}; the trace's {n_hints} hints cannot be sent (--hint-url names the hint API)") from None


def _hint_report(api: tuple[str, dict[str, Any]], counts: HintCounts, unresolved: list[str]) -> dict[str, Any]:
    """The report's `hints`: what was sent and refused, and what the server applied meanwhile (its
    `GET /hints` counters after minus before; `server` is None when it no longer answers)."""
    url, before = api
    out: dict[str, Any] = {
        "url": url + "/hints",
        "sent": counts.sent,
        "accepted": counts.accepted,
        "refused": counts.refused,
        "unsent": counts.unsent,
        "unresolved": len(unresolved),
        "refusals": counts.refusals,
        "first_error": counts.first_error or (unresolved[0] if unresolved else None),
        "endpoint_error": counts.endpoint_error,
        "server": None,
    }
    if counts.endpoint_error is None:
        try:
            after = hint_api_status(url)
            deadline = time.monotonic() + 5.0
            while after.get("queued") and time.monotonic() < deadline:  # the scheduler drains the queue every step
                time.sleep(0.05)
                after = hint_api_status(url)
        except HintApiError as e:
            out["endpoint_error"] = str(e)
        else:
            out["server"] = {
                "applied": _diff(after.get("applied") or {}, before.get("applied") or {}),
                "rejected": _diff(after.get("rejected", 0), before.get("rejected", 0)),
                "acted_tokens": _diff(after.get("acted_tokens", 0), before.get("acted_tokens", 0)),
                "pins": after.get("pins"),
                "last_error": after.get("last_error"),
            }
    return out


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
    server: ServerModel | None = None,
    hint_url: str | None = None,
    hints_in_request: bool = False,
) -> dict[str, Any]:
    """Replay `requests` against the server at `url`; returns the report (see the module docstring).

    `max_new_tokens` caps each request's output length; `keep_outputs` adds per-request records
    (`records`: id, ttft, hits, output ids, error) to the report. `server` is what `probe_server`
    said (probed here when None): a token id outside its vocabulary is a ValueError before anything
    is sent; requests too long for it are skipped and counted (`requests_skipped`, `skipped`).
    Requests' `hints` go to the hint API at `hint_url` (default: the one the server's stats name) at
    their request's send time + `after_s` (`replay/hint_client.py`); the report's `hints` counts
    them. ServerError before anything is sent when the trace has hints and no hint API answers.
    `hints_in_request` (needs `trace_clock`) sends the hints in the requests instead (module docstring)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if hints_in_request and not trace_clock:
        raise ValueError("hints_in_request needs trace_clock: the prefetch calls go at their trace times")
    _split_url(url)
    from ..report import policy_report

    if server is None:
        server = probe_server(url)
    check_vocab(requests, server.vocab_size)
    fitting, skipped = fit_requests(requests, server, max_new_tokens)
    before = _server_stats(url)
    plan = plan_in_request_hints(fitting, time_scale=time_scale) if hints_in_request else None
    hinted, unresolved = resolve_hints(fitting) if plan is None else ({}, [])
    hints = _hint_api(url, hint_url, before, sum(map(len, hinted.values())) + len(unresolved))
    controls = plan.prefetch_ids if plan is not None else frozenset()
    if plan is not None:
        check_vocab(plan.prefetches, server.vocab_size)
        fitting = [*fitting, *plan.prefetches]
    reqs = sorted(fitting, key=lambda r: r.arrival_s) if trace_clock else list(fitting)
    total = len(reqs) - len(controls)
    records: list[HttpRecord] = []
    control_records: list[HttpRecord] = []
    lock = threading.Lock()
    sender = HintSender(hints[0]) if hints is not None else None
    hint_scale = time_scale if trace_clock else 1.0
    followers: list[threading.Timer] = []  # prefetch calls sent a while after their turn's reply ends
    start = time.perf_counter()

    def one(req: Request) -> None:
        n_out = req.output_length if max_new_tokens is None else min(req.output_length, max_new_tokens)
        sent = time.perf_counter() - start
        if sender is not None:
            for hint in hinted.get(id(req), ()):
                if not hint.hint.at_finish:
                    sender.schedule(start + sent + hint.hint.after_s * hint_scale, hint)
        try:
            extra = plan.sampling(req.request_id) if plan is not None else None
            r = generate_stream(url, req.input_ids, n_out, timeout_s=timeout_s, extra_sampling=extra)
            d, h, k = hits_from_meta(r["meta_info"])
            rec = HttpRecord(
                req.request_id,
                sent,
                r["ttft_s"],
                sent + r["latency_s"],
                len(req.input_ids),
                len(r["output_ids"]),
                d,
                h,
                k,
                req.preceded_by,
                r["output_ids"] if keep_outputs else [],
            )
        except Exception as e:  # counted, never raised: one bad request must not end the replay
            now = time.perf_counter() - start
            rec = HttpRecord(
                req.request_id,
                sent,
                0.0,
                now,
                len(req.input_ids),
                0,
                preceded_by=req.preceded_by,
                error=f"{type(e).__name__}: {e}"[:500],
            )
        if sender is not None:  # the hints that run from the request's end (a tool call starts then)
            for hint in hinted.get(id(req), ()):
                if hint.hint.at_finish:
                    sender.schedule(time.perf_counter() + hint.hint.after_s * hint_scale, hint)
        with lock:
            for delay_s, call in plan.after_finish.get(req.request_id, ()) if plan is not None else ():
                timer = threading.Timer(delay_s * time_scale, one, args=(call,))
                timer.daemon = True
                timer.start()
                followers.append(timer)
            if req.request_id in controls:
                control_records.append(rec)
                return
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
    for timer in followers:  # every turn has ended: no timer is added any more
        timer.join()
    # the hints due after the last request ended are sent too, at their time (the trace says so)
    hint_report = _hint_report(hints, sender.close(), unresolved) if sender is not None and hints is not None else None
    after = _server_stats(url)
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    snapshot: dict[str, Any] = {}
    if before is not None and after is not None:
        delta = _diff(after, before)
        snapshot = {
            "bytes_moved": delta.get("bytes_moved", {}),
            "prefetch": delta.get("prefetch", {}),
            "loads_waited": delta.get("loads_waited", 0),
            "loads_recomputed": delta.get("loads_recomputed", 0),
            "stored_tokens": after.get("stored_tokens", {}),
            "capacity_tokens": after.get("capacity_tokens", {}),
            "errors": delta.get("errors", {}),
            "coverage": after.get("coverage"),
        }
        for d in snapshot["prefetch"].values():
            if isinstance(d, dict):
                d["precision"] = (d.get("used_tokens", 0) / d["promoted_tokens"]) if d.get("promoted_tokens") else None
    settings = {
        "url": url,
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "trace_clock": trace_clock,
        "time_scale": time_scale,
    }
    report = policy_report(records=ok, snapshot=snapshot, duration_s=duration, settings=settings)
    if after is None:
        report["bytes_moved"] = {}
        report["prefetch"] = dict.fromkeys(report["prefetch"])
        report["predict"] = dict.fromkeys(report["predict"])
    first_error = min(failed, key=lambda r: r.arrival_s).error if failed else None
    if failed and not _healthy(url):
        first_error = f"{first_error} (and the server no longer answers /health: it died during the replay)"
    report["errors"] = {
        "requests_failed": len(failed),
        **({"first_error": first_error} if failed else {}),
        **snapshot.get("errors", {}),
    }
    report["requests_sent"] = total
    report["requests_failed"] = len(failed)
    report["requests_skipped"] = skipped["requests"]
    report["skipped"] = skipped
    report["server"] = dataclasses.asdict(server)
    report["server_stats"] = after
    if hint_report is not None:
        report["hints"] = hint_report
    if plan is not None:
        bad = [r for r in control_records if r.error is not None]
        report["in_request_hints"] = {
            "requests_with_hints": sum(
                1 for r in fitting if r.request_id in plan.agent_hints and r.request_id not in controls
            ),
            "prefetches_sent": len(control_records),
            "prefetches_failed": len(bad),
            "first_error": bad[0].error if bad else None,
            "server": after.get("agent_hints") if isinstance(after, dict) else None,
        }
    if keep_outputs:
        report["records"] = [vars(r) for r in sorted(records, key=lambda r: r.arrival_s)]
    return report


__all__ = [
    "HttpRecord",
    "ServerError",
    "ServerModel",
    "check_vocab",
    "fit_requests",
    "generate_stream",
    "hits_from_meta",
    "model_facts",
    "probe_server",
    "replay_http",
    "special_token_ids",
]
