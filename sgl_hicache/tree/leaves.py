"""Evictable leaves of one tier, kept in eviction order as the tree changes (no rebuild per evict).

A lazy min-heap of entries `(*key, node id)`: the key's parts, then the node's id, in one flat tuple
of numbers. Flat: a heap of 100k+ entries compares it about 30 % faster than a tuple that nests the
key. Numbers only: the garbage collector stops tracing such a tuple after its first pass, where an
entry holding the node stays traced at every full collection (a third of a production-size tree's
objects); the node is found by id in the tree's `by_id`, and an id not there is a node gone from
the tree.

The tree pushes a node whenever it may have become a candidate or its key may have dropped (it
enters a tier, a child leaves one); it never deletes. The evictor validates the lowest entry (`top`)
against the node's state then, so a stale entry costs one pop (`drop_top`), or one sift where only
its key grew (`replace_top`).

Contract (what makes `top` the true minimum): every candidate node (resident in the tier,
no child there) has at least one entry whose key is <= its current key. That holds when keys only
grow between pushes, as LRU and LFU keys do (`last_access` and `hit_count` only increase), and when
every event that can lower a key (a node becomes clean: it entered the tier below) pushes it. An
entry whose node's key grew since is queued again with the current key (`replace_top`).

The queue is given the entry function `entry(node)`, which builds the node's entry from its current
key; ties are broken by node id (the entry's last part).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from .node import TreeNode

# (key's parts when queued..., node id): ordered by the key, then the id
Entry = tuple[Any, ...]
LeafEntry = Callable[[TreeNode], Entry]


class LeafQueue:
    """Candidates for eviction from one tier, lowest key first (see the module docstring).

    `push`, `drop_top` and `replace_top` are O(log n); `top` is O(1). The tree rebuilds the heap
    (`rebuild`) when its entries outnumber the tier's resident nodes 4 to 1 (`needs_compaction`;
    amortized O(1) per push).
    """

    def __init__(self, entry: LeafEntry) -> None:
        self.entry = entry
        self._heap: list[Entry] = []

    @property
    def heap(self) -> list[Entry]:
        """The entries as a `heapq` heap, for a caller that pops many (the evictor): always the same
        list object (a rebuild refills it in place), so a caller may hold it across pushes."""
        return self._heap

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, self.entry(node))

    def top(self) -> Entry | None:
        """The entry with the lowest key (its node's id is `entry[-1]`), left in place; None when empty."""
        return self._heap[0] if self._heap else None

    def drop_top(self) -> None:
        """Remove the `top` entry (there is one)."""
        heapq.heappop(self._heap)

    def replace_top(self, entry: Entry) -> None:
        """Replace the `top` entry by `entry`, its node's current one (its key grew since it was
        queued): one sift, where a pop and a push took two."""
        heapq.heapreplace(self._heap, entry)

    def needs_compaction(self, live: int) -> bool:
        return len(self._heap) > 4 * live + 1024

    def rebuild(self, nodes: Iterable[TreeNode]) -> None:
        """Replace every entry by one per node of `nodes` (the tier's current leaves)."""
        entry = self.entry
        self._heap[:] = [entry(n) for n in nodes]  # in place: see `heap`
        heapq.heapify(self._heap)
