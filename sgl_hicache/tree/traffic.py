"""Decayed traffic counts on tree edges: how many requests went from a node into each child, and
how many ended at a node since one last went on below it.

The predictor's only signal. Counted once per request (its arrival match and the nodes its insert
adds), never per match call. One half-life governs both the writer (the cache) and the reader (the
predictor), so a count means the same thing wherever it is read; it is learned from the gaps
between a session's visits (`HalfLife`), not fixed.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from .edge_counts import EdgeCounts
from .node import NO_COUNTS, EdgeKey, TreeNode

# Turns of one conversation arrive seconds to a few minutes apart; a minute's half-life lets a
# pattern that stopped fade within a few turns' time without forgetting one between two turns. The
# starting value of `HalfLife` (before it has seen gaps) and the default of the functions below.
TRAFFIC_HALF_LIFE_S = 60.0


class HalfLife:
    """The traffic counts' half-life, learned from the gaps between visits of a session.

    Contract: `value` starts at `initial`; once `min_samples` gaps were observed it is `factor`
    times the `quantile` of the last `window` gaps, clamped to [`floor`, `ceiling`]: a session
    that returns within that quantile of the gaps seen still counts at least ``0.5 ** (1 / factor)``
    of its earlier requests (a mean would be set by the many short gaps between turns, and forget
    every session by the time it comes back after a pause). `observe(gap)` ignores gaps that are not
    positive and finite. The value is recomputed every `every` gaps; a count written under one
    value and read under a later one is approximate (it moves slowly).
    """

    def __init__(
        self,
        initial: float = TRAFFIC_HALF_LIFE_S,
        factor: float = 2.0,
        quantile: float = 0.9,
        window: int = 512,
        floor: float = 1.0,
        ceiling: float = 3600.0,
        min_samples: int = 8,
        every: int = 8,
    ) -> None:
        if not 0 < floor <= initial <= ceiling or factor <= 0 or not 0 < quantile <= 1 or window < 1:
            raise ValueError(
                f"HalfLife: bad initial {initial}, floor {floor}, ceiling {ceiling}, factor {factor}, "
                f"quantile {quantile} or window {window}"
            )
        self.value = initial
        self.factor = factor
        self.quantile = quantile
        self.floor = floor
        self.ceiling = ceiling
        self.min_samples = min_samples
        self.every = every
        self.samples = 0
        self.window = window
        self._gaps: deque[float] = deque()  # the last `window` gaps, oldest first
        # the same gaps kept sorted (an insert and a removal per gap, memmoves in C): observe runs
        # on the scheduler thread inside `match`, where sorting the window cost tens of µs
        self._ordered: list[float] = []

    def observe(self, gap: float) -> None:
        if not (gap > 0 and math.isfinite(gap)):
            return
        gaps, ordered = self._gaps, self._ordered
        if len(gaps) == self.window:
            del ordered[bisect.bisect_left(ordered, gaps.popleft())]
        gaps.append(gap)
        bisect.insort(ordered, gap)
        self.samples += 1
        if self.samples >= self.min_samples and self.samples % self.every == 0:
            q = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
            self.value = min(self.ceiling, max(self.floor, self.factor * q))


# A session's edge is matched about once per visit; an edge whose decayed count reaches this is a
# shared one (a system prompt's), whose gaps are not a session's (`count_request`)
HOT_COUNT = 1.5


def count_edge(parent: TreeNode, first_page: EdgeKey, now: float, half_life: float = TRAFFIC_HALF_LIFE_S) -> None:
    """Record one request going from `parent` into the child whose first page is `first_page` (it
    also ends the stops counted at `parent`: a request went on below it since)."""
    parent.traffic_stops = 0.0
    traffic = parent.child_traffic
    if traffic is NO_COUNTS:  # the first match that goes on from `parent`: counts of its own
        traffic = parent.child_traffic = EdgeCounts()
    elapsed = now - parent.traffic_stamp
    if not traffic:
        parent.traffic_stamp = now
        traffic.add(first_page, 1.0)
        return
    if elapsed > half_life / 64:
        # counts are kept as of `traffic_stamp`; rebasing them is O(children), so it is done at
        # most once per 1/64 half-life (a node with thousands of children is matched constantly)
        traffic.scale(0.5 ** (elapsed / half_life))
        parent.traffic_stamp = now
        traffic.add(first_page, 1.0)
    else:
        # one match now, in units of the stamp: it decays to exactly 1.0 by `now`
        traffic.add(first_page, 2.0 ** (elapsed / half_life) if elapsed > 0.0 else 1.0)


def start_edges(node: TreeNode, first_page: EdgeKey, count: float) -> None:
    """Start `node`'s counts with one child's (the upper half of a split)."""
    node.child_traffic = EdgeCounts({first_page: count})


def drop_edge(parent: TreeNode, first_page: EdgeKey) -> None:
    """Forget the count of a removed child (a long replay would otherwise keep one for every
    conversation it ever saw, and a reader would scan them all)."""
    parent.child_traffic.pop(first_page, None)


def decay_since_stamp(node: TreeNode, now: float, half_life: float = TRAFFIC_HALF_LIFE_S) -> float:
    """The factor that turns `node`'s stored counts (as of its stamp) into counts as of `now`."""
    return 0.5 ** (max(0.0, now - node.traffic_stamp) / half_life)


def count_stop(node: TreeNode, now: float, half_life: float = TRAFFIC_HALF_LIFE_S) -> None:
    """Record one request whose path ended at `node`."""
    node.traffic_stops = stops_at(node, now, half_life) + 1.0
    node.stops_at = now


def stops_at(node: TreeNode, now: float, half_life: float = TRAFFIC_HALF_LIFE_S) -> float:
    """The decayed count, as of `now`, of requests that ended at `node` since one last went on below it."""
    if not node.traffic_stops:
        return 0.0
    return node.traffic_stops * 0.5 ** (max(0.0, now - node.stops_at) / half_life)


def count_request(root: TreeNode, half_life: HalfLife, path: list[TreeNode], now: float) -> None:
    """One request's traffic along `path` (from `root`), and the half-life's sample: the gap since
    its deepest node was last visited, where the predictor will walk from it (it has children) and
    its edge is a session's (rarely taken, unlike a shared prompt's). Gaps between the turns of a
    conversation end at a tip and are not samples: they would set the half-life to seconds and
    forget every session before it comes back."""
    if path:
        deep = path[-1]
        parent = deep.parent
        if parent is not None and deep.last_access > 0 and deep.children:
            stored = parent.child_traffic.get(deep.edge_key, 0.0) or 0.0
            if stored * decay_since_stamp(parent, now, half_life.value) < HOT_COUNT:
                half_life.observe(now - deep.last_access)
    hl = half_life.value
    parent = root
    for node in path:
        count_edge(parent, node.edge_key, now, hl)
        parent = node
