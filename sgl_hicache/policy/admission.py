"""Whether a request offered to the prefill batch being formed joins it or waits one round.

A prefill step costs about ``fixed_s + per_token_s * tokens + per_pair_s * pairs`` (`PrefillCost`,
fitted online from the server's own steps by `PrefillCostFit`), where `tokens` are the new tokens
the step computes and `pairs` the attention pairs they form: a request computing t tokens after a
context of c cached tokens forms ``t * (c + t / 2)`` (each new token attends to the context and to
the new tokens before it). The last term is what makes a long prompt, or a short one after a long
cached prefix, cost more than its token count says (measured on CPU: with it the fit's
residual fell from 1.03 s to 0.40 s a step). A request's marginal cost in a step is
``per_token_s * t + per_pair_s * t * (c + t / 2)`` (`PrefillCost.marginal_s`): requests in one
batch add their costs, the fixed part is paid once.

Let the batch hold n requests, and the offered request cost m at the margin:

- joined, all n + 1 get their first token at ``fixed_s + cost(batch) + m``;
- held, the n get theirs at ``fixed_s + cost(batch)`` and the held one a step later, at
  ``2 * fixed_s + cost(batch) + m`` (SGLang forms a prefill batch before any decode step).

The sum of the first-token times is lower with the hold exactly when ``n * m > fixed_s``
(`hold_pays`): when the newcomer's compute is large (long prefills, a compute-bound forward),
splitting the batch lets the first requests finish early; when the step's fixed part dominates
(short prefills, a prefix-cache hit, a launch-bound forward), batching is free and nothing is held.
That is the split SGLang HiCache makes by accident (a request stays queued while its storage lookup
runs) made on purpose, and only where it pays (docs/benchmarks.md, "The admission hold").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

ADMISSION_HOLDS = ("cost", "always", "off")


def attention_pairs(new_tokens: int, context_tokens: int) -> float:
    """Attention pairs formed by `new_tokens` computed after `context_tokens` cached ones."""
    return new_tokens * (context_tokens + new_tokens / 2.0)


@dataclass(frozen=True)
class PrefillCost:
    """Seconds of one prefill step: ``fixed_s + per_token_s * tokens + per_pair_s * pairs``
    (module docstring); all three >= 0."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float = 0.0

    def marginal_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Seconds one request of `new_tokens` after `context_tokens` cached adds to a step."""
        return self.per_token_s * new_tokens + self.per_pair_s * attention_pairs(new_tokens, context_tokens)


def hold_pays(batch_requests: int, new_tokens: int, cost: PrefillCost | None, context_tokens: int = 0) -> bool:
    """Holding a request of `new_tokens` uncached tokens (after `context_tokens` cached) one round,
    rather than adding it to a batch that already has `batch_requests`, lowers the batch's summed
    time to first token (module docstring). False without a cost (not measured yet) or with an
    empty batch."""
    if cost is None or batch_requests <= 0 or new_tokens <= 0:
        return False
    return batch_requests * cost.marginal_s(new_tokens, max(0, context_tokens)) > cost.fixed_s


# features are scaled so the normal equations stay well conditioned: thousands of tokens, millions of pairs
_TOKEN_UNIT, _PAIR_UNIT = 1e3, 1e6


class PrefillCostFit:
    """Online least-squares fit of a prefill step's seconds against its new tokens and attention
    pairs, ``seconds = fixed_s + per_token_s * tokens + per_pair_s * pairs``, weighting the last
    `half_life_steps` steps most, every parameter >= 0 (the non-negative least-squares solution:
    of the fits on each subset of the three terms whose parameters are all >= 0, the one with the
    least weighted squared error).

    Contract: `record(tokens, seconds, pairs)` takes one measured step; `cost()` is None until
    `min_steps` steps were recorded with tokens that vary (a slope needs a spread: over 5 %), else
    the fit. Steps of 0 tokens or non-positive or non-finite seconds are ignored. Not thread-safe:
    the scheduler thread owns it."""

    def __init__(self, half_life_steps: float = 64.0, min_steps: int = 8) -> None:
        if half_life_steps <= 0 or min_steps < 2:
            raise ValueError(
                f"PrefillCostFit needs half_life_steps > 0 and min_steps >= 2, got {half_life_steps}, {min_steps}"
            )
        self._keep = 0.5 ** (1.0 / half_life_steps)
        self.min_steps = min_steps
        self.steps = 0
        self._s = [[0.0] * 3 for _ in range(3)]  # weighted sums of f_i * f_j, f = (1, tokens, pairs)
        self._b = [0.0] * 3  # weighted sums of f_i * seconds
        self._yy = 0.0
        self._fitted: PrefillCost | None = None  # `cost()`'s answer until the next step is recorded
        self._fresh = False

    def record(self, tokens: int, seconds: float, pairs: float = 0.0) -> None:
        if tokens <= 0 or not (0.0 < seconds < math.inf) or not (0.0 <= pairs < math.inf):
            return
        k = self._keep
        f = (1.0, tokens / _TOKEN_UNIT, pairs / _PAIR_UNIT)
        for i in range(3):
            for j in range(3):
                self._s[i][j] = k * self._s[i][j] + f[i] * f[j]
            self._b[i] = k * self._b[i] + f[i] * seconds
        self._yy = k * self._yy + seconds * seconds
        self.steps += 1
        self._fresh = False

    def cost(self) -> PrefillCost | None:
        # asked for at every new request's first offer (and every step at TP >= 2), changed only by
        # `record`: solve once per recorded step
        if not self._fresh:
            self._fitted, self._fresh = self._fit(), True
        return self._fitted

    def _fit(self) -> PrefillCost | None:
        if self.steps < self.min_steps:
            return None
        w, mx = self._s[0][0], self._s[0][1] / self._s[0][0]
        if self._s[1][1] / w - mx * mx <= (0.05 * mx) ** 2:  # tokens barely vary: no slope to read
            return None
        best: tuple[float, list[float]] | None = None
        for r in range(1, 4):
            for terms in itertools.combinations(range(3), r):
                coef = _solve([[self._s[i][j] for j in terms] for i in terms], [self._b[i] for i in terms])
                if coef is None or min(coef) < 0.0:
                    continue
                full = [0.0] * 3
                for t, c in zip(terms, coef):
                    full[t] = c
                sse = (
                    self._yy
                    - 2 * sum(full[i] * self._b[i] for i in range(3))
                    + sum(full[i] * full[j] * self._s[i][j] for i in range(3) for j in range(3))
                )
                if best is None or sse < best[0] - 1e-12 * max(1.0, self._yy):
                    best = (sse, full)
        if best is None:  # no subset solvable (cannot happen with a spread of tokens)
            return None
        coef = best[1]
        return PrefillCost(fixed_s=coef[0], per_token_s=coef[1] / _TOKEN_UNIT, per_pair_s=coef[2] / _PAIR_UNIT)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """`a x = b` by Gaussian elimination with partial pivoting; None when `a` is (near) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


__all__ = ["ADMISSION_HOLDS", "PrefillCost", "PrefillCostFit", "attention_pairs", "hold_pays"]
