"""Evictable leaves of one tier, kept in eviction order as the tree changes (no rebuild per evict).

A lazy min-heap of `(key, node id, node)` entries. The tree pushes a node whenever it may have
become a candidate or its key may have dropped (it enters a tier, a child leaves one); it never
deletes. `pop` validates an entry against the node's state then, so stale entries cost one pop.

Contract (what makes `pop` return the true minimum): every candidate node (resident in the tier,
no child there) has at least one entry whose key is <= its current key. That holds when keys only
grow between pushes, as LRU and LFU keys do (`last_access` and `hit_count` only increase), and when
every event that can lower a key (a node becomes clean: it entered the tier below) pushes it. A
popped entry whose node's key grew since is pushed again with the current key.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .node import TreeNode

LeafKey = Callable[[TreeNode], tuple]


class LeafQueue:
    """Candidates for eviction from one tier, lowest key first (see the module docstring).

    `push` is O(log n); `pop` is amortized O(log n) per stale entry it skips. The heap is rebuilt
    from `rebuild_from` when stale entries outnumber live nodes 4 to 1 (amortized O(1) per push).
    """

    def __init__(self, key: LeafKey) -> None:
        self.key = key
        self._heap: list[tuple[tuple, int, TreeNode]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (self.key(node), node.id, node))

    def pop(self) -> tuple[tuple, TreeNode] | None:
        """The entry with the lowest key (its key when pushed, and the node), or None when empty."""
        if not self._heap:
            return None
        key, _, node = heapq.heappop(self._heap)
        return key, node

    def needs_compaction(self, live: int) -> bool:
        return len(self._heap) > 4 * live + 1024

    def rebuild(self, nodes: Iterable[TreeNode]) -> None:
        """Replace every entry by one per node of `nodes` (the tier's current leaves)."""
        self._heap = [(self.key(n), n.id, n) for n in nodes]
        heapq.heapify(self._heap)
