"""Stretched lifetimes (`stretch`): LRU in which each node's idle time is credited with a fixed,
node-drawn bonus, so some pages outlive the LRU horizon instead of all pages falling just short of it.

Measured on requests 0-5,999 of the shipped Mooncake trace (trace time): a chat page's
chance of being used again in the next moment is ~0 for its first 30 s idle and peaks at 60-240 s;
30 % of new pages return, after a median of 126 s (p90 ~450 s). At 0.1-0.3x the working set the
cache holds ~30-90 s of traffic, so LRU keeps every page for the same short time and loses nearly all
returns. Belady keeps exactly the pages that return; no feature seen at insert tells those apart
(P(return) 0.17-0.37 in every class of turn, previous gap, prompt, output and node size; an online
per-size-class return rate did no better than a blind draw). What works without a predictor is to
keep *some* pages long enough rather than all pages too briefly: each node gets a stable draw `u`
in [0, 1) and its key is `last_access + u * scale` (lowest evicted first).

`SCALE_S` (seconds of the cache's clock) was chosen on requests 0-999 and 3,000-3,999 of the shipped
trace at trace clock x4 (2,000-5,000 all did about as well; 300-1,000 worse): about the p90 of the
gap between a session's turns there. It is a prior about chat sessions, not learned online. It
pays only while the cache holds less than most gaps (0.1-0.3x the working set: +0.05 to +0.97 points
on the held-out slices, 1-10 % of Belady's gain); at 0.5x it lost 1.55 points to LRU on Mooncake,
so it is an option (`--eviction stretch`), not the default (docs/results.md, "Retention").

The key only grows (a node's draw is fixed, its `last_access` only grows), so it keeps the incremental
leaf queue's contract (`tree/leaves.py`): O(log n) per eviction, like LRU.
"""

from __future__ import annotations

from ..tree.node import TreeNode

_PHI = 0.6180339887498949  # golden-ratio draws: node ids in sequence spread evenly over [0, 1)

SCALE_S = 3000.0


def draw(node_id: int) -> float:
    """A stable pseudo-random number in [0, 1) for a node."""
    return (node_id * _PHI) % 1.0


def stretch(node: TreeNode) -> tuple:
    """Lowest first: `last_access + draw(id) * SCALE_S`. A node's draw never changes and its
    `last_access` only grows, so its key only grows (a split's upper part is a new node with its own
    draw, queued when it becomes a leaf)."""
    return (node.last_access + draw(node.id) * SCALE_S, node.id)
