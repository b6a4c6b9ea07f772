"""Decayed traffic counts on tree edges: how often a match went from a node into each child.

The predictor's only signal. One half-life governs both the writer (the cache, at match time) and
the reader (the predictor), so a count means the same thing wherever it is read.
"""

from __future__ import annotations

from .node import TreeNode

# Turns of one conversation arrive seconds to a few minutes apart; a minute's half-life lets a
# pattern that stopped fade within a few turns' time without forgetting one between two turns.
TRAFFIC_HALF_LIFE_S = 60.0


def count_edge(parent: TreeNode, first_page: tuple[int, ...], now: float) -> None:
    """Record one match going from `parent` into the child whose first page is `first_page`."""
    elapsed = now - parent.traffic_stamp
    if parent.child_traffic and elapsed > TRAFFIC_HALF_LIFE_S / 64:
        # counts are kept as of `traffic_stamp`; rebasing them is O(children), so it is done at
        # most once per 1/64 half-life (a node with thousands of children is matched constantly)
        decay = 0.5 ** (elapsed / TRAFFIC_HALF_LIFE_S)
        for k in parent.child_traffic:
            parent.child_traffic[k] *= decay
        parent.traffic_stamp = now
        elapsed = 0.0
    elif not parent.child_traffic:
        parent.traffic_stamp = now
        elapsed = 0.0
    # one match now, in units of the stamp: it decays to exactly 1.0 by `now`
    parent.child_traffic[first_page] = parent.child_traffic.get(first_page, 0.0) + 2.0 ** (max(0.0, elapsed) / TRAFFIC_HALF_LIFE_S)


def decay_since_stamp(node: TreeNode, now: float) -> float:
    """The factor that turns `node`'s stored counts (as of its stamp) into counts as of `now`."""
    return 0.5 ** (max(0.0, now - node.traffic_stamp) / TRAFFIC_HALF_LIFE_S)
