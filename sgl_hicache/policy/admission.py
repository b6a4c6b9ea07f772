"""Whether a request offered to the prefill batch being formed joins it or waits one round.

A prefill step of x new tokens costs about ``fixed_s + per_token_s * x`` (`PrefillCost`, fitted
online from the server's own steps by `PrefillCostFit`). Let the batch hold n requests and T new
tokens, and the offered request t new tokens:

- joined, all n + 1 get their first token at ``fixed_s + per_token_s * (T + t)``;
- held, the n get theirs at ``fixed_s + per_token_s * T`` and the held one a step later, at
  ``2 * fixed_s + per_token_s * (T + t)`` (SGLang forms a prefill batch before any decode step).

The sum of the first-token times is lower with the hold exactly when
``n * per_token_s * t > fixed_s`` (`hold_pays`): when each new token costs compute (long prefills,
a compute-bound forward), splitting the batch lets the first requests finish early; when the step's
fixed part dominates (short prefills, a prefix-cache hit, a launch-bound forward), batching is free
and nothing is held. That is the split SGLang HiCache makes by accident (a request stays queued
while its storage lookup runs) made on purpose, and only where it pays (issue 23).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ADMISSION_HOLDS = ("cost", "always", "off")


@dataclass(frozen=True)
class PrefillCost:
    """Seconds of one prefill step: ``fixed_s + per_token_s * new_tokens``; both >= 0."""

    fixed_s: float
    per_token_s: float


def hold_pays(batch_requests: int, new_tokens: int, cost: PrefillCost | None) -> bool:
    """Holding a request of `new_tokens` uncached tokens one round, rather than adding it to a
    batch that already has `batch_requests`, lowers the batch's summed time to first token (module
    docstring). False without a cost (not measured yet) or with an empty batch."""
    if cost is None or batch_requests <= 0 or new_tokens <= 0:
        return False
    return batch_requests * cost.per_token_s * new_tokens > cost.fixed_s


class PrefillCostFit:
    """Online least-squares fit of a prefill step's seconds against its new tokens,
    ``seconds = fixed_s + per_token_s * tokens``, weighting the last `half_life_steps` steps most.

    Contract: `record(tokens, seconds)` takes one measured step; `cost()` is None until
    `min_steps` steps were recorded with tokens that vary (a slope needs a spread), else the fit
    with both parameters clamped to >= 0 (a negative slope reads as 0 per token: batching is free; a
    negative intercept as 0 fixed cost). Steps of 0 tokens or non-positive or non-finite seconds are
    ignored. Not thread-safe: the scheduler thread owns it."""

    def __init__(self, half_life_steps: float = 64.0, min_steps: int = 8) -> None:
        if half_life_steps <= 0 or min_steps < 2:
            raise ValueError(f"PrefillCostFit needs half_life_steps > 0 and min_steps >= 2, got {half_life_steps}, {min_steps}")
        self._keep = 0.5 ** (1.0 / half_life_steps)
        self.min_steps = min_steps
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not (0.0 < seconds < math.inf):
            return
        k = self._keep
        x, y = float(tokens), float(seconds)
        self._w = k * self._w + 1.0
        self._x = k * self._x + x
        self._y = k * self._y + y
        self._xx = k * self._xx + x * x
        self._xy = k * self._xy + x * y
        self.steps += 1

    def cost(self) -> PrefillCost | None:
        if self.steps < self.min_steps:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= (0.05 * mx) ** 2:  # tokens barely vary (under 5 % spread): no slope to read
            return None
        slope = max(0.0, (self._xy / self._w - mx * my) / var)
        return PrefillCost(fixed_s=max(0.0, my - slope * mx), per_token_s=slope)


__all__ = ["ADMISSION_HOLDS", "PrefillCost", "PrefillCostFit", "hold_pays"]
