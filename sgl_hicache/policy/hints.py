"""Client hints about the cache (sglang #27574's shape): what a router or an agent framework knows
about the future, said about one prefix. Pure decisions: what a hint is, and whether it may run.

Actions:
- ``prefetch``: bring the prefix's lower-tier part up to host now (a prediction the client makes);
- ``pin``: prefetch, then keep the prefix from eviction for `ttl_s` seconds (the pin expires);
- ``retain``: refresh the prefix's recency, as a request using it would (no copy);
- ``demote``: the prefix will not be needed soon: it goes first when room is needed.

The prefix is given as token ids, or by session (the session's latest prompt, resolved by whoever
tracks sessions: the engine's replay, the server's adapter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HINT_ACTIONS = ("prefetch", "pin", "retain", "demote")


class HintError(ValueError):
    """A hint that cannot run: malformed, unknown session, oversized pin. Its message says why."""


@dataclass(frozen=True)
class Hint:
    """One hint. Exactly one of `input_ids` (the prefix) or `session` names the prefix; `ttl_s` is
    the pin's lifetime (``pin`` only, required there); `after_s`: seconds after its request's
    arrival at which a replayed hint runs (0: at arrival)."""

    action: str
    input_ids: tuple[int, ...] | None = None
    session: str | None = None
    ttl_s: float | None = None
    after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in HINT_ACTIONS:
            raise HintError(f"unknown hint action {self.action!r}; choose one of {', '.join(HINT_ACTIONS)}")
        if (self.input_ids is None) == (self.session is None):
            raise HintError("a hint names its prefix by exactly one of 'input_ids' or 'session'")
        if self.input_ids is not None and (not self.input_ids or any(t < 0 for t in self.input_ids)):
            raise HintError("a hint's 'input_ids' must be a non-empty list of non-negative token ids")
        if (self.action == "pin") != (self.ttl_s is not None):
            raise HintError("'ttl_s' is required for a pin and only for a pin")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise HintError(f"'ttl_s' must be > 0, got {self.ttl_s}")
        if not self.after_s >= 0:
            raise HintError(f"'after_s' must be >= 0, got {self.after_s}")


@dataclass(frozen=True)
class HintLimits:
    """What a hint may hold. Contract: `check_pin(tokens, ttl_s, pinned_tokens, capacity_tokens)`
    raises `HintError` when the pin would live longer than `max_ttl_s` or would bring the tokens
    pinned by hints above `max_pin_share` of the host tier (`capacity_tokens`); nothing stays
    pinned forever, and pins never crowd out the requests the tier is for."""

    max_ttl_s: float = 600.0
    max_pin_share: float = 0.25

    def check_ttl(self, ttl_s: float) -> None:
        """The lifetime part of `check_pin` (what can be refused before the tree is seen)."""
        if ttl_s > self.max_ttl_s:
            raise HintError(f"pin for {ttl_s:g} s exceeds the longest allowed, {self.max_ttl_s:g} s")

    def check_share(self, tokens: int, pinned_tokens: int, capacity_tokens: int) -> None:
        """The size part of `check_pin` (with `pinned_tokens=0`: a pin no tree state could admit,
        refused before the tree is seen)."""
        if pinned_tokens + tokens > self.max_pin_share * capacity_tokens:
            held = f"would hold {pinned_tokens + tokens} pinned tokens" if pinned_tokens else "is"
            raise HintError(f"pin of {tokens} tokens {held} over {self.max_pin_share:.0%} of the "
                            f"{capacity_tokens}-token host tier ({int(self.max_pin_share * capacity_tokens)} tokens)")

    def check_pin(self, tokens: int, ttl_s: float, pinned_tokens: int, capacity_tokens: int) -> None:
        self.check_ttl(ttl_s)
        self.check_share(tokens, pinned_tokens, capacity_tokens)


def check_prefix(tokens: int, page_size: int) -> None:
    """A hint acts on whole pages: raises `HintError` when its prefix of `tokens` holds none."""
    if tokens < page_size:
        raise HintError(f"a hint's prefix must hold at least one whole page ({page_size} tokens), got {tokens}")


def hint_tokens(hint: Hint, sessions: dict[str, Sequence[int]]) -> Sequence[int]:
    """The prefix `hint` names: its token ids, or its session's latest prompt (`sessions`)."""
    if hint.input_ids is not None:
        return hint.input_ids
    tokens = sessions.get(hint.session)  # type: ignore[arg-type]
    if tokens is None:
        raise HintError(f"unknown session {hint.session!r}")
    return tokens
