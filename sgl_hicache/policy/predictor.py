"""The tree-walk predictor: which descendants of a matched node will be needed next.

Pure decision code: it reads the tree's traffic counters and returns nodes; the cache moves bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from ..tree.node import TreeNode
from ..tree.traffic import TRAFFIC_HALF_LIFE_S, decay_since_stamp, stops_at


@dataclass(frozen=True)
class Prediction:
    """A descendant worth bringing up, with the probability the traffic model gives it. `pages`: only
    the node's first `pages` pages (the head of a node larger than what is left of the budget);
    None: the whole node."""

    node: TreeNode
    probability: float
    pages: int | None = None


class Predictor:
    """Interface: `predict(start, now, budget_tokens)` returns descendants of `start` to promote,
    each after its parent (so a caller can promote them in order and keep residency prefix-closed),
    choosing at most `budget_tokens` tokens (None: the predictor's own budget). With `may_evict`
    the controller may push colder pages out of the host tier to place them (never a page ranked
    above the one brought, see `PromotionGuard`); otherwise free pages only. `knows_future`: its
    picks are certain (the oracle, a ceiling for the others): the controller neither shadows its
    first bets nor holds it to a queue prefetch's host room."""

    name = "none"
    may_evict = False
    knows_future = False

    def predict(self, start: TreeNode, now: float, budget_tokens: int | None = None) -> list[Prediction]:
        return []


class TreeWalkPredictor(Predictor):
    """Best-first walk below `start`, over the traffic the cache counted once per request
    (`tree.traffic`): a child's share is its decayed count over its siblings' counts plus the
    requests that ended at the parent since one last went on below it (`stops_at`); shares multiply
    down the path into the probability that a request reaching `start` goes on to need that node.

    Contract:
    - A child counts only with a decayed count of at least `min_visits` (0.5: one request within
      one half-life; the half-life is the tree's, learned from session gaps, read through `half_life`).
    - Expected-value threshold over siblings: a node's `max_siblings` most probable children
      qualify together when their summed probability (the expected number of them used) is at least
      `min_probability`; then each of them whose own probability is at least
      `min_probability / max_siblings` is a candidate (so one of `n <= max_siblings` equally likely
      branches is picked; a shared prompt's many once-seen children are not). Nodes with more than
      `max_fanout` children are not expanded.
    - Picks the most probable candidates, parents first, until `budget_tokens` of nodes that
      `needs_promotion` are chosen; a node larger than what is left is taken by its head
      (`Prediction.pages`), and the walk ends there. `max_nodes` bounds the walk.
    - `may_evict`: its promotions may push out host pages ranked below them (the controller and
      the guard decide which).
    """

    name = "tree_walk"
    may_evict = True

    def __init__(
        self,
        page_size: int,
        budget_tokens: int,
        min_probability: float = 0.5,
        min_visits: float = 0.5,
        max_nodes: int = 64,
        needs_promotion: Callable[[TreeNode], bool] = lambda n: n.device is None,
        max_siblings: int = 4,
        max_fanout: int = 64,
        half_life: Callable[[], float] = lambda: TRAFFIC_HALF_LIFE_S,
    ) -> None:
        if budget_tokens < 0 or not 0 <= min_probability <= 1 or max_siblings < 1:
            raise ValueError(
                f"TreeWalkPredictor: bad budget {budget_tokens}, min_probability {min_probability} "
                f"or max_siblings {max_siblings}"
            )
        self.page_size = page_size
        self.budget_tokens = budget_tokens
        self.min_probability = min_probability
        self.min_visits = min_visits
        self.max_nodes = max_nodes
        self.needs_promotion = needs_promotion
        self.max_siblings = max_siblings
        self.max_fanout = max_fanout
        self.half_life = half_life

    def _shares(self, node: TreeNode, now: float) -> dict[bytes, float]:
        traffic = node.child_traffic
        if not traffic or len(traffic) > self.max_fanout:
            return {}
        hl = self.half_life()
        decay = decay_since_stamp(node, now, hl)
        counts = {k: v * decay for k, v in traffic.items() if k in node.children}
        total = sum(counts.values()) + stops_at(node, now, hl)
        if total <= 0:
            return {}
        return {k: v / total for k, v in counts.items() if v >= self.min_visits}

    def predict(self, start: TreeNode, now: float, budget_tokens: int | None = None) -> list[Prediction]:
        out: list[Prediction] = []
        budget = self.budget_tokens if budget_tokens is None else budget_tokens
        frontier: list[tuple[float, int, TreeNode]] = []
        floor = self.min_probability / self.max_siblings

        def expand(node: TreeNode, p: float) -> None:
            shares = self._shares(node, now)
            top = heapq.nlargest(self.max_siblings, shares.items(), key=lambda kv: kv[1])
            if p * sum(share for _, share in top) < self.min_probability:
                return
            for first, share in top:
                if p * share >= floor:
                    child = node.children[first]
                    heapq.heappush(frontier, (-(p * share), child.id, child))

        expand(start, 1.0)
        visited = 0
        while frontier and visited < self.max_nodes and budget >= self.page_size:
            neg_p, _, node = heapq.heappop(frontier)
            p = -neg_p
            visited += 1
            if self.needs_promotion(node):
                tokens = node.num_pages * self.page_size
                if tokens > budget:
                    out.append(Prediction(node, p, pages=budget // self.page_size))
                    break
                budget -= tokens
                out.append(Prediction(node, p))
            expand(node, p)
        return out
