"""The client side of the server's hint API for the HTTP replayer: a trace line's `hints` go to the
server's `POST /hints` at the time the trace says, as the embedded engine applies them.

- `resolve_hints(requests)`: each hint's prefix as token ids, resolved as the embedded engine does (a
  ``session`` names that session's latest prompt before the hint's request, in arrival order); a
  session no earlier request named cannot be sent (the server tracks no sessions) and is counted.
- `hint_api_url(server_url, stats)`: where the server's hint API listens, from its stats (`hints.port`).
- `HintSender`: one thread that posts each hint at its due time (its request's send time plus
  `after_s`). A refusal (HTTP 4xx: a bad prefix, an oversized pin) is counted with its reason, never
  swallowed; a hint API that stops answering ends the sending and is reported as `endpoint_error`.

Nothing here imports sglang.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policy.hint_rules import Hint, HintError, hint_tokens
from .trace import Request


class HintApiError(RuntimeError):
    """The hint API cannot be found or reached."""


@dataclass(frozen=True)
class ResolvedHint:
    """One hint of one request, its prefix resolved to token ids."""

    request_id: str
    hint: Hint
    tokens: tuple[int, ...]

    def body(self) -> dict[str, Any]:
        """The hint as `POST /hints` takes it (`sglang/hint_server.py`)."""
        out: dict[str, Any] = {"action": self.hint.action, "input_ids": list(self.tokens)}
        if self.hint.ttl_s is not None:
            out["ttl_s"] = self.hint.ttl_s
        return out


def resolve_hints(requests: Sequence[Request]) -> tuple[dict[int, list[ResolvedHint]], list[str]]:
    """({id(request): its resolved hints}, one message per hint that names an unknown session)."""
    sessions: dict[str, Sequence[int]] = {}
    out: dict[int, list[ResolvedHint]] = {}
    unresolved: list[str] = []
    for req in sorted(requests, key=lambda r: r.arrival_s):  # stable: equal arrivals keep their order
        for i, hint in enumerate(req.hints):
            try:
                tokens = hint_tokens(hint, sessions)
            except HintError as e:
                unresolved.append(f"request {req.request_id}: hints[{i}] ({hint.action}): {e}")
                continue
            out.setdefault(id(req), []).append(ResolvedHint(req.request_id, hint, tuple(int(t) for t in tokens)))
        if req.session is not None:
            sessions[req.session] = req.input_ids
    return out, unresolved


def _base(url: str) -> str:
    url = url if "://" in url else "http://" + url
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.port is None:
        raise ValueError(f"--hint-url must be http://HOST:PORT[/hints], got {url!r}")
    return f"{u.scheme}://{u.netloc}"


def hint_api_url(server_url: str, stats: dict[str, Any] | None) -> str | None:
    """The hint API of the server at `server_url`, from its stats (`hints.port`; its host unless the
    API is bound to one other specific address). None when the stats name no hint API."""
    hints = (stats or {}).get("hints")
    if not isinstance(hints, dict) or not isinstance(hints.get("port"), int):
        return None
    u = urllib.parse.urlsplit(server_url if "://" in server_url else "http://" + server_url)
    bound = str(hints.get("host") or "")
    host = u.hostname if bound in ("", "0.0.0.0", "::", "127.0.0.1", "localhost", "::1") else bound
    return f"http://{host}:{hints['port']}"


def hint_api_status(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """`GET /hints` of the hint API at `url` (its counters); HintApiError when it does not answer."""
    target = _base(url) + "/hints"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise HintApiError(f"GET {target}: HTTP {e.code} {e.reason}; is this a sgl_hicache hint API?") from None
    except (urllib.error.URLError, OSError) as e:
        raise HintApiError(f"the hint API at {target} does not answer: {getattr(e, 'reason', e)}") from None
    except ValueError:
        raise HintApiError(f"GET {target} did not return JSON; is this a sgl_hicache hint API?") from None
    if not isinstance(out, dict):
        raise HintApiError(f"GET {target} did not return an object; is this a sgl_hicache hint API?")
    return out


def post_hints(url: str, hints: Sequence[dict[str, Any]], timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    """`POST /hints` with `hints`: (HTTP status, JSON answer). A status >= 400 is returned, not
    raised; HintApiError when the API does not answer at all."""
    target = _base(url) + "/hints"
    req = urllib.request.Request(
        target,
        data=json.dumps({"hints": list(hints)}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise HintApiError(f"the hint API at {target} stopped answering: {getattr(e, 'reason', e)}") from None
    try:
        answer = json.loads(raw or b"{}")
    except ValueError:
        answer = {"error": raw[:300].decode("utf-8", "replace")}
    return status, answer if isinstance(answer, dict) else {"answer": answer}


@dataclass
class HintCounts:
    """What a `HintSender` did: hints posted and accepted (202), refused (any other status; the
    first reason kept), not sent (the API stopped answering)."""

    sent: int = 0
    accepted: int = 0
    refused: int = 0
    unsent: int = 0
    first_error: str | None = None
    endpoint_error: str | None = None
    refusals: list[str] = field(default_factory=list)  # the first few reasons


class HintSender:
    """Posts resolved hints to the hint API at `url` at their due times (`time.perf_counter`), from
    one daemon thread, in due order.

    Contract: `schedule(due, hint)` never blocks; each hint is posted at most once, not before its
    due time. A refusal is counted (`counts.refused`, reason in `first_error`); a connection failure
    sets `counts.endpoint_error` and stops the sending (the rest count as unsent). `close()` returns
    once every scheduled hint is posted, each at its time (a trace's hints are part of the replay,
    also those due after its last request ended), and stops the thread; safe to call twice.
    """

    MAX_REASONS = 5

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = _base(url)
        self.timeout = timeout
        self.counts = HintCounts()
        self._heap: list[tuple[float, int, ResolvedHint]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="sgl-hicache-hint-sender", daemon=True)
        self._thread.start()

    def schedule(self, due: float, hint: ResolvedHint) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), hint))
            self._cond.notify()

    def _next(self) -> ResolvedHint | None:
        with self._cond:
            while True:
                if self.counts.endpoint_error is not None:
                    return None
                now = time.perf_counter()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                if self._closing and not self._heap:
                    return None
                self._cond.wait(timeout=None if not self._heap else max(0.0, self._heap[0][0] - now))

    def _run(self) -> None:
        while (h := self._next()) is not None:
            try:
                status, answer = post_hints(self.url, [h.body()], self.timeout)
            except HintApiError as e:
                with self._cond:
                    self.counts.endpoint_error = str(e)
                    self.counts.unsent += 1
                return
            c = self.counts
            c.sent += 1
            if status == 202:
                c.accepted += 1
                continue
            c.refused += 1
            reason = f"request {h.request_id}: {h.hint.action} of {len(h.tokens)} tokens: HTTP {status}: {answer.get('error', answer)}"
            c.first_error = c.first_error or reason
            if len(c.refusals) < self.MAX_REASONS:
                c.refusals.append(reason)

    def close(self) -> HintCounts:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        with self._cond:
            self.counts.unsent += len(self._heap)
            self._heap.clear()
        return self.counts


__all__ = [
    "HintApiError",
    "HintCounts",
    "HintSender",
    "ResolvedHint",
    "hint_api_status",
    "hint_api_url",
    "post_hints",
    "resolve_hints",
]
