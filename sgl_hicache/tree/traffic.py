"""Decayed traffic counts on tree edges: how often a match went from a node into each child.

The predictor's only signal. One half-life governs both the writer (the cache, at match time) and
the reader (the predictor), so a count means the same thing wherever it is read.
"""

from __future__ import annotations

import itertools

from .edge_counts import EdgeCounts
from .node import EdgeKey, TreeNode

# Turns of one conversation arrive seconds to a few minutes apart; a minute's half-life lets a
# pattern that stopped fade within a few turns' time without forgetting one between two turns.
TRAFFIC_HALF_LIFE_S = 60.0

# A count at or above this, as stored right after a match, puts the child on its parent's short list
# (`TreeNode.traffic_hot`). A stored count only grows at a match of that child and only shrinks
# otherwise (rebasing, and the reader's decay factor is at most 1), so the short list holds every
# child whose decayed count can reach any `min_visits >= HOT_COUNT`: a reader with such a threshold
# looks at the few children matched more than about once, not the thousands matched once.
HOT_COUNT = 1.5
_seq = itertools.count()  # insertion order into any `child_traffic` (`traffic_seq`)


def count_edge(parent: TreeNode, first_page: EdgeKey, now: float) -> None:
    """Record one match going from `parent` into the child whose first page is `first_page`."""
    traffic = parent.child_traffic
    elapsed = now - parent.traffic_stamp
    if traffic and elapsed > TRAFFIC_HALF_LIFE_S / 64:
        # counts are kept as of `traffic_stamp`; rebasing them is O(children), so it is done at
        # most once per 1/64 half-life (a node with thousands of children is matched constantly)
        decay = 0.5 ** (elapsed / TRAFFIC_HALF_LIFE_S)
        traffic.scale(decay)
        parent.traffic_stamp = now
        elapsed = 0.0
        # what decayed below the mark leaves the short list (it returns at its next match)
        parent.traffic_hot = {k: q for k, q in parent.traffic_hot.items() if traffic[k] >= HOT_COUNT}
    elif not traffic:
        parent.traffic_stamp = now
        elapsed = 0.0
    if first_page not in traffic:
        parent.traffic_seq[first_page] = next(_seq)
    # one match now, in units of the stamp: it decays to exactly 1.0 by `now`
    count = traffic[first_page] = traffic.get(first_page, 0.0) + 2.0 ** (max(0.0, elapsed) / TRAFFIC_HALF_LIFE_S)
    if count >= HOT_COUNT:
        parent.traffic_hot[first_page] = parent.traffic_seq[first_page]


def start_edges(node: TreeNode, first_page: EdgeKey, count: float) -> None:
    """Start `node`'s counts with one child's (the upper half of a split)."""
    node.child_traffic = EdgeCounts({first_page: count})
    node.traffic_seq = {first_page: next(_seq)}
    node.traffic_hot = {first_page: node.traffic_seq[first_page]} if count >= HOT_COUNT else {}


def drop_edge(parent: TreeNode, first_page: EdgeKey) -> None:
    """Forget the count of a removed child (a long replay would otherwise keep one for every
    conversation it ever saw, and a reader would scan them all)."""
    parent.child_traffic.pop(first_page, None)
    parent.traffic_seq.pop(first_page, None)
    parent.traffic_hot.pop(first_page, None)


def hot_edges(node: TreeNode, min_visits: float) -> list[tuple[EdgeKey, float]] | None:
    """The `child_traffic` items whose decayed count may reach `min_visits`, in the dict's own order
    (so sums over them are the same floats as over the whole dict); None when `min_visits` is below
    HOT_COUNT (the caller reads all of `child_traffic`)."""
    if min_visits < HOT_COUNT:
        return None
    hot = node.traffic_hot
    keys = sorted(hot, key=hot.__getitem__) if len(hot) > 1 else list(hot)
    return [(k, node.child_traffic[k]) for k in keys]


def decay_since_stamp(node: TreeNode, now: float) -> float:
    """The factor that turns `node`'s stored counts (as of its stamp) into counts as of `now`."""
    return 0.5 ** (max(0.0, now - node.traffic_stamp) / TRAFFIC_HALF_LIFE_S)
