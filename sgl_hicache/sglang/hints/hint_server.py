"""The server's hint API (sglang #27574's shape): a small HTTP listener in the scheduler
process that takes client hints and hands them to the scheduler thread, which applies them through
the controller's `HintDesk` once per step (`StepCalls.before_batch_formed`). The listener's thread
only parses and queues: it never touches the tree.

    POST /hints  {"hints": [{"action": "prefetch", "input_ids": [1, 2, ...]},
                            {"action": "pin", "input_ids": [...], "ttl_s": 60},
                            {"action": "retain", "input_ids": [...]}, {"action": "demote", "input_ids": [...]}]}
      -> 202 {"queued": N}; 400 {"error": "hint 1: ..."} when any hint is malformed (none is queued)
    GET  /hints  -> {"queued": N, "applied": {action: count}, "acted_tokens": T, "rejected": R,
                     "last_error": "..." | null}

SGLang's own `/set_internal_state` accepts numbers only, so the hints come through their own port
(`SGLHICACHE_HINT_PORT`, `sgl-hicache serve --hint-port`), bound to 127.0.0.1 unless
`SGLHICACHE_HINT_HOST` says otherwise. A hint here names its prefix by `input_ids` (a router holds
token ids). Refused at TP >= 2 (each rank would need the same hints at the same step): hints that
travel with the request (`request_hints.py`, `custom_params["agent_hints"]`) work at any TP and
name a conversation by a handle instead.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ...policy.hint_rules import HINT_ACTIONS, Hint, HintError, HintLimits, check_prefix

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # a hint batch larger than this is refused (413), not read


def parse_hint_batch(body: Any) -> list[Hint]:
    """The hints of one POST body; raises `HintError` naming the first bad hint and field."""
    if not isinstance(body, dict) or not isinstance(body.get("hints"), list):
        raise HintError('the body must be a JSON object {"hints": [...]}')
    hints: list[Hint] = []
    for i, h in enumerate(body["hints"]):
        where = f"hint {i}"
        if not isinstance(h, dict):
            raise HintError(f"{where}: must be an object, got {type(h).__name__}")
        unknown = set(h) - {"action", "input_ids", "ttl_s", "session"}
        if unknown:
            raise HintError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        if "session" in h:
            raise HintError(
                f"{where}: the hint API names prefixes by 'input_ids'; name a conversation by its "
                "handle with agent_hints.prefetch in the request's custom_params"
            )
        ids = h.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise HintError(f"{where}: 'input_ids' must be a list of integer token ids")
        ttl = h.get("ttl_s")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
            raise HintError(f"{where}: 'ttl_s' must be a number")
        if h.get("action") not in HINT_ACTIONS:
            raise HintError(f"{where}: 'action' must be one of {', '.join(HINT_ACTIONS)}, got {h.get('action')!r}")
        try:
            hints.append(Hint(h["action"], input_ids=tuple(ids), ttl_s=None if ttl is None else float(ttl)))
        except HintError as e:
            raise HintError(f"{where}: {e}") from None
    return hints


class HintListener:
    """HTTP listener for hints (see the module docstring).

    Contract: `drain()` (the scheduler thread) returns the hints queued since the last call, in
    arrival order, and never blocks; a malformed POST queues nothing and answers 400 with the reason
    (the hint's index and field: `_check`); `page_size` and `host_tokens` (the host tier's capacity,
    None: no host tier) let it refuse a prefix shorter than a page and a pin too large on its own;
    `status` is a callable returning the appliers' counters for GET. `close()` stops the thread and
    frees the port; safe to call twice.
    """

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        status: Callable[[], dict] | None = None,
        vocab_size: int | None = None,
        limits: HintLimits | None = None,
        page_size: int = 1,
        host_tokens: int | None = None,
    ) -> None:
        self._queue: queue.SimpleQueue[Hint] = queue.SimpleQueue()
        self._limits = limits or HintLimits()
        self._status = status or dict
        self._vocab = vocab_size
        self._page_size = page_size
        self._host_tokens = host_tokens
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # no access log on stderr
                logger.debug("hint api: " + fmt, *args)

            def _reply(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/") != "/hints":
                    return self._reply(404, {"error": f"no such path {self.path}; use /hints"})
                self._reply(200, {"queued": listener._queue.qsize(), **listener._status()})

            def do_POST(self) -> None:  # noqa: N802
                if self.path.rstrip("/") != "/hints":
                    return self._reply(404, {"error": f"no such path {self.path}; use POST /hints"})
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    return self._reply(413, {"error": f"body of {length} bytes exceeds {MAX_BODY_BYTES}"})
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                    hints = parse_hint_batch(body)
                    listener._check(hints)
                except (HintError, ValueError) as e:
                    return self._reply(400, {"error": str(e)})
                for h in hints:
                    listener._queue.put(h)
                self._reply(202, {"queued": len(hints)})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="sgl-hicache-hints", daemon=True)
        self._thread.start()

    def _check(self, hints: list[Hint]) -> None:
        """What can be refused before the scheduler sees a hint: token ids outside the vocabulary, a
        prefix shorter than a page, a pin longer than `HintLimits.max_ttl_s` or larger than its share
        of the host tier on its own (the share taken with the other pins needs the tree: checked when
        applied)."""
        for i, h in enumerate(hints):
            ids = h.input_ids or ()
            try:
                if self._vocab is not None:
                    bad = next((t for t in ids if t >= self._vocab), None)
                    if bad is not None:
                        raise HintError(f"'input_ids' holds token id {bad}, outside the vocabulary ({self._vocab} ids)")
                try:
                    check_prefix(len(ids), self._page_size)
                except HintError as e:
                    raise HintError(f"'input_ids': {e}") from None
                if h.ttl_s is not None:
                    self._limits.check_ttl(h.ttl_s)
                    if self._host_tokens is not None:
                        self._limits.check_share(len(ids) // self._page_size * self._page_size, 0, self._host_tokens)
            except HintError as e:
                raise HintError(f"hint {i}: {e}") from None

    def drain(self) -> list[Hint]:
        out: list[Hint] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def refuse_hints_at_tp(hint_port: int | None, multi_rank: bool, prefix: str = "") -> None:
    """The hint API runs at TP=1 only: raises ValueError naming what to change otherwise."""
    if hint_port is not None and multi_rank:
        raise ValueError(
            prefix + "the hint API (hint_port) is not supported with --tp > 1 or DP > 1: every rank would "
            "need the same hints at the same step, and each DP rank a listener of its own; run without "
            "SGLHICACHE_HINT_PORT / --hint-port"
        )


__all__ = ["HintListener", "parse_hint_batch", "refuse_hints_at_tp"]
