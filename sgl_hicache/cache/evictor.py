"""Eviction: frees pages of one tier, leaf-first, in the eviction policy's order.

Where a victim is dirty and its policy keeps it (`policy/writeback.py`, `policy/reuse.py`), the
evictor makes room one tier down first and copies it there synchronously (its `Demoter`: the cache's
`Copies.copy_now`); otherwise a dirty victim is dropped and counted. It never re-enters itself
through a transfer step: a copy it starts never evicts (room was made before it was prepared).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from heapq import heappop, heapreplace

from ..policy.eviction import lru
from ..policy.writeback_choice import below, eviction_demotes, host_eviction_rank, is_clean
from ..tiers.base import DEVICE, DISK, HOST, Handle
from ..tree.leaves import Entry, LeafEntry
from ..tree.node import TreeNode
from .lower import LowerTier
from .protocols import Demoter, OrderState


# `lru`'s order as a leaf entry: the node's recency, then its id, exactly `lru`'s `(last_access, id)`
# (it runs on every push and every validated entry)
def _recency(node: TreeNode) -> Entry:
    return (node.last_access, node.id)


class Evictor:
    """Frees pages of a tier of one `TieredCache` (the caller holds the cache's lock).

    Contract: `evict(tier, n)` frees at least `n` pages of `tier` if possible and returns the pages
    freed; it never takes a locked or pinned node (a copy in flight pins it); it keeps every tier
    prefix-closed; evicting 0 pages is always safe and frees nothing. The owner sets `demoter`
    before the first eviction (the copies it demotes through make room through this evictor).
    """

    demoter: Demoter

    def __init__(self, state: OrderState, lower: LowerTier) -> None:
        self.state = state
        self.lower = lower

    def evict(self, tier: str, num_pages: int, spare_device_copies: bool = False) -> int:
        """`spare_device_copies`: never take a host page the device also holds (room for a
        write-through copy must not push out another one: it would only be copied again)."""
        c = self.state
        spare = spare_device_copies and tier == HOST
        freed = self.lower.evict_orphans(num_pages) if tier == DISK else 0
        if c.tree.leaves is not None:
            freed += self._evict_ordered(tier, num_pages - freed, spare)
        else:
            freed += self._evict_rebuilt(tier, num_pages - freed, spare)
        if tier == DISK and freed < num_pages and c.stores[DISK].peers_wrote:
            # a shared directory full of other processes' pages this one cannot free through its
            # tree: the oldest of those go, so no process is locked out of the one capacity
            freed += self.lower.store.evict_unindexed(num_pages - freed)
        return freed

    def make_room(
        self, tier: str, num_pages: int, keep: tuple[TreeNode, ...] = (), spare_device_copies: bool = False
    ) -> None:
        """Evict from `tier` until `num_pages` pages are free (or nothing more can go), never one of
        `keep` (pinned meanwhile)."""
        store = self.state.stores[tier]
        if store.free_pages >= num_pages:
            return
        tree = self.state.tree
        for n in keep:
            tree.pin(n)
        try:
            self.evict(tier, num_pages - store.free_pages, spare_device_copies)
        finally:
            for n in keep:
                tree.unpin(n)

    def _ranked(self, tier: str) -> bool:
        """The leaf order of `tier` puts host copies of device pages last (`leaf_key`)."""
        return tier == HOST and not eviction_demotes(self.state.config, tier)

    def leaf_key(self, node: TreeNode, tier: str) -> tuple:
        """Eviction order in `tier`: the policy's priority; without demotion, clean leaves (held one
        tier down: a free drop) before dirty ones, and on host the copies of device pages last."""
        if eviction_demotes(self.state.config, tier):
            return self.state.priority(node)
        if tier == HOST:
            return (host_eviction_rank(node), self.state.priority(node))
        return (not is_clean(node, tier), self.state.priority(node))

    def leaf_entry_for(self, tier: str) -> LeafEntry:
        """The leaf queue's entry of a node in `tier` (`tree/leaves.py`): `leaf_key(node, tier)`'s parts
        side by side, then the node's id, with the config's choice made once (the queue
        calls it on every push). It reads `state.priority` at each call, except for the default `lru`,
        whose `(last_access, id)` is read off the node. The priority decides alone under demotion, and
        on the device tier of a cache with no host tier (no device page can be clean: the first part
        of `leaf_key` is constant)."""
        state = self.state
        plain_lru = state.priority is lru
        if eviction_demotes(state.config, tier) or (tier == DEVICE and HOST not in state.stores):
            if plain_lru:
                return _recency
            return lambda node: (state.priority(node), node.id)
        if tier == HOST:
            if plain_lru:
                return lambda node: (host_eviction_rank(node), node.last_access, node.id)
            return lambda node: (host_eviction_rank(node), state.priority(node), node.id)
        if plain_lru:
            return lambda node: (not is_clean(node, tier), node.last_access, node.id)
        return lambda node: (not is_clean(node, tier), state.priority(node), node.id)

    def _evict_ordered(self, tier: str, num_pages: int, spare: bool = False) -> int:
        """`evict` over the tree's incrementally kept leaf queue (`tree/leaves.py`): O(log n) per
        page freed or stale entry skipped, plus the locked or pinned leaves it must step over."""
        c = self.state
        tree = c.tree
        queue = tree.leaf_queue(tier)
        entry_of = queue.entry
        # a node held in `tier` alone is dropped by `tree.drop_leaf` when no tier below could take
        # it (none configured, or the shared store, which eviction never writes)
        dst = below(tier)
        plain = dst is None or dst not in c.stores or (dst == DISK and not c.stores[DISK].demote_on_evict)
        only_here = (tier,) if plain else None
        store = c.stores[tier] if tier != DISK else None
        if store is None:
            only_here = None  # the lower tier frees through `LowerTier.free_disk`
        dropped = 0
        freed = 0
        held: list[TreeNode] = []  # in use now: queued again once this eviction is done
        heap = queue.heap  # popped here directly: a method call per entry cost more than the pop
        # the handles of every node evicted here, freed in one call at the end, in eviction order
        # (the store sees the same frees in the same order as one call per node would give it)
        runs: list[Sequence[Handle]] = []
        drop_leaf = tree.drop_leaf
        by_id = tree.by_id
        try:
            while freed < num_pages:
                if not heap:
                    break
                top: Entry = heap[0]
                node = by_id.get(top[-1])
                if (
                    node is None  # gone from the tree
                    or getattr(node, tier) is None
                    or node.children_in.get(tier)
                    or (node.children and has_child_in(node, tier))
                ):
                    heappop(heap)
                    continue  # stale: queued again when it becomes a leaf of `tier` again
                if node.lock_ref or node.pins:
                    heappop(heap)
                    held.append(node)
                    continue
                if spare and node.device is not None:
                    heappop(heap)
                    held.append(node)
                    if self._ranked(tier):
                        break  # the queue ranks device copies last: only such pages are left
                    continue
                current = entry_of(node)
                if current > top:  # used since it was queued: its turn comes later
                    heapreplace(heap, current)  # (`queue.replace_top`)
                    continue
                heappop(heap)
                if (
                    only_here is not None
                    and (node.device is None) + (node.host is None) + (node.disk is None) == 2  # in `tier` alone
                    and not node.prefetched
                    and not node.children
                ):
                    # the plain case: its only copy, nothing below to keep it: drop it in one step
                    runs.append(drop_leaf(node, tier))
                    dropped += node.num_pages
                    freed += node.num_pages
                else:  # (its parent is queued as it becomes a leaf; its handles join `runs`, in order)
                    freed += self.evict_node(node, tier, runs)  # (a disk eviction frees its own: `free_disk`)
        finally:
            if runs:
                store.free_runs(runs)  # type: ignore[union-attr]
        for node in held:
            queue.push(node)
        if dropped:
            tokens = dropped * c.page_size
            c.stats.add("evicted_tokens", tokens, tier)
            c.stats.add("dropped_tokens", tokens)
        return freed

    def _evict_rebuilt(self, tier: str, num_pages: int, spare: bool = False) -> int:
        """`evict` for a policy whose priorities change with time (`reuse`): a heap built over the
        tier's evictable leaves on each call."""
        freed = 0
        key = lambda n: self.leaf_key(n, tier)  # noqa: E731
        heap = [(key(n), n.id, n) for n in self.state.tree.tier_leaves(tier) if n.evictable]
        heapq.heapify(heap)
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not node.in_tier(tier) or not node.evictable or has_child_in(node, tier):
                continue
            if spare and node.device is not None:
                continue
            parent = node.parent
            freed += self.evict_node(node, tier)
            if parent is not None and not parent.is_root and parent.in_tier(tier) and parent.evictable:
                if not has_child_in(parent, tier):
                    heapq.heappush(heap, (key(parent), parent.id, parent))
        return freed

    def evict_node(self, node: TreeNode, tier: str, runs: list[Sequence[Handle]] | None = None) -> int:
        """Take `node` out of `tier` (demoting it first where the policy keeps it); returns its pages.
        With `runs`, its handles in `tier` are appended there for the caller to free (one store call
        per eviction, not per node; nothing here allocates in `tier`), else freed now."""
        c = self.state
        tokens = node.num_pages * c.page_size
        if tier == DEVICE and node.keep_until:
            now = c.clock()
            if node.keep_until > now and node.last_access < now:  # retained for host: it lands there as just used
                node.last_access = now
                c.tree.touched()
        dst = below(tier)
        dirty = dst is not None and dst in c.stores and not is_clean(node, tier)
        if dirty and dst == DISK and not c.stores[DISK].demote_on_evict:
            dirty = False  # the shared store is written by background write-back only, never here
        # write-back admission (policy/reuse.py): is this page worth a copy below?
        keep = dirty and (c.reuse is None or c.reuse.admit(node))
        if keep and eviction_demotes(c.config, tier):
            c.tree.pin(node)  # keep it out of the evictions that make room for it below
            try:
                self.demoter.copy_now(node, dst, kind="demote", evict=True)  # type: ignore[arg-type]
            finally:
                c.tree.unpin(node)
        elif dirty:  # never copy here: the page is lost to the tiers below
            c.stats.add("dropped_dirty_tokens", tokens, tier)
        handles = c.tree.clear_resident(node, tier)
        if tier == DISK:
            self.lower.free_disk(handles)
        elif runs is not None:
            runs.append(handles)
        else:
            c.stores[tier].free(handles)
        c.stats.add("evicted_tokens", tokens, tier)
        if node.prefetched and ((tier == DEVICE and node.host is None) or (tier == HOST and node.device is None)):
            c.stats.add_prefetch(node.prefetched, "wasted_tokens", tokens, node.prefetch_trigger)
            node.prefetched = node.prefetch_trigger = None
        if node.device is None and node.host is None and node.disk is None:
            c.tree.remove_leaf(node)
            c.stats.add("dropped_tokens", tokens)
        return node.num_pages


def has_child_in(node: TreeNode, tier: str) -> bool:
    """A child is in `tier`, or a copy into `tier` is on its way (a background write-back prepared
    while `node` was there): evicting `node` would break prefix closure."""
    return any(c.in_tier(tier) or tier in c.incoming for c in node.children.values())
