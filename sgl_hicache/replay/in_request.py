"""A trace's hints as an agent framework sends them: in the requests themselves
(``sampling_params.custom_params["agent_hints"]``, `policy/agent_hints.py`), not to the hint API.

The same trace drives the embedded engine (which applies its `Hint`s at arrival + ``after_s``) and
the real server; `plan_in_request_hints` translates each hint of a session's turns into what the
framework would put on the wire:

- every turn of a session that carries hints names its session: ``workflow_id`` = the trace's
  session, ``agent_id`` (one agent per session, ``"main"`` by default) and ``step_id`` (the turn's
  index in its session). The server records the turn's conversation under the session key
  ``"<workflow_id>/<agent_id>"`` when it ends;
- ``pin`` (or ``retain`` with a ``ttl_s``) of the turn's own prompt (or a prefix of it, or its session):
  a tool call starts after this turn. With ``at_finish`` the hint is the retention itself, from the
  turn's end: ``cache_ttl_ms`` = ``ttl_s`` x `time_scale` in ms. Without, ``ttl_s`` is the tool's
  estimate: ``expected_tool_duration_ms`` = ``ttl_s`` x `time_scale` in ms (the server retains the
  conversation from the turn's end, a quarter longer than the estimate);
- ``prefetch`` of the turn's prompt (or a prefix, or its session): a standalone request with a short
  prompt (`prefetch_prompt`, shorter than a page: nothing of it is cached), ``max_new_tokens`` 1 and
  ``agent_hints.prefetch`` = the session key, sent at the turn's arrival + ``after_s`` (trace time;
  the replayer scales it like every arrival: `prefetches`), or with ``at_finish`` ``after_s`` after
  the turn's reply ends (`after_finish`: the replayer sends it then);
- ``demote`` of the turn's own prompt, and with `end_last_turn` the last turn of a hinted session
  that starts no tool call: ``reuse_hint: "end"``.

A hint that cannot travel this way (one naming another conversation's prefix, a ``retain`` without a
time, a turn without a session, two retentions on one turn) is a ValueError naming the request and
the hint: such a trace needs the hint API (`replay/hint_client.py`). Nothing here imports sglang.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policy.hint_rules import Hint
from .trace import Request

PREFETCH_PROMPT = (100, 101, 102, 103)  # shorter than any page: the prefetch call caches nothing of its own
PREFETCH_ROLE = "prefetch"


@dataclass(frozen=True)
class InRequestHints:
    """The translation of a trace's hints (module docstring).

    - `agent_hints`: request id -> the ``agent_hints`` object that request carries;
    - `prefetches`: the standalone prefetch requests sent at a trace time, ids
      ``"<session>/prefetch<k>"``, each with its own ``agent_hints`` in `agent_hints`;
    - `after_finish`: turn id -> (trace seconds after that turn's reply ends, prefetch request) pairs;
    - `sampling(request_id)`: the extra ``sampling_params`` of that request (None when it carries none).
    """

    agent_hints: dict[str, dict[str, Any]] = field(default_factory=dict)
    prefetches: list[Request] = field(default_factory=list)
    after_finish: dict[str, list[tuple[float, Request]]] = field(default_factory=dict)

    def sampling(self, request_id: str) -> dict[str, Any] | None:
        obj = self.agent_hints.get(request_id)
        return None if obj is None else {"custom_params": {"agent_hints": obj}}

    @property
    def prefetch_ids(self) -> frozenset[str]:
        later = (r.request_id for pairs in self.after_finish.values() for _, r in pairs)
        return frozenset((*(r.request_id for r in self.prefetches), *later))


def _own(req: Request, hint: Hint, i: int) -> None:
    """The hint must name `req`'s own conversation: its session, its prompt or a prefix of it."""
    if hint.session is not None:
        if hint.session != req.session:
            raise ValueError(
                f"request {req.request_id}: hints[{i}] ({hint.action}) names session {hint.session!r}, not its own "
                f"({req.session!r}); only a turn's own conversation travels in its request (use the hint API)"
            )
        return
    ids = hint.input_ids or ()
    if len(ids) > len(req.input_ids) or tuple(req.input_ids[: len(ids)]) != tuple(ids):
        raise ValueError(
            f"request {req.request_id}: hints[{i}] ({hint.action}) names a prefix that is not its own prompt's; "
            "only a turn's own conversation travels in its request (use the hint API)"
        )


def plan_in_request_hints(
    requests: Sequence[Request],
    *,
    time_scale: float = 1.0,
    agent_id: str = "main",
    end_last_turn: bool = True,
    prefetch_prompt: Sequence[int] = PREFETCH_PROMPT,
) -> InRequestHints:
    """Translate `requests`' hints (module docstring). `time_scale` is the replay's (trace seconds x
    `time_scale` = wall seconds): it scales the tool durations the requests announce."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if not agent_id or len(agent_id) > 64:
        raise ValueError(f"agent_id must be a string of 1-64 characters, got {agent_id!r}")
    if not prefetch_prompt or any(int(t) < 0 for t in prefetch_prompt):
        raise ValueError("prefetch_prompt must be a non-empty list of non-negative token ids")
    sessions: dict[str, list[Request]] = {}
    for req in sorted(requests, key=lambda r: r.arrival_s):  # stable: equal arrivals keep their order
        if req.hints and req.session is None:
            raise ValueError(
                f"request {req.request_id} carries hints but no session: a hint in a request names its session"
            )
        if req.session is not None:
            sessions.setdefault(req.session, []).append(req)
    out = InRequestHints()
    for session, turns in sessions.items():
        if not any(t.hints for t in turns):
            continue
        key = f"{session}/{agent_id}"
        for step, req in enumerate(turns):
            obj: dict[str, Any] = {"workflow_id": session, "agent_id": agent_id, "step_id": step}
            for i, hint in enumerate(req.hints):
                _own(req, hint, i)
                if hint.action in ("pin", "retain"):
                    if hint.ttl_s is None:
                        raise ValueError(
                            f"request {req.request_id}: hints[{i}] (retain) has no ttl_s: a request announces a tool's "
                            "duration, it cannot only refresh recency (use the hint API)"
                        )
                    if "expected_tool_duration_ms" in obj or "cache_ttl_ms" in obj:
                        raise ValueError(f"request {req.request_id}: hints[{i}]: a second retention on one turn")
                    field_name = "cache_ttl_ms" if hint.at_finish else "expected_tool_duration_ms"
                    obj[field_name] = round(hint.ttl_s * time_scale * 1000.0, 3)
                elif hint.action == "demote":
                    obj["reuse_hint"] = "end"
                else:  # prefetch: its own call when the trace says
                    n = len(out.prefetches) + sum(map(len, out.after_finish.values()))
                    pid = f"{session}/{PREFETCH_ROLE}{n}"
                    call = Request(
                        pid,
                        session,
                        round(req.arrival_s + hint.after_s, 6),
                        array("q", (int(t) for t in prefetch_prompt)),
                        1,
                        req.line,
                    )
                    if hint.at_finish:
                        out.after_finish.setdefault(req.request_id, []).append((hint.after_s, call))
                    else:
                        out.prefetches.append(call)
                    out.agent_hints[pid] = {"prefetch": key}
            retains = "expected_tool_duration_ms" in obj or "cache_ttl_ms" in obj
            if "reuse_hint" in obj and retains:
                raise ValueError(f"request {req.request_id}: a turn that both ends its session and retains it")
            if end_last_turn and step == len(turns) - 1 and not retains:
                obj["reuse_hint"] = "end"
            out.agent_hints[req.request_id] = obj
    out.prefetches.sort(key=lambda r: r.arrival_s)
    return out


__all__ = ["PREFETCH_PROMPT", "PREFETCH_ROLE", "InRequestHints", "plan_in_request_hints"]
