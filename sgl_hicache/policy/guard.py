"""A guard against harmful promotion: speculative copies stop when they stop being used, and never
push out a page worth more than the one they bring.

Pure decision code: it reads counters the cache keeps (`CacheStats.prefetch["predict"]`) and
eviction priorities; it never moves bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..tree.node import TreeNode


@dataclass
class PromotionGuard:
    """Decides whether a predicted promotion may start.

    Contract:
    - `allow(used, wasted)`: True while fewer than `min_resolved_tokens` predicted tokens have been
      resolved (used by a request, or evicted unused), or while the measured precision
      `used / (used + wasted)` is at least `min_precision`. Below it, promotion stops, except one
      probe every `probe_every` calls so that a pattern that returns can be measured again.
    - `worth_evicting(candidates, pages, node, priority)`: True when the `pages` pages eviction would
      free first (the lowest of `candidates` by `priority`, the eviction order) all rank below
      `node`: a promotion that evicts only ever trades a page for one worth more.
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
    probe_every: int = 16
    prefetch_share: float = 0.5
    _calls: int = 0
    stopped: int = 0  # promotions the guard refused

    def allow(self, used_tokens: int, wasted_tokens: int) -> bool:
        resolved = used_tokens + wasted_tokens
        if resolved < self.min_resolved_tokens or used_tokens >= self.min_precision * resolved:
            return True
        self._calls += 1
        if self._calls % self.probe_every == 0:
            return True
        self.stopped += 1
        return False

    def prefetch_fits(self, held: int, need: int, capacity: int, head: bool = True) -> bool:
        # the next request to be scheduled, alone in holding host pages, crowds no one ahead of it: it
        # may use the whole tier (a request further back would push out what the ones ahead need)
        return held + need <= self.prefetch_share * capacity or (head and held == 0 and need <= capacity)

    @staticmethod
    def worth_evicting(candidates: Iterable[TreeNode], pages: int, node: TreeNode, priority: Callable[[TreeNode], tuple]) -> bool:
        if pages <= 0:
            return True
        mine = priority(node)
        freed = 0
        for victim in sorted(candidates, key=priority):
            if not priority(victim) < mine:
                return False
            freed += victim.num_pages
            if freed >= pages:
                return True
        return False
