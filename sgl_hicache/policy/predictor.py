"""The tree-walk predictor: which descendants of a matched node will be needed next.

Pure decision code: it reads the tree's traffic counters and returns nodes; the cache moves bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from ..tree.node import TreeNode
from ..tree.traffic import decay_since_stamp, hot_edges


@dataclass(frozen=True)
class Prediction:
    """A descendant worth bringing up, with the probability the traffic model gives it."""

    node: TreeNode
    probability: float


class Predictor:
    """Interface: `predict(start, now)` returns descendants of `start` to promote, each after its
    parent (so a caller can promote them in order and keep residency prefix-closed). With
    `may_evict` the controller may push colder pages out of the host tier to place them (never a
    page ranked above the one brought, see `PromotionGuard`); otherwise free pages only."""

    name = "none"
    may_evict = False

    def predict(self, start: TreeNode, now: float) -> list[Prediction]:
        return []


class TreeWalkPredictor(Predictor):
    """Best-first walk below `start`, scoring each child by the decayed share of the traffic that
    went from its parent into it (`TreeNode.child_traffic`, counted by the cache on every match),
    multiplied down the path: the probability that a request reaching `start` goes on to need that
    node. Picks the most probable nodes above `min_probability` until `budget_tokens` of nodes not
    already on the device are chosen; `max_nodes` bounds the walk.

    Decayed counts follow the tree's one half-life (`tree.traffic`), so traffic that stopped long ago stops pulling pages up.
    """

    name = "tree_walk"

    def __init__(self, page_size: int, budget_tokens: int, min_probability: float = 0.5, min_visits: float = 2.0, max_nodes: int = 64,
                 needs_promotion: Callable[[TreeNode], bool] = lambda n: n.device is None) -> None:
        if budget_tokens < 0 or not 0 <= min_probability <= 1:
            raise ValueError(f"TreeWalkPredictor: bad budget {budget_tokens} or min_probability {min_probability}")
        self.page_size = page_size
        self.budget_tokens = budget_tokens
        self.min_probability = min_probability
        self.min_visits = min_visits
        self.max_nodes = max_nodes
        self.needs_promotion = needs_promotion

    def _shares(self, node: TreeNode, now: float) -> dict[bytes, float]:
        if not node.child_traffic:
            return {}
        decay = decay_since_stamp(node, now)
        # a child seen fewer than `min_visits` (decayed) times is no evidence of a pattern
        # (only the node's short list of children matched more than once, when min_visits allows)
        items = hot_edges(node, self.min_visits)
        if items is None:
            items = node.child_traffic.items()  # type: ignore[assignment]
        counts = {k: v * decay for k, v in items if k in node.children and v * decay >= self.min_visits}
        # the decayed mass of traffic that stopped at this node counts as a reason not to go on:
        # one match ending here is worth one unit, so a single past visit into a child is not a certainty
        total = sum(counts.values()) + decay
        return {k: v / total for k, v in counts.items()} if total > 0 else {}

    def predict(self, start: TreeNode, now: float) -> list[Prediction]:
        out: list[Prediction] = []
        budget = self.budget_tokens
        frontier: list[tuple[float, int, TreeNode]] = []

        def expand(node: TreeNode, p: float) -> None:
            for first, share in self._shares(node, now).items():
                child = node.children[first]
                heapq.heappush(frontier, (-(p * share), child.id, child))

        expand(start, 1.0)
        visited = 0
        while frontier and visited < self.max_nodes:
            neg_p, _, node = heapq.heappop(frontier)
            p = -neg_p
            if p < self.min_probability:
                break
            visited += 1
            tokens = node.num_pages * self.page_size
            if self.needs_promotion(node):
                if tokens > budget:
                    continue
                budget -= tokens
                out.append(Prediction(node, p))
            expand(node, p)
        return out

