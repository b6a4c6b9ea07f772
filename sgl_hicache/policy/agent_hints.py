"""Hints that travel with a request: the ``agent_hints`` object of its ``custom_params``.

An agent framework says what it knows in the request itself (SGLang carries
``sampling_params.custom_params``, a JSON object, from ``/generate`` and from the OpenAI API's extra
body to the scheduler's request, on every rank, at the same step):

    {"custom_params": {"agent_hints": {
        "workflow_id": "wf-7", "agent_id": "coder", "step_id": 3,
        "tool_name": "run_tests", "expected_tool_duration_ms": 45000,   # a tool call starts after this turn
        "cache_ttl_ms": 60000,                                          # or: keep it this long
        "reuse_hint": "retain"}}}                                       # retain | end | none

- ``expected_tool_duration_ms`` / ``cache_ttl_ms``: when the request ends, its conversation (prompt
  and answer) is retained for about that long (``cache_ttl_ms`` wins; the tool's duration plus
  `TTL_MARGIN`): the next turn, after the tool returns, finds it cached.
- ``reuse_hint``: ``end``: the conversation ends here: when the request ends, it goes first when room
  is needed, and its retention ends; ``none``: nothing is retained.
- ``prefetch``: a handle the server gave back (an earlier request's id, or a session key
  ``<workflow_id>/<agent_id>``): that conversation comes up from disk now, ahead of the request
  that continues it (a request with this field may be a one-token call sent when the tool returns).

Field names follow the ``agent_hints`` schema of SGLang's agent-aware radix cache work where they
overlap (workflow_id, agent_id, step_id, tool_name, expected_tool_duration_ms, cache_ttl_ms,
reuse_hint); ``parent_step_id`` / ``child_step_ids`` are accepted and not used. Every malformed
field is refused with a message naming it (`parse_agent_hints`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .hint_rules import HintError

KEY = "agent_hints"
REUSE_HINTS = ("retain", "end", "none")
TTL_MARGIN = 1.25  # a tool's expected duration is an estimate: keep it a quarter longer
MAX_ID_CHARS = 256
_FIELDS = {
    "workflow_id",
    "agent_id",
    "step_id",
    "parent_step_id",
    "child_step_ids",
    "tool_name",
    "expected_tool_duration_ms",
    "cache_ttl_ms",
    "reuse_hint",
    "prefetch",
}


@dataclass(frozen=True)
class AgentHints:
    """One request's hints (module docstring). `retain_s`: seconds to retain its conversation when
    it ends (None: not asked); `end`: demote it when it ends; `prefetch`: a handle to bring up now;
    `session`: ``<workflow_id>/<agent_id>`` when both are given (a handle for later prefetches).
    From a ``kv_hints`` envelope (`policy/kv_hints.py`): `envelope` is set, `message_id` is its id,
    `shares` counts its Share actions (accepted, nothing done); `session` is a Retain / Pin /
    Demote's ``session_id``."""

    retain_s: float | None = None
    end: bool = False
    prefetch: str | None = None
    session: str | None = None
    tool_name: str | None = None
    step_id: str | None = None
    message_id: str | None = None
    shares: int = 0
    envelope: bool = False


def _ident(obj: dict, key: str, ints: bool = False) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if ints and isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
        kind = "a string or an integer" if ints else "a string"
        raise HintError(f"agent_hints.{key} must be {kind} of 1-{MAX_ID_CHARS} characters, got {str(v)[:40]!r}")
    return v


def millis(obj: dict, key: str, positive: bool, where: str = KEY) -> float | None:
    """Seconds from the milliseconds at `obj[key]` (None when absent); raises `HintError` naming
    ``<where>.<key>`` unless a finite number >= 0 (> 0 where `positive`)."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise HintError(f"{where}.{key} must be a finite number of milliseconds {bound}, got {str(v)[:40]!r}")
    return float(v) / 1000.0


def parse_agent_hints(custom_params: Any) -> AgentHints | None:
    """The request's `AgentHints` (None when its ``custom_params`` has no ``agent_hints``); raises
    `HintError` naming the first malformed field."""
    if not isinstance(custom_params, dict) or custom_params.get(KEY) is None:
        return None
    obj = custom_params[KEY]
    if not isinstance(obj, dict):
        raise HintError(f"agent_hints must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise HintError(f"agent_hints: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_FIELDS))}")
    workflow, agent = _ident(obj, "workflow_id"), _ident(obj, "agent_id")
    step = _ident(obj, "step_id", ints=True)
    _ident(obj, "parent_step_id", ints=True)
    children = obj.get("child_step_ids")
    if children is not None and (
        not isinstance(children, list)
        or len(children) > 64
        or not all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in children)
    ):
        raise HintError("agent_hints.child_step_ids must be a list of at most 64 strings or integers")
    tool = _ident(obj, "tool_name")
    duration = millis(obj, "expected_tool_duration_ms", positive=False)
    ttl = millis(obj, "cache_ttl_ms", positive=True)
    reuse = obj.get("reuse_hint", "retain")
    if reuse not in REUSE_HINTS:
        raise HintError(f"agent_hints.reuse_hint must be one of {', '.join(REUSE_HINTS)}, got {str(reuse)[:40]!r}")
    prefetch = _ident(obj, "prefetch")
    retain = None
    if reuse == "retain":
        retain = ttl if ttl is not None else (max(1.0, duration * TTL_MARGIN) if duration is not None else None)
    elif ttl is not None or duration is not None:
        raise HintError(f"agent_hints.reuse_hint {reuse!r} contradicts cache_ttl_ms / expected_tool_duration_ms")
    session = f"{workflow}/{agent}" if workflow is not None and agent is not None else None
    return AgentHints(
        retain_s=retain, end=reuse == "end", prefetch=prefetch, session=session, tool_name=tool, step_id=step
    )
