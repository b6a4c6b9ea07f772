"""The versioned ``kv_hints`` envelope of a request's ``custom_params``, beside ``agent_hints``.

The envelope SGLang's KV hint RFC (sgl-project/sglang#36224) and vLLM's (vllm-project/vllm#53421,
PR #53423) converge on, carried in ``sampling_params.custom_params["kv_hints"]`` (``/generate``) or
``custom_params`` of the OpenAI API's body:

    {"custom_params": {"kv_hints": {
        "protocol_version": "0.1", "message_id": "m-17",
        "actions": [
            {"action_id": "keep", "action_type": "Retain", "action_version": "0.1",
             "payload": {"ttl_ms": 60000, "session_id": "wf-7/coder"}},
            {"action_id": "warm", "action_type": "Prefetch", "payload": {"handle": "wf-7/tester"}}]}}}

Each action maps onto the `AgentHints` the ``agent_hints`` object gives, so both run through one
implementation (`sglang/hints/request_hints.py`, the hint desk):

- ``Retain`` ``{ttl_ms, session_id?}``: when the request ends, its conversation is retained for
  ``ttl_ms`` (``agent_hints.cache_ttl_ms``);
- ``Pin`` ``{ttl_ms, session_id?}``: the same retention: advice, never a lock (the desk locks no page);
- ``Demote`` ``{session_id?}``: the conversation ends here (``agent_hints.reuse_hint = "end"``);
- ``Prefetch`` ``{handle}``: the conversation under that handle (an earlier request's id or a
  ``session_id``/session key recorded in the sender's namespace) comes up from disk now
  (``agent_hints.prefetch``);
- ``Share``: accepted and counted, nothing done (the cache is shared within a namespace already);
  its payload must be an object of at most `MAX_SHARE_KEYS` keys and is not read.

``session_id`` records the conversation under that handle too (as ``<workflow_id>/<agent_id>`` does).
At most one of Retain / Pin / Demote and one Prefetch per envelope; at most `MAX_ACTIONS` actions,
ids and strings at most `MAX_ID_CHARS` characters, ``action_id`` unique. ``protocol_version`` is
required and must be one of `PROTOCOL_VERSIONS`; ``action_version``, where given, one of
`ACTION_VERSIONS` (absent: the current one). A request carrying both ``agent_hints`` and
``kv_hints`` is refused. Every malformed field is refused with a `HintError` naming it
(``kv_hints.actions[1].payload.ttl_ms must be ...``).
"""

from __future__ import annotations

from typing import Any

from .agent_hints import KEY as AGENT_KEY
from .agent_hints import MAX_ID_CHARS, AgentHints, millis, parse_agent_hints
from .hint_rules import HintError

KEY = "kv_hints"
PROTOCOL_VERSIONS = ("0.1",)
ACTION_VERSIONS = ("0.1",)
MAX_ACTIONS = 8
MAX_SHARE_KEYS = 16
ACTION_TYPES = ("Share", "Prefetch", "Demote", "Pin", "Retain")
_ENVELOPE = {"protocol_version", "message_id", "actions"}
_ACTION = {"action_id", "action_type", "action_version", "payload"}
_PAYLOAD = {
    "Retain": ({"ttl_ms"}, {"session_id"}),  # (required, optional)
    "Pin": ({"ttl_ms"}, {"session_id"}),
    "Demote": (set(), {"session_id"}),
    "Prefetch": ({"handle"}, set()),
}


def _text(v: Any, where: str, required: bool = True) -> str | None:
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
        raise HintError(f"{where} must be a string of 1-{MAX_ID_CHARS} characters, got {str(v)[:40]!r}")
    return v


def _fields(obj: Any, where: str, allowed: set[str]) -> dict:
    if not isinstance(obj, dict):
        raise HintError(f"{where} must be an object, got {type(obj).__name__}")
    unknown = sorted(str(k)[:40] for k in set(obj) - allowed)
    if unknown:
        raise HintError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return obj


