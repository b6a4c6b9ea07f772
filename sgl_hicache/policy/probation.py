"""Probation: one-hit wonders go first (S3-FIFO's small queue, SGLang's `slru`), as pure priorities.

On multi-turn chat 73 % of first turns never return. S3-FIFO (SOSP '23) filters such
one-hit wonders through a small probationary queue; SLRU keeps a probationary and a protected
segment. On the radix tree both become one sortable key per node, lowest evicted first:

- `probation`: a node never hit since it was inserted (`hit_count == 0`) goes before any node that
  was reused; LRU within each class.
- `slru`: SGLang's `SLRUStrategy` (`mem_cache/evict_policy.py`): a node is protected once it was
  hit `SLRU_PROTECTED_HITS` (2) times; probationary nodes go first, LRU within each segment.

Both keys only grow with use (`hit_count` and `last_access` only increase, and leaving probation
raises the first field), so they keep the incremental leaf queue's contract (`tree/leaves.py`):
O(log n) per eviction, like LRU.
"""

from __future__ import annotations

from ..tree.node import TreeNode

SLRU_PROTECTED_HITS = 2


def probation(node: TreeNode) -> tuple:
    """First-seen paths (never hit since insert) before reused ones; LRU within each class."""
    return (node.hit_count > 0, node.last_access, node.id)


def slru(node: TreeNode) -> tuple:
    """Probationary segment (hit fewer than `SLRU_PROTECTED_HITS` times) before the protected one."""
    return (node.hit_count >= SLRU_PROTECTED_HITS, node.last_access, node.id)
