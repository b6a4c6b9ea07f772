"""Client hints about the cache (sglang #27574's shape): what a router or an agent framework knows
about the future, said about one prefix. Pure decisions: what a hint is, and whether it may run.

Actions:
- ``prefetch``: bring the prefix's lower-tier part up to host now (a prediction the client makes);
- ``pin``: prefetch, then retain the prefix for `ttl_s` seconds;
- ``retain``: refresh the prefix's recency, as a request using it would (no copy); with `ttl_s`,
  keep refreshing it for that long (a tool call started: the conversation comes back in ~`ttl_s`);
- ``demote``: the prefix will not be needed soon (the conversation ended): it goes first when room
  is needed, and its retention ends.

A hint is advice, never a lock: retention keeps a prefix among the most recently used pages, within
a capped share of each tier, for the hinted time or less (`retention_s`, the cost test); a request
that needs the room evicts it like any other page.

The prefix is given as token ids, or by session (the session's latest prompt, resolved by whoever
tracks sessions: the engine's replay, the server's adapter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HINT_ACTIONS = ("prefetch", "pin", "retain", "demote")


class HintError(ValueError):
    """A hint that cannot run: malformed, unknown session, oversized pin, a flood. Its message says
    why; `reason` is its class for the counters (``malformed``, ``unknown``, ``limit``, ``flood``)."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Hint:
    """One hint. Exactly one of `input_ids` (the prefix) or `session` names the prefix; `ttl_s` is
    how long to retain it (required for ``pin``, optional for ``retain``, refused elsewhere);
    `after_s`: seconds after its request's arrival at which a replayed hint runs (0: at arrival), or
    with `at_finish`, after its request finishes (a tool call starts when the model's answer is
    complete: a request's own ``agent_hints`` retention runs then, on the server as in a replay).
    `input_ids` is any sequence of ids, kept as given: a hint on a request's own prompt shares the
    request's `array` instead of copying it."""

    action: str
    input_ids: Sequence[int] | None = None
    session: str | None = None
    ttl_s: float | None = None
    after_s: float = 0.0
    at_finish: bool = False

    def __post_init__(self) -> None:
        if self.action not in HINT_ACTIONS:
            raise HintError(f"unknown hint action {self.action!r}; choose one of {', '.join(HINT_ACTIONS)}")
        if (self.input_ids is None) == (self.session is None):
            raise HintError("a hint names its prefix by exactly one of 'input_ids' or 'session'")
        if self.input_ids is not None and (not self.input_ids or any(t < 0 for t in self.input_ids)):
            raise HintError("a hint's 'input_ids' must be a non-empty list of non-negative token ids")
        if self.action == "pin" and self.ttl_s is None:
            raise HintError("'ttl_s' is required for a pin")
        if self.action in ("prefetch", "demote") and self.ttl_s is not None:
            raise HintError(f"'ttl_s' is only for 'pin' and 'retain', not {self.action!r}")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise HintError(f"'ttl_s' must be > 0, got {self.ttl_s}")
        if not self.after_s >= 0:
            raise HintError(f"'after_s' must be >= 0, got {self.after_s}")


@dataclass(frozen=True)
class HintLimits:
    """What hints may hold, and how many may come. Contract:
    - `check_pin(tokens, ttl_s, pinned_tokens, capacity_tokens)` raises `HintError` when a retention
      would live longer than `max_ttl_s`, or when it alone (`pinned_tokens=0`) is more than
      `max_pin_share` of the host tier (`capacity_tokens`): it could never be honoured.
    - Retained prefixes are kept within `device_share` of the device tier and `max_pin_share` of the
      host tier (the most urgent first); past that share they age like any other page.
    - At most `max_retained` retentions are held at once, and at most `max_hints_per_s` hints are
      applied per second (bursts up to `burst`): past either, a hint is refused as a ``flood``.
    - `stay_factor`: the cost test (`retention_s`) retains a prefix in a tier for at most this many
      times as long as the tier keeps an unhinted page, scaled by how often hinted prefixes came back
      over how often the tier's evicted pages are needed again.
    - `prefetch_retain_s`: a prefetched prefix is wanted soon: it is retained this long (as a
      ``retain`` with that `ttl_s`; past the retention book's size the prefetch still runs).
    """

    max_ttl_s: float = 600.0
    max_pin_share: float = 0.5
    device_share: float = 0.1
    max_retained: int = 1024
    max_hints_per_s: float = 200.0
    burst: int = 400
    stay_factor: float = 2.0
    prefetch_retain_s: float = 10.0

    def check_ttl(self, ttl_s: float) -> None:
        """The lifetime part of `check_pin` (what can be refused before the tree is seen)."""
        if ttl_s > self.max_ttl_s:
            raise HintError(f"'ttl_s' of {ttl_s:g} s exceeds the longest allowed, {self.max_ttl_s:g} s", reason="limit")

    def check_share(self, tokens: int, pinned_tokens: int, capacity_tokens: int) -> None:
        """The size part of `check_pin` (with `pinned_tokens=0`: a pin no tree state could admit,
        refused before the tree is seen)."""
        if pinned_tokens + tokens > self.max_pin_share * capacity_tokens:
            held = f"would hold {pinned_tokens + tokens} pinned tokens" if pinned_tokens else "is"
            raise HintError(
                f"pin of {tokens} tokens {held} over {self.max_pin_share:.0%} of the "
                f"{capacity_tokens}-token host tier ({int(self.max_pin_share * capacity_tokens)} tokens)",
                reason="limit",
            )

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
        raise HintError(f"unknown session {hint.session!r}", reason="unknown")
    return tokens


def retention_s(
    ttl_s: float, capacity_pages: int, evicted_pages_per_s: float, precision: float, reloaded: float, stay_factor: float
) -> float:
    """How long a hinted prefix is retained in a tier (Continuum's cost test, per token): holding a
    page for `t` seconds takes `t / stay` of another page's residency, where `stay = capacity_pages /
    evicted_pages_per_s` is how long the tier keeps an unhinted page, and that page is needed again
    with probability `reloaded` (the share of the tier's evicted tokens that requests later hit
    below it); the hinted one comes back with probability `precision` (the share of ended
    retentions whose prefix came back in time). Either miss costs about one reload of a page, so
    retention pays while `t <= stay * precision / reloaded`, times `stay_factor` (a hint's page is
    needed at a known time; an unhinted page's reuse is spread out). A tier that evicts nothing keeps
    it for the whole `ttl_s` (holding is free), and so does one whose evicted pages never come back
    (`reloaded` is floored at 5 %: one in twenty)."""
    if evicted_pages_per_s <= 0:
        return ttl_s
    stay = capacity_pages / evicted_pages_per_s
    return min(ttl_s, stay_factor * stay * precision / max(reloaded, 0.05))


class RateGate:
    """A token bucket: `take(now)` is True while at most `rate` hints per second came (bursts up to
    `burst`), else False (the hint is refused as a flood)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._level = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> bool:
        if self._at is not None:
            self._level = min(float(self.burst), self._level + max(0.0, now - self._at) * self.rate)
        self._at = now
        if self._level < 1.0:
            return False
        self._level -= 1.0
        return True