def _version(v: Any, where: str, supported: tuple[str, ...]) -> None:
    if v is None:
        raise HintError(f"{where} is required; supported: {', '.join(supported)}")
    if not isinstance(v, str) or v not in supported:
        raise HintError(f"{where} {repr(v)[:40]} is not supported; supported (strings): {', '.join(supported)}")


def parse_kv_hints(obj: Any) -> AgentHints:
    """The `AgentHints` a ``kv_hints`` envelope `obj` asks for (module docstring); raises `HintError`
    naming the first malformed field."""
    env = _fields(obj, KEY, _ENVELOPE)
    _version(env.get("protocol_version"), f"{KEY}.protocol_version", PROTOCOL_VERSIONS)
    message_id = _text(env.get("message_id"), f"{KEY}.message_id", required=False)
    actions = env.get("actions")
    if not isinstance(actions, list) or not 1 <= len(actions) <= MAX_ACTIONS:
        raise HintError(f"{KEY}.actions must be a list of 1-{MAX_ACTIONS} actions")
    ids: set[str] = set()
    lifetime: tuple[str, str] | None = None  # (where, type) of the Retain / Pin / Demote
    retain_s: float | None = None
    session = prefetch = None
    prefetch_at = None
    shares = 0
    for i, raw in enumerate(actions):
        at = f"{KEY}.actions[{i}]"
        action = _fields(raw, at, _ACTION)
        action_id = _text(action.get("action_id"), f"{at}.action_id")
        if action_id in ids:
            raise HintError(f"{at}.action_id {action_id[:40]!r} repeats an earlier action's")
        ids.add(str(action_id))
        kind = action.get("action_type")
        if kind not in ACTION_TYPES:
            raise HintError(f"{at}.action_type must be one of {', '.join(ACTION_TYPES)}, got {str(kind)[:40]!r}")
        if action.get("action_version") is not None:
            _version(action["action_version"], f"{at}.action_version", ACTION_VERSIONS)
        if kind == "Share":
            payload = action.get("payload", {})
            if not isinstance(payload, dict) or len(payload) > MAX_SHARE_KEYS:
                raise HintError(f"{at}.payload must be an object of at most {MAX_SHARE_KEYS} fields")
            shares += 1
            continue
        required, optional = _PAYLOAD[kind]
        payload = _fields(action.get("payload", {}), f"{at}.payload", required | optional)
        missing = sorted(required - set(payload))
        if missing:
            raise HintError(f"{at}.payload.{missing[0]} is required for {kind}")
        if kind == "Prefetch":
            if prefetch_at is not None:
                raise HintError(f"{at}: one Prefetch per request ({prefetch_at} is one)")
            prefetch_at, prefetch = at, _text(payload["handle"], f"{at}.payload.handle")
            continue
        if lifetime is not None:
            raise HintError(f"{at}: one of Retain, Pin, Demote per request ({lifetime[0]} is a {lifetime[1]})")
        lifetime = (at, kind)
        session = _text(payload.get("session_id"), f"{at}.payload.session_id", required=False)
        if kind != "Demote":
            retain_s = millis(payload, "ttl_ms", positive=True, where=f"{at}.payload")
    return AgentHints(
        retain_s=retain_s,
        end=lifetime is not None and lifetime[1] == "Demote",
        prefetch=prefetch,
        session=session,
        message_id=message_id,
        shares=shares,
        envelope=True,
    )


def parse_hints(custom_params: Any) -> AgentHints | None:
    """The hints a request's ``custom_params`` carries: its ``agent_hints`` object
    (`parse_agent_hints`) or its ``kv_hints`` envelope (`parse_kv_hints`); None when neither. Both
    at once are refused (`HintError`), as is any malformed field."""
    if not isinstance(custom_params, dict) or custom_params.get(KEY) is None:
        return parse_agent_hints(custom_params)
    if custom_params.get(AGENT_KEY) is not None:
        raise HintError(f"custom_params: send {AGENT_KEY} or {KEY}, not both")
    return parse_kv_hints(custom_params[KEY])
