"""A model of future requests from what the tree sees, for retention, promotion and admission.

Signals (all observed online, from the requests the cache has served; nothing is read ahead):
- *continuation*: a node at depth `d` (nodes below the root, capped) used `h` times is used again
  with probability `q(d, h)`, estimated as the share of such nodes that went on to `h + 1` uses. Depth
  stands for the conversation's turn (each turn adds a node below the previous one: on the shipped
  trace a first turn continues 27 % of the time, a third 55 %, a fifth 70 %); uses stand for a shared
  prefix's fan-out;
- *gaps*: the empirical distribution of the time between two uses of a node (a conversation's
  think time), so a node idle for longer than most gaps is less and less likely to return:
  P(used again | idle for a) = q S(a) / (1 - q + q S(a)), S the gap survival function;
- *cost*: a page deeper in a prompt costs more to recompute (attention over the prefix), so it is
  worth more per byte: weight 1 + depth / `depth_scale` tokens.

Pure decision code: the cache reports requests and inserts (`on_insert`, `on_request`); the model
answers `value(node)` and orders eviction by it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import Any

from ..tree.node import TreeNode
from .predictor import Prediction, Predictor

# idle-time bins (s) for the gap distribution: log-spaced, 0.5 s .. ~9 h
_BINS = [0.5 * 1.5**i for i in range(25)]
# a gap's value within its bin (bisect_left: bin i holds (_BINS[i-1], _BINS[i]]; the last is open)
_BIN_VALUES = [0.25] + [(lo * hi) ** 0.5 for lo, hi in zip(_BINS, _BINS[1:])] + [_BINS[-1] * 1.5]


class ReuseModel:
    """Expected reuse value of a tree node (module docstring).

    Contract:
    - `on_insert(nodes)` / `on_request(path)` are the only inputs (new nodes; one served request's
      matched path, before its hit counts are incremented).
    - `p_reuse(node)` is in [0, 1]; for a fixed history it falls as the node stays idle longer, and
      rises with the node's use count where the history shows used nodes return more often.
    - `priority(node)` is an eviction priority (lowest evicted first): value, then recency.
    - `admit(node)`: whether a page evicted from a tier deserves a copy one tier down (expected reuse
      at least `admit_min_probability`; 0 admits everything).
    - `recent(limit)` lists the nodes last used by a request, most valuable first (candidates for
      promotion ahead of their return).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        depth_scale: float = 8192.0,
        max_uses: int = 8,
        admit_min_probability: float = 0.0,
        prior_q: float = 0.3,
    ) -> None:
        self.clock = clock
        self.depth_scale = depth_scale
        self.max_uses = max_uses
        self.admit_min_probability = admit_min_probability
        self.prior_q = prior_q
        self.max_depth = 8
        self.reached: dict[tuple[int, int], int] = {}  # (depth, uses) -> nodes that reached it
        self.gap_counts = [0] * (len(_BINS) + 1)
        self.gaps = 0
        # time of a node's last request (or insert), by `_key` so that a node split by a later match
        # keeps its history in the upper part (which keeps the parent and the first page)
        self.last_used: dict[object, float] = {}
        self.depth: dict[int, int] = {}
        self.depth_nodes: dict[int, int] = {}
        self.tips: dict[int, TreeNode] = {}  # the last node of recent requests' matches / inserts

    # ---- observations ------------------------------------------------------------------------
    def on_insert(self, nodes: Iterable[TreeNode]) -> None:
        now = self.clock()
        for node in nodes:
            self.last_used[self._key(node)] = now
            key = (self._depth_nodes(node), 0)
            self.reached[key] = self.reached.get(key, 0) + 1
            self.tips[node.id] = node

    def on_request(self, path: list[TreeNode]) -> None:
        now = self.clock()
        for node in path:
            key = self._key(node)
            prev = self.last_used.get(key)
            # the gaps of a node's first uses: a hot shared prefix, used every second, would
            # otherwise fill the distribution with its own gaps
            if prev is not None and now > prev and node.hit_count < 3:
                self.gap_counts[bisect.bisect_left(_BINS, now - prev)] += 1
                self.gaps += 1
            self.last_used[key] = now
            key = (self._depth_nodes(node), min(node.hit_count + 1, self.max_uses + 1))
            self.reached[key] = self.reached.get(key, 0) + 1
        if path:
            self.tips[path[-1].id] = path[-1]
        if len(self.tips) > 4096:  # forget the oldest tips (insertion order)
            for key in list(self.tips)[: len(self.tips) - 4096]:
                del self.tips[key]
        self._bound()

    def _bound(self, limit: int = 1 << 18) -> None:
        """Keep the per-node memories bounded in a long-running server: past `limit` entries the
        older half goes (dicts keep insertion order; a forgotten node falls back to its last access)."""
        memos: tuple[dict[Any, Any], ...] = (self.last_used, self.depth, self.depth_nodes)
        for memo in memos:
            if len(memo) > limit:
                for key in list(memo)[: len(memo) // 2]:
                    del memo[key]

    # ---- estimates ---------------------------------------------------------------------------
    def q(self, node: TreeNode) -> float:
        """P(a node of this depth used this often is used once more), smoothed towards `prior_q`."""
        d, h = self._depth_nodes(node), min(node.hit_count, self.max_uses)
        return min(1.0, (self.reached.get((d, h + 1), 0) + 2 * self.prior_q) / (self.reached.get((d, h), 0) + 2))

    def _depth_nodes(self, node: TreeNode) -> int:
        depth = self.depth_nodes.get(node.id)
        if depth is None:
            depth, n = 0, node
            while n.parent is not None and depth < self.max_depth:
                depth, n = depth + 1, n.parent
            self.depth_nodes[node.id] = depth
        return depth

    def survival(self, idle: float) -> float:
        """Share of observed gaps longer than `idle` seconds (1.0 before any gap was seen)."""
        if not self.gaps:
            return 1.0
        below = sum(self.gap_counts[: bisect.bisect_left(_BINS, idle) + 1])
        return max(0.0, 1.0 - below / self.gaps) or 0.5 / self.gaps

    def population_q(self) -> float:
        """P(a node is used again after its insert), over every depth, smoothed towards `prior_q`."""
        inserted = sum(v for (_, h), v in self.reached.items() if h == 0)
        again = sum(v for (_, h), v in self.reached.items() if h == 1)
        return min(1.0, (again + 2 * self.prior_q) / (inserted + 2))

    def median_residual(self, idle: float) -> float:
        """The median of (gap - idle) over the observed gaps longer than `idle`: how much longer a node
        idle for `idle` seconds more likely than not waits for its next use, if it comes (inf where no
        observed gap is that long). The median, not the mean: on heavy-tailed pauses (an agent's
        seconds-long tool calls beside a person's minutes) the mean is the tail's, and would rank a
        conversation just used as if it came back in minutes."""
        longer = [(gap, count) for count, gap in zip(self.gap_counts, _BIN_VALUES) if count and gap > idle]
        half = sum(count for _, count in longer) / 2.0
        seen = 0
        for gap, count in longer:
            seen += count
            if seen >= half:
                return gap - idle
        return float("inf")

    def return_curve(self) -> list[tuple[float, float]]:
        """(idle seconds, value density) of a typical node at each idle-bin edge: P(used again |
        idle) / the median wait for it, in uses per second of holding. Falls with idle time where
        the gaps are heavy-tailed; near zero throughout where most nodes never return."""
        q = self.population_q()
        curve = []
        for idle in (0.0, *_BINS):
            s = q * self.survival(idle)
            p = s / (1.0 - q + s) if s > 0 else 0.0
            curve.append((idle, p / max(self.median_residual(idle), 1e-3)))
        return curve

    def p_reuse(self, node: TreeNode) -> float:
        q = self.q(node)
        idle = self.clock() - self.last_used.get(self._key(node), node.last_access)
        s = q * self.survival(idle)
        return s / (1.0 - q + s) if s > 0 else 0.0

    @staticmethod
    def _key(node: TreeNode) -> object:
        # the chained key of the node's first page names its prefix; the upper part of a split keeps it
        return node.keys[0] if node.parent is not None else None

    def _depth_tokens(self, node: TreeNode) -> int:
        depth = self.depth.get(node.id)
        if depth is None:
            depth = sum(len(n.tokens) for n in node.path_from_root()) - len(node.tokens)
            self.depth[node.id] = depth
        return depth

    def value(self, node: TreeNode) -> float:
        """Expected recompute saved by keeping the node, per page (relative units)."""
        return self.p_reuse(node) * (1.0 + self._depth_tokens(node) / self.depth_scale)

    def priority(self, node: TreeNode) -> tuple:
        return (self.value(node), node.last_access, node.id)

    def admit(self, node: TreeNode) -> bool:
        return self.admit_min_probability <= 0 or self.p_reuse(node) >= self.admit_min_probability

    def recent(self, limit: int) -> list[TreeNode]:
        alive = [n for n in self.tips.values() if n.parent is not None]
        alive.sort(key=self.value, reverse=True)
        return alive[:limit]


def equal_value_idle(curve: list[tuple[float, float]], value: float) -> float:
    """The shortest idle time on `curve` (`ReuseModel.return_curve`) at which a typical node is
    worth at most `value` per second held (inf: every idle time is worth more)."""
    for idle, v in curve:
        if v <= value:
            return idle
    return float("inf")


class ContinuationPredictor(Predictor):
    """Promotion ahead of arrival: the recent requests' tips (a conversation's last turn) whose
    expected reuse is at least `min_probability` and that sit on disk only, most valuable first,
    up to `budget_tokens` per call. Independent of the arriving request's own match: a
    conversation comes back on its own clock."""

    name = "continuation"
    may_evict = True

    def __init__(
        self, model: ReuseModel, page_size: int, budget_tokens: int, min_probability: float = 0.5, scan: int = 256
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.budget_tokens = budget_tokens
        self.min_probability = min_probability
        self.scan = scan

    def predict(self, start: TreeNode, now: float, budget_tokens: int | None = None) -> list[Prediction]:
        out: list[Prediction] = []
        budget = self.budget_tokens if budget_tokens is None else budget_tokens
        for node in self.model.recent(self.scan):
            if node.device is not None or node.host is not None or node.disk is None:
                continue
            p = self.model.p_reuse(node)
            if p < self.min_probability:
                continue
            tokens = (
                sum(n.num_pages for n in node.path_from_root() if n.host is None and n.device is None) * self.page_size
            )
            if tokens > budget:
                continue
            budget -= tokens
            out.append(Prediction(node, p))
        return out
