"""The hints an agent framework sends with its model calls, derived from what a recorded session did.

A framework knows two things the cache cannot see: a call that ends in a tool call will be followed
by another call once the tool returns (and roughly when), and a session that is over will not come
back. `call_hints` turns each into the `Hint`s the embedded engine applies and
`in_request.plan_in_request_hints` puts on the wire:

- a call that stops on ``tool_use`` and is followed by another call: ``pin`` of the call's own prompt
  from the call's end (``at_finish``), for the tool's estimated duration with the margin the server
  gives ``expected_tool_duration_ms`` (`TTL_MARGIN`, at least 1 s, at most `HintLimits.max_ttl_s`,
  the longest retention the cache takes). On the wire it is the same retention as ``cache_ttl_ms``;
- a session's last call: ``demote`` of its prompt from its end (on the wire ``reuse_hint: "end"``).

The estimate is the gap the replay keeps between the call's end and the next call (after any gap
cap), times ``1 + u`` with ``u`` drawn uniformly from ``[-error, error]``: a framework that guesses
its tools' durations within that relative error. ``u`` is a pure function of (`seed`, the session,
the call's index), so the hints do not depend on which other sessions are read with it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..policy.agent_hints import TTL_MARGIN
from ..policy.hint_rules import Hint, HintLimits

MAX_TTL_S = HintLimits().max_ttl_s


def estimate_s(gap_s: float, error: float, seed: int, session: str, index: int) -> float:
    """The framework's estimate of a tool's duration: `gap_s` x (1 + u), u ~ U[-error, error] keyed
    by (`seed`, `session`, `index`); never negative. `error` 0 gives `gap_s` exactly."""
    if error == 0:
        return gap_s
    u = random.Random(f"{seed}:{session}:{index}").uniform(-error, error)
    return max(0.0, gap_s * (1.0 + u))


def call_hints(
    prompt: Sequence[int], *, stop: str, gap_s: float | None, estimate: float | None = None
) -> tuple[Hint, ...]:
    """The hints of one call: a tool-call retention when it stops on ``tool_use`` and a next call
    follows `gap_s` seconds after its end (`estimate`: the framework's guess, default `gap_s`); an
    end (``demote``) when it is its session's last call (`gap_s` None); else none.

    `prompt` is shared by the hint, not copied (a request's own ids)."""
    if gap_s is None:
        return (Hint("demote", prompt, at_finish=True),)
    if stop != "tool_use":
        return ()
    est = gap_s if estimate is None else estimate
    return (Hint("pin", prompt, ttl_s=round(min(MAX_TTL_S, max(1.0, est * TTL_MARGIN)), 6), at_finish=True),)


__all__ = ["MAX_TTL_S", "call_hints", "estimate_s"]
