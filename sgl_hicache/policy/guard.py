"""A guard against harmful promotion: speculative copies stop when they stop being used, and never
push out a page worth more than the one they bring.

Pure decision code: it reads counters the cache keeps (`CacheStats.prefetch["predict"]`) and
eviction priorities; it never moves bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..tree.node import TreeNode


@dataclass
class _Window:
    """One trigger's cumulative (resolved, used) token counts as seen at earlier calls, oldest first."""

    marks: deque = field(default_factory=deque)
    calls: int = 0


@dataclass
class PromotionGuard:
    """Decides whether a predicted promotion may start.

    Contract:
    - `allow(used, wasted, trigger)`: `used` / `wasted` are the cumulative predicted tokens of one
      trigger (a kind of prediction: the tree walk's, a client's hints) that a request used, or that
      were evicted unused. Each trigger is judged alone, over a window: the tokens resolved since the
      oldest call at most `window_tokens` resolved tokens ago. True while fewer than
      `min_resolved_tokens` were resolved in that window, or while its precision `used / resolved`
      is at least `min_precision`; below it, promotion stops, except one probe every `probe_every`
      refused calls, so that a pattern that returns can be measured again (and, since the window
      moves, recover); `admit` says how big a probe may be (`probe_tokens`). A trigger that misses
      never stops another.
    - `proven(used, wasted, bets)`: whether a trigger's shadow record (`policy/shadow.py`: the
      tokens of picks it wrote down instead of copying, used or wasted so far, over `bets` judged
      bets) lets it make real copies: at least `shadow_bets` bets judged (0: no shadow phase), at a
      precision of at least `min_precision`. Counted in bets, not tokens: one bet is one sample of
      the pattern however large, and a token count would not scale with the deployment's prompts.
    - `worth_evicting(candidates, pages, node, priority)`: True when the `pages` pages eviction would
      free first (the lowest of `candidates` by `priority`, the eviction order) all rank below
      `node` (and, with `clean`, all pass it: their data has a copy elsewhere): a promotion that
      evicts only ever trades a page for one worth more, and never loses one.
    - `lead_pays(queue_delay_s, lead_s)`: whether a prediction can still win anything: only while
      the requests' measured queueing delay (arrival -> admission, `QueueDelay`) is shorter than
      the prediction's lead. A prediction brings at most what the disk link reads in its lead
      (`speculation.prediction_budget`); a request that waits longer than that in the queue has the
      same pages brought by its own queue prefetch before it is admitted, so a prediction there only
      adds copies (and its wrong guesses cost disk time). `queue_deep` counts the calls so refused.
    - `outlives_lead(stay_s, lead_s)`: whether a page brought to host now would still be there
      when the request it is predicted for arrives: only while the host tier keeps such a page
      (`stay_s`, estimated by `speculation.host_stay_s`) at least the prediction's lead. A copy
      evicted before its use is all cost. `short_stay` counts the calls so refused.
    - `prefetch_fits(held, need, capacity, head)`: whether a queue prefetch of `need` pages may start
      in a tier of `capacity` pages in which `held` pages are already locked or pinned (by running
      requests and earlier prefetches): only while all of them fit in `prefetch_share` of the tier,
      or, for the request at the head of the queue (`head`) while nothing else holds pages, the
      whole tier.
      A prefetch is a demand load made early, and it holds its pages until its request is
      scheduled; past that share it takes the room the requests ahead of it need (pages demoted
      from the device, their own loads). With prompts nearly as long as the host tier is large it
      made an agentic replay 10x slower than no prefetch (docs/results.md).
    """

    min_precision: float = 0.5
    min_resolved_tokens: int = 4096
    window_tokens: int = 65536
    probe_every: int = 16
    probe_tokens: int = 1024
    shadow_bets: int = 2
    prefetch_share: float = 0.5
    stopped: int = 0  # promotions the guard refused
    queue_deep: int = 0  # predictions not made: the queue gave demand prefetch the lead already
    short_stay: int = 0  # predictions not made: the host tier would evict them before their lead ends
    _windows: dict = field(default_factory=dict)

    def allow(self, used_tokens: int, wasted_tokens: int, trigger: str = "predict") -> bool:
        return self.admit(used_tokens, wasted_tokens, trigger) is not None

    def admit(self, used_tokens: int, wasted_tokens: int, trigger: str = "predict") -> int | None:
        """`allow`, with the size: None (refused), 0 (no limit) or, for a probe, the most tokens it
        may promote (`probe_tokens`: a probe measures a pattern, it does not bet on it)."""
        w = self._windows.setdefault(trigger, _Window(deque([(0, 0)])))
        resolved = used_tokens + wasted_tokens
        marks = w.marks
        if marks[-1][0] != resolved:
            marks.append((resolved, used_tokens))
        # the base: the newest mark at least `window_tokens` back (the start, while none is)
        while len(marks) > 1 and marks[1][0] <= resolved - self.window_tokens:
            marks.popleft()
        base_resolved, base_used = marks[0]
        window = resolved - base_resolved
        if window < self.min_resolved_tokens or used_tokens - base_used >= self.min_precision * window:
            return 0
        w.calls += 1
        if w.calls % self.probe_every == 0:
            return self.probe_tokens
        self.stopped += 1
        return None

    def proven(self, used_tokens: int, wasted_tokens: int, bets: int) -> bool:
        return bets >= self.shadow_bets and used_tokens >= self.min_precision * (used_tokens + wasted_tokens)

    def lead_pays(self, queue_delay_s: float, lead_s: float) -> bool:
        if lead_s > 0 and queue_delay_s >= lead_s:
            self.queue_deep += 1
            return False
        return True

    def outlives_lead(self, stay_s: float, lead_s: float) -> bool:
        if lead_s > 0 and stay_s < lead_s:
            self.short_stay += 1
            return False
        return True

    def prefetch_fits(self, held: int, need: int, capacity: int, head: bool = True) -> bool:
        # the next request to be scheduled, alone in holding host pages, crowds no one ahead of it: it
        # may use the whole tier (a request further back would push out what the ones ahead need)
        return need <= self.prefetch_room(held, capacity) or (head and held == 0 and need <= capacity)

    def prefetch_room(self, held: int, capacity: int) -> int:
        """Pages a prefetch of a request not at the head of the queue may still take (`prefetch_fits`)."""
        return int(self.prefetch_share * capacity) - held

    @staticmethod
    def worth_evicting(
        candidates: Iterable[TreeNode],
        pages: int,
        node: TreeNode,
        priority: Callable[[TreeNode], tuple],
        clean: Callable[[TreeNode], bool] | None = None,
    ) -> bool:
        if pages <= 0:
            return True
        mine = priority(node)
        freed = 0
        for victim in sorted(candidates, key=priority):
            if not priority(victim) < mine or (clean is not None and not clean(victim)):
                return False
            freed += victim.num_pages
            if freed >= pages:
                return True
        return False


@dataclass
class QueueDelay:
    """Requests' queueing delay (arrival -> admission), smoothed over the last admissions: an
    exponential average whose weight halves every `half_life` admissions. 0 until one is seen."""

    half_life: int = 32
    seconds: float = 0.0
    samples: int = 0

    def add(self, delay_s: float) -> float:
        keep = 0.5 ** (1.0 / self.half_life) if self.samples else 0.0
        self.seconds = keep * self.seconds + (1.0 - keep) * max(0.0, delay_s)
        self.samples += 1
        return self.seconds
