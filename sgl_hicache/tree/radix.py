"""The paged radix tree: match / insert / split / remove, with per-tier residency bookkeeping.

The tree moves no bytes and decides nothing: it knows which tiers hold each node and keeps the
invariants that `check()` verifies. The cache (`sgl_hicache.cache`) decides and moves.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterator, Sequence

from ..hashing import Namespace, PageKey, int64_tokens
from ..tiers.base import DISK, TIERS, Handle
from .gaps import TierGaps
from .invariants import InvariantError, check_tree
from .leaves import LeafEntry, LeafQueue
from .node import UNWRITTEN, TreeNode, edge_key_of, slot_array, split_handles
from .traffic import HalfLife, drop_edge, start_edges

_ALL = frozenset(TIERS)
# the shared-set keys a node held in `tiers` counts in (every pair, and all three), made once per
# tier combination: lock and unlock run them on every node of a request's path
_SHARED_KEYS: dict[tuple[str, ...], tuple[frozenset, ...]] = {
    held: tuple(frozenset(p) for p in itertools.combinations(held, 2)) + ((_ALL,) if len(held) == 3 else ())
    for r in range(2, len(TIERS) + 1)
    for held in itertools.combinations(TIERS, r)
}


class RadixTree:
    """A radix tree over whole pages of token ids.

    Invariants (all verified by `check()`):
    - every non-root node holds a positive whole number of pages, with one chained key per page;
    - every non-root node is resident in at least one tier (or is locked or pinned: a node whose only
      copy was lost while in use is removed when released);
    - residency is prefix-closed in every tier: a node resident in a tier has its parent resident in
      that tier too (or the parent is the root), so what a tier keeps is always usable from the root;
    - `pages[tier]` equals the sum of the pages of the nodes resident in that tier, and `shared`
      the same for every combination of tiers;
    - lock and pin counts are never negative; a node's lock count is at least the sum of its children's
      (locks are taken on a whole path).
    """

    def __init__(self, page_size: int, namespace: Namespace) -> None:
        self.page_size = page_size
        self.namespace = namespace
        self._ids = itertools.count()  # per tree, so a replay's node ids are repeatable
        self.root = TreeNode(None, (), [namespace.root], 0, next(self._ids))
        self.root.lock_ref = 1  # the root is never evicted
        self.resident: dict[str, set[TreeNode]] = {tier: set() for tier in TIERS}
        # the resident nodes of each tier with no child resident there (`tier_leaves`), kept on every
        # residency change so eviction does not rescan the whole tier (and every node's children)
        self.leaf_sets: dict[str, set[TreeNode]] = {tier: set() for tier in TIERS}
        self.gaps = TierGaps()  # per write-back link, the resident nodes without their lower copy
        self.half_life = HalfLife()  # of the traffic counts, learned from the gaps between a session's visits
        # pages per tier of locked or pinned nodes, kept on every lock/pin/residency change
        self.protected: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.pages: dict[str, int] = dict.fromkeys(TIERS, 0)
        # pages held by nodes resident in each combination of two or more tiers, kept on every
        # residency change: `clean_pages` in O(1) (background write-back asks every step)
        self.shared: dict[frozenset[str], int] = {}
        # the same for locked or pinned nodes only: clean *evictable* pages in O(1) (write-back's
        # watermark counts only pages an eviction could take)
        self.protected_shared: dict[frozenset[str], int] = {}
        # per tier, the eviction candidates in eviction order (`order_leaves`); None: not kept
        self.leaves: dict[str, LeafQueue] | None = None
        # every node below the root by id: the leaf queues' entries name a node by its id alone, so
        # they hold no reference the garbage collector must trace (hundreds of thousands of entries
        # at production sizes); an id missing here is a node gone from the tree
        self.by_id: dict[int, TreeNode] = {}
        # bumped on every change of structure, residency, lock or pin (and by the cache when it
        # changes what eviction orders by): equal versions mean the same tree for a planner
        self.version = 0

    def order_leaves(self, entry_for: Callable[[str], LeafEntry]) -> None:
        """Keep each tier's eviction candidates ordered by the entries `entry_for(tier)(node)` from
        now on (see `tree/leaves.py` for what the key must satisfy), starting from the current leaves."""
        self.leaves = {}
        for tier in TIERS:
            q = LeafQueue(entry_for(tier))
            q.rebuild(self.tier_leaves(tier))
            self.leaves[tier] = q

    def push_leaf(self, node: TreeNode | None, tier: str) -> None:
        """`node` may have become an eviction candidate in `tier`, or its key there may have
        dropped: queue it (a no-op unless `order_leaves` was called, or `node` is not a candidate
        there: not resident, or a child is; it is queued when its last such child leaves)."""
        if (
            self.leaves is None
            or node is None
            or node.parent is None
            or getattr(node, tier) is None
            or node.children_in.get(tier)
        ):
            return
        q = self.leaves[tier]
        if q.needs_compaction(len(self.resident[tier])):
            q.rebuild(self.tier_leaves(tier))
        else:
            q.push(node)

    def touched(self) -> None:  # recency or hit counts changed: plans memoised on `version` are stale
        self.version += 1

    @property
    def node_count(self) -> int:
        """Nodes below the root."""
        return len(self.by_id)

    def leaf_queue(self, tier: str) -> LeafQueue:  # `tier`'s eviction candidates (after `order_leaves`)
        return self.leaves[tier]  # type: ignore[index]

    def page_aligned(self, tokens: Sequence[int]) -> int:
        return len(tokens) - len(tokens) % self.page_size

    def key_of(self, node: TreeNode) -> PageKey:
        return self.namespace.root if node.is_root else node.last_key

    def walk(self, tokens: Sequence[int], split: bool = True) -> tuple[list[TreeNode], int]:
        """Longest whole-page prefix of `tokens` in the tree, whatever tier holds it.

        Returns the path (root excluded) and the matched token count. With `split`, a match that
        ends inside a node splits it there so the path ends exactly at the match. A node pinned by
        transfers in flight splits too: both parts keep its pins and its incoming transfers, whose
        completion spreads the pages over the parts (`cache/transaction.py`).
        """
        ps = self.page_size
        limit = self.page_aligned(tokens)
        node, pos, path = self.root, 0, []
        # edges compare as int64 bytes (memcmp) rather than as tuples of fresh ints
        if not (isinstance(tokens, array) and tokens.typecode == "q"):
            tokens = int64_tokens(tokens[:limit])
        raw = tokens.tobytes()
        while pos < limit:
            child = node.children.get(raw[8 * pos : 8 * (pos + ps)])  # `edge_key_of` that page
            if child is None:
                break
            n = self._common_pages_bytes(child, raw, pos, limit)
            if n < child.num_pages:
                if not split:
                    break
                child = self.split(child, n)
            path.append(child)
            pos += child.num_pages * ps
            node = child
        return path, pos

    def _common_pages_bytes(self, child: TreeNode, raw: bytes, pos: int, limit: int) -> int:
        """Whole pages a prompt (as int64 bytes) has in common with `child`'s edge from `pos`, by a
        binary search over byte prefixes (each compared at C speed)."""
        ps = self.page_size
        edge = child.token_bytes
        pages = min(child.num_pages, (limit - pos) // ps)
        start = pos * 8
        if raw[start : start + pages * ps * 8] == edge[: pages * ps * 8]:
            return pages
        lo, hi = 0, pages - 1  # the first page matched already (the child was found by it)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw[start : start + mid * ps * 8] == edge[: mid * ps * 8]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def split(self, node: TreeNode, pages: int) -> TreeNode:
        """Split `node` after `pages` pages; returns the new upper node (the old node keeps the rest).
        The upper node shares the transfers in flight on `node` (its pins and `incoming`): each one's
        pages now span both, and its completion records them on both (`Transactions.complete`)."""
        assert 0 < pages < node.num_pages, (node, pages)
        self.version += 1
        cut = pages * self.page_size
        upper_keys, lower_keys = node.split_keys(pages)
        upper = TreeNode(node.parent, node.tokens[:cut], upper_keys, pages, next(self._ids))
        for tier in TIERS:  # each tier's handles: the first `pages` go to the upper node
            upper_handles, node_handles = split_handles(getattr(node, tier), pages)
            setattr(upper, tier, upper_handles)
            setattr(node, tier, node_handles)
        for attr in ("lock_ref", "pins", "hit_count", "last_access", "keep_until", "prefetched"):
            setattr(upper, attr, getattr(node, attr))
        upper.incoming = dict(node.incoming) if node.incoming else UNWRITTEN
        upper._edge = node._edge  # the same first page: the very key the parent's dicts hold
        lower_edge = edge_key_of(node.tokens[cut : cut + self.page_size])
        # every request counted into `node` went through its whole edge (a partial match splits it
        # first): the upper half passes them all on to the lower, as of the parent's stamp
        assert node.parent is not None
        carried = node.parent.child_traffic.get(node.edge_key)
        if carried is None:
            start_edges(upper, lower_edge, 1.0)
            upper.traffic_stamp = node.traffic_stamp
        else:
            start_edges(upper, lower_edge, carried)
            upper.traffic_stamp = node.parent.traffic_stamp
        assert node.parent is not None
        node.parent.children[upper.edge_key] = upper
        node.set_tokens(node.tokens[cut:])
        node.set_keys(lower_keys)
        node.num_pages -= pages
        node.parent = upper
        node._edge = lower_edge
        upper.children[lower_edge] = node
        for tier in TIERS:
            if node in self.resident[tier]:
                self.resident[tier].add(upper)
                upper.own_dict("children_in")[tier] = 1  # `node`, now its only child (the parent's count is unchanged)
        self.gaps.split(upper, node)
        self.by_id[upper.id] = upper
        return upper

    def add_child(self, parent: TreeNode, tokens: Sequence[int], owned: bool = False) -> TreeNode:
        """A new node under `parent` for whole pages `tokens`; the caller sets its residency at once.
        `owned`: `tokens` is a fresh slice the caller gives away (an int64 array is then kept as is)."""
        self.version += 1
        if not (owned and isinstance(tokens, array) and tokens.typecode == "q"):
            tokens = int64_tokens(tokens)
        assert tokens and len(tokens) % self.page_size == 0
        first = edge_key_of(tokens[: self.page_size])
        assert first not in parent.children, "add_child over an existing edge"
        node = TreeNode(parent, tokens, None, len(tokens) // self.page_size, next(self._ids))
        node._edge = first
        parent.children[first] = node
        self.by_id[node.id] = node
        return node

    def remove_leaf(self, node: TreeNode) -> None:
        assert not node.children and node.parent is not None and not node.lock_ref and not node.pins, node
        self.version += 1
        assert node.device is None and node.host is None and node.disk is None, (
            f"removing {node} that is still resident"
        )
        first = node.edge_key
        del node.parent.children[first]
        # its traffic count goes with it: a long replay would otherwise keep a count (and a page of
        # token ids) for every conversation it ever saw, and the predictor would scan them all
        drop_edge(node.parent, first)
        node.parent = None
        del self.by_id[node.id]

    def set_resident(
        self, node: TreeNode, tier: str, handles: Sequence[Handle] | None = None, owned: bool = False
    ) -> None:
        """Record `node`'s copy in `tier` (`handles`: one per page; the disk tier's default to the
        keys). `owned`: `handles` is a fresh sequence the caller gives away (kept, not copied, when
        it already has the form the tree keeps: an int64 `array` of slots, or a list of keys)."""
        assert getattr(node, tier) is None, f"{node} already in {tier}"
        if tier == DISK:
            if handles is None:
                handles = node.keys  # the lower tier is content-addressed: its handles are the keys
            kept: Sequence[Handle] = handles if owned and type(handles) is list else list(handles)
        else:
            assert handles is not None
            kept = handles if owned and type(handles) is array and handles.typecode == "q" else slot_array(handles)
        assert len(kept) == node.num_pages, (node, tier, len(kept))
        setattr(node, tier, kept)
        self.version += 1
        self._share(node, tier, +1)
        self.resident[tier].add(node)
        self.gaps.entered(node, tier)
        self._count_child(node, tier, +1)
        self.pages[tier] += node.num_pages
        if node.lock_ref or node.pins:
            self.protected[tier] += node.num_pages
        if self.leaves is not None:
            # a candidate in `tier` now, and clean (a lower key) in the tiers above it
            for t in node.tiers():
                self.push_leaf(node, t)

    def clear_resident(self, node: TreeNode, tier: str) -> Sequence[Handle]:
        """Forget `node`'s copy in `tier`; returns the handles the store must free."""
        assert node.in_tier(tier), f"{node} not in {tier}"
        self.version += 1
        self._share(node, tier, -1)
        handles: Sequence[Handle] = getattr(node, tier)
        setattr(node, tier, None)
        self.resident[tier].discard(node)
        self.gaps.left(node, tier)
        self._count_child(node, tier, -1)
        self.pages[tier] -= node.num_pages
        if node.lock_ref or node.pins:
            self.protected[tier] -= node.num_pages
        if self.leaves is not None:
            self.push_leaf(node.parent, tier)  # the parent may be a leaf of `tier` now
            for t in node.tiers():  # its key may have dropped where it stays (host: no longer on the device)
                self.push_leaf(node, t)
        return handles

    def drop_leaf(self, node: TreeNode, tier: str) -> Sequence[Handle]:
        """`clear_resident(node, tier)` then `remove_leaf(node)` in one step, for an unused leaf
        whose only copy is in `tier` (eviction's plain case: it shares nothing, protects nothing,
        has no other tier to requeue). Returns the handles the store must free."""
        parent = node.parent
        assert parent is not None and not node.children and not node.lock_ref and not node.pins, node
        handles: Sequence[Handle] = getattr(node, tier)
        setattr(node, tier, None)
        assert node.device is None and node.host is None and node.disk is None, f"{node} is in another tier"
        self.version += 1
        self.resident[tier].discard(node)
        self.gaps.dropped(node, tier)
        leaf_set = self.leaf_sets[tier]
        leaf_set.discard(node)
        counts = parent.children_in
        if counts is UNWRITTEN:
            counts = parent.children_in = {}
        n = counts.get(tier, 0) - 1
        counts[tier] = n
        self.pages[tier] -= node.num_pages
        first = node._edge
        if first is None:
            first = node.edge_key
        del parent.children[first]
        drop_edge(parent, first)
        node.parent = None
        del self.by_id[node.id]
        if n == 0 and parent.parent is not None and getattr(parent, tier) is not None:
            leaf_set.add(parent)  # the parent is a leaf of `tier` now
            self.push_leaf(parent, tier)
        return handles

    def _share(self, node: TreeNode, tier: str, sign: int) -> None:
        """`node` enters (+1) or leaves (-1) `tier` (it is in `tier` when called): update the pages of
        the tier sets it shares."""
        held = node.tiers()
        if len(held) < 2:  # in `tier` alone: it shares nothing
            return
        keys = [k for k in _SHARED_KEYS[held] if tier in k]  # the sets `tier` is part of
        n = sign * node.num_pages
        books = (self.shared, self.protected_shared) if (node.lock_ref or node.pins) else (self.shared,)
        for shared in books:
            for key in keys:
                shared[key] = shared.get(key, 0) + n

    def _count_child(self, node: TreeNode, tier: str, sign: int) -> None:
        """`node` enters (+1) or leaves (-1) `tier`: keep its parent's `children_in` and the leaf sets."""
        leaves = self.leaf_sets[tier]
        parent = node.parent
        if sign > 0:
            if not node.children_in.get(tier):
                leaves.add(node)
        else:
            leaves.discard(node)
        if parent is None:
            return
        counts = parent.children_in
        if counts is UNWRITTEN:
            counts = parent.children_in = {}
        n = counts.get(tier, 0) + sign
        counts[tier] = n
        if parent.parent is None or getattr(parent, tier) is None:
            return
        if n == 0:
            leaves.add(parent)
        else:
            leaves.discard(parent)

    def shared_pages(self, *tiers: str) -> int:
        """Pages of the nodes resident in every one of `tiers` (two or three tiers), in O(1)."""
        return self.shared.get(frozenset(tiers), 0)

    def evictable_shared_pages(self, *tiers: str) -> int:
        """`shared_pages` of the nodes no request locks and no transfer pins, in O(1)."""
        key = frozenset(tiers)
        return self.shared.get(key, 0) - self.protected_shared.get(key, 0)

    def tier_leaves(self, tier: str) -> Iterator[TreeNode]:
        """Nodes resident in `tier` with no child resident there: the only ones a tier may evict.
        (In no particular order; kept incrementally, so this is O(leaves), not O(resident nodes).)"""
        return iter(list(self.leaf_sets[tier]))

    def handles_of(self, path: Sequence[TreeNode], tier: str) -> Sequence[Handle]:
        """The handles of `path` in `tier`, in order: an int64 `array` of slots, or a list of keys (disk)."""
        out: array | list[Handle] = [] if tier == DISK else array("q")
        for node in path:
            out.extend(node.handles(tier))
        return out

    def lock(self, node: TreeNode) -> None:
        self.version += 1
        while node is not None and node.parent is not None:  # up to the root, which is never locked
            if node.lock_ref == 0 and node.pins == 0:
                self._protect(node, +1)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        self.version += 1
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise InvariantError(f"unlock of {node} with lock_ref {node.lock_ref}")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.pins == 0:
                self._protect(node, -1)
            node = node.parent

    def pin(self, node: TreeNode) -> None:
        """A transfer reads or writes `node`: never evict or split it until `unpin`."""
        self.version += 1
        if node.lock_ref == 0 and node.pins == 0:
            self._protect(node, +1)
        node.pins += 1

    def unpin(self, node: TreeNode) -> None:
        self.version += 1
        if node.pins <= 0:
            raise InvariantError(f"unpin of {node} with pins {node.pins}")
        node.pins -= 1
        if node.lock_ref == 0 and node.pins == 0:
            self._protect(node, -1)

    def _protect(self, node: TreeNode, sign: int) -> None:
        tiers = node.tiers()
        protected = self.protected
        n = sign * node.num_pages
        for tier in tiers:
            protected[tier] += n
        if len(tiers) > 1:
            ps = self.protected_shared
            for key in _SHARED_KEYS[tiers]:
                ps[key] = ps.get(key, 0) + n

    def evictable_pages(self, tier: str) -> int:
        """Pages of `tier` held by nodes no request locks and no transfer pins, in O(1)."""
        return self.pages[tier] - self.protected[tier]

    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def subtree_pages(self, node: TreeNode) -> dict[str, int]:
        totals: dict[str, int] = dict.fromkeys(TIERS, 0)
        stack = [node]
        while stack:
            n = stack.pop()
            for tier in n.tiers():
                totals[tier] += n.num_pages
            stack.extend(n.children.values())
        return totals

    def check(self) -> None:
        """Verify every invariant in the class docstring; raise InvariantError naming the first broken one."""
        check_tree(self)
