"""The lower tier's own cases: a disk directory (or a shared store) outlives this process and may be
written by others, so the tree adopts pages it finds there, frees files nobody refers to, and drops
a subtree whose page is gone."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import cast

from ..hashing import chain_keys, page_key
from ..tiers.base import DISK, Handle, KeyedStore
from ..transfer.ops import TransferOp
from ..tree.node import TreeNode, edge_key_of
from .protocols import CacheState


class LowerTier:
    """The lower-tier slot of one `TieredCache` (the caller holds the cache's lock).

    Contract: `adopt` adds at most one disk-only node under the match and never moves bytes;
    `evict_orphans` frees only pages no node and no write in flight refers to, in key order (every
    tensor-parallel rank frees the same ones); `drop_subtree` forgets the disk copies below a node
    whose page is unreadable, and the nodes held nowhere else.
    """

    def __init__(self, state: CacheState) -> None:
        self.state = state
        # copies into the disk tier not applied yet: their pages may be stored before the tree
        # claims them, and must not be taken for orphaned files (`evict_orphans`)
        self.writes_in_flight: set[TransferOp] = set()

    @property
    def store(self) -> KeyedStore:
        return cast(KeyedStore, self.state.stores[DISK])  # the lower slot holds a content-addressed store

    def adopt(self, path: list[TreeNode], tokens: Sequence[int], matched: int) -> list[TreeNode]:
        """Pages of `tokens` past the tree's match that the disk store holds but the tree does not
        know (written by an earlier process, or by another process sharing the directory while it
        runs): adopt them as a disk-only node."""
        tree = self.state.tree
        disk = self.store
        shared = disk.shared  # a shared store: other servers add pages any time
        peers = disk.peers_wrote  # a shared directory another process has written to
        if not (shared or peers) and disk.stored_pages <= tree.pages[DISK]:
            return []  # no orphan pages on disk and nobody else writes: nothing to find
        parent = path[-1] if path else tree.root
        if not (parent.is_root or parent.disk is not None):
            return []  # a disk node must hang under a disk node (prefix closure)
        ps = tree.page_size
        if len(tokens) - matched < ps or edge_key_of(tokens[matched : matched + ps]) in parent.children:
            return []
        limit = tree.page_aligned(tokens)
        keys: list[bytes] = []
        if shared:  # one batched existence check for everything past the match
            wanted = chain_keys(tree.key_of(parent), tokens[matched:limit], ps)
            keys = list(wanted[: disk.count_present(wanted)])
        else:
            # keys one page at a time: a miss (the common case) hashes one page, not the whole rest
            find = disk.discover if peers else disk.contains
            key = tree.key_of(parent)
            for start in range(matched, limit, ps):
                key = page_key(key, tokens[start : start + ps])
                if not find(key):
                    break
                keys.append(key)
        if not keys:
            return []
        node = tree.add_child(parent, tokens[matched : matched + len(keys) * ps])
        node.set_keys(keys)
        tree.set_resident(node, DISK)
        return [node]

    def holds(self, key: Handle) -> bool:
        """The disk store holds the page (a peer sharing the directory may have written it)."""
        return self.store.discover(key)

    def evict_orphans(self, num_pages: int) -> int:
        """Free disk pages no tree node refers to (left by an earlier process and not matched since
        the restart): by LRU they are the coldest pages there are."""
        store = self.store
        tree = self.state.tree
        if store.stored_pages <= tree.pages[DISK]:
            return 0
        referenced = {k for n in tree.resident[DISK] for k in n.keys}
        # a write in flight may have stored its pages already: they are the tree's a moment later,
        # or freed by the copy's own completion (an orphaned copy stays in the set until then)
        referenced.update(k for op in self.writes_in_flight for k in op.dst_handles)
        # in key order, not the store's index order (a directory scan's), so that every rank of a
        # tensor-parallel cache frees the same pages; O(n log num_pages)
        victims = heapq.nsmallest(num_pages, (k for k in store.own_keys() if k not in referenced))
        self.free_disk(victims)
        return len(victims)

    def drop_subtree(self, node: TreeNode) -> None:
        """A disk page is gone: the disk copies of the node and of everything below it are unusable
        (their prefix cannot be read); forget them, and the nodes held nowhere else."""
        stack = [node]
        order: list[TreeNode] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # leaves first
            if n.disk is not None:
                self.free_disk(self.state.tree.clear_resident(n, DISK))
            self.state.prune(n)

    def free_disk(self, keys: Sequence[Handle]) -> None:
        store = self.store
        for key in keys:
            try:
                store.free([key])
            except KeyError:
                pass  # the store already discarded it (corrupt file)
