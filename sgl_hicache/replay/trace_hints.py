"""The ``hints`` field of a trace line (plain JSONL): a list of hint objects, parsed into
`policy.hints.Hint`s; a malformed hint is a `TraceError` naming the line, the hint and the field.

    {"input_ids": [...], "output_length": 16, "timestamp": 3.0,
     "hints": [{"action": "prefetch", "session": "s1"},
               {"action": "pin", "input_ids": [1, 2, 3, 4], "ttl_s": 30, "after_s": 0.5},
               {"action": "pin", "session": "s1", "ttl_s": 45, "at_finish": true}]}

`after_s` counts from the request's arrival, or with ``"at_finish": true`` from its end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..policy.hint_rules import Hint, HintError
from .trace import TraceError, _short

HINT_FIELDS = {"action", "input_ids", "session", "ttl_s", "after_s", "at_finish"}


def _number(path: str | Path, line: int, where: str, obj: dict, key: str) -> float | None:
    if key not in obj:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise TraceError(path, line, f"{where} field {key!r} must be a finite number >= 0, got {_short(v)}")
    return float(v)


def parse_hints(path: str | Path, line: int, value: Any) -> tuple[Hint, ...]:
    """The hints of one trace line (`value`: the line's ``hints`` field)."""
    if not isinstance(value, list):
        raise TraceError(path, line, f"field 'hints' must be an array of hint objects, got {_short(value)}")
    out: list[Hint] = []
    for i, obj in enumerate(value):
        where = f"hints[{i}]:"
        if not isinstance(obj, dict):
            raise TraceError(path, line, f"{where} must be an object, got {_short(obj)}")
        unknown = sorted(set(obj) - HINT_FIELDS)
        if unknown:
            raise TraceError(
                path,
                line,
                f"{where} unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(HINT_FIELDS))}",
            )
        action = obj.get("action")
        if not isinstance(action, str):
            raise TraceError(path, line, f"{where} field 'action' must be a string, got {_short(action)}")
        ids = obj.get("input_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TraceError(
                    path, line, f"{where} field 'input_ids' must be an array of integers, got {_short(ids)}"
                )
            ids = tuple(ids)
        session = obj.get("session")
        if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
            raise TraceError(
                path, line, f"{where} field 'session' must be a string or an integer, got {_short(session)}"
            )
        at_finish = obj.get("at_finish", False)
        if not isinstance(at_finish, bool):
            raise TraceError(path, line, f"{where} field 'at_finish' must be true or false, got {_short(at_finish)}")
        try:
            out.append(
                Hint(
                    action,
                    ids,
                    None if session is None else str(session),
                    _number(path, line, where, obj, "ttl_s"),
                    _number(path, line, where, obj, "after_s") or 0.0,
                    at_finish,
                )
            )
        except HintError as exc:
            raise TraceError(path, line, f"{where} {exc}") from None
    return tuple(out)
