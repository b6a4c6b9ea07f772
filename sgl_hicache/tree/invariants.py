"""The radix tree's invariants, recomputed from its nodes (`RadixTree.check`): what the tests and
the cache's own `check` call to prove the incremental bookkeeping (page counts, shared pages, leaf
sets, write-back gaps) never drifts from the nodes it summarises."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ..hashing import PageKey, chain_keys
from ..tiers.base import TIERS
from .gaps import TierGaps
from .node import TreeNode

_ALL = frozenset(TIERS)


class CheckedTree(Protocol):
    """What `check_tree` reads of a `RadixTree`: its nodes, and the books it keeps of them
    incrementally (see `RadixTree` for each one's meaning).

    Contract: read only; `nodes()` yields every node but the root.
    """

    @property
    def page_size(self) -> int: ...

    @property
    def node_count(self) -> int: ...

    @property
    def by_id(self) -> dict[int, TreeNode]: ...

    @property
    def resident(self) -> dict[str, set[TreeNode]]: ...

    @property
    def leaf_sets(self) -> dict[str, set[TreeNode]]: ...

    @property
    def pages(self) -> dict[str, int]: ...

    @property
    def protected(self) -> dict[str, int]: ...

    @property
    def shared(self) -> dict[frozenset[str], int]: ...

    @property
    def protected_shared(self) -> dict[frozenset[str], int]: ...

    @property
    def gaps(self) -> TierGaps: ...

    def key_of(self, node: TreeNode) -> PageKey: ...

    def nodes(self) -> Iterator[TreeNode]: ...


class InvariantError(AssertionError):
    """`RadixTree.check()` found the tree in a state it must never be in."""


def check_tree(tree: CheckedTree) -> None:
    """`RadixTree.check`: every invariant of the tree's docstring, recomputed from the nodes; raises
    InvariantError naming the first broken one."""
    pages: dict[str, int] = dict.fromkeys(TIERS, 0)
    shared: dict[frozenset[str], int] = {}
    protected_shared: dict[frozenset[str], int] = {}
    protected: dict[str, int] = dict.fromkeys(TIERS, 0)
    members: dict[str, set[TreeNode]] = {tier: set() for tier in TIERS}
    count = 0
    for node in tree.nodes():
        count += 1
        if tree.by_id.get(node.id) is not node:
            raise InvariantError(f"{node} is not in the tree's by_id")
        parent = node.parent
        if parent is None or parent.children.get(node.edge_key) is not node:
            raise InvariantError(f"{node} is not linked under its parent")
        if node.num_pages == 0 or len(node.tokens) != node.num_pages * tree.page_size:
            raise InvariantError(f"{node} holds {len(node.tokens)} tokens for {node.num_pages} keys")
        if (
            len(node.keys) != node.num_pages
            or node.keys[0] != chain_keys(tree.key_of(parent), node.tokens[: tree.page_size], tree.page_size)[0]
        ):
            raise InvariantError(f"{node}'s keys are not chained from its parent")
        tiers = node.tiers()
        for books in (shared, protected_shared) if (node.lock_ref or node.pins) else (shared,):
            for i, a in enumerate(tiers):
                for b in tiers[i + 1 :]:
                    books[frozenset((a, b))] = books.get(frozenset((a, b)), 0) + node.num_pages
            if len(tiers) == 3:
                books[_ALL] = books.get(_ALL, 0) + node.num_pages
        if not tiers and node.lock_ref == 0 and node.pins == 0:
            # (a locked or pinned node may have lost its only copy meanwhile; it is removed when
            # the last lock or pin goes)
            raise InvariantError(f"{node} is resident in no tier")
        for tier in tiers:
            if len(node.handles(tier)) != node.num_pages:
                raise InvariantError(f"{node} has {len(node.handles(tier))} {tier} handles for {node.num_pages} pages")
            if not parent.is_root and not parent.in_tier(tier):
                raise InvariantError(
                    f"{tier} residency not prefix-closed: {node} is in {tier}, its parent {parent} is not"
                )
            pages[tier] += node.num_pages
            members[tier].add(node)
            if node.lock_ref or node.pins:
                protected[tier] += node.num_pages
        if node.lock_ref < 0 or node.pins < 0:
            raise InvariantError(f"{node} has a negative lock or pin count")
        for tier in TIERS:
            n_in = sum(1 for c in node.children.values() if c.in_tier(tier))
            if node.children_in.get(tier, 0) != n_in:
                raise InvariantError(f"{node} counts {node.children_in.get(tier, 0)} children in {tier}, holds {n_in}")
            if (node in tree.leaf_sets[tier]) != (node.in_tier(tier) and n_in == 0):
                raise InvariantError(f"{tier} leaf set out of sync at {node}")
        child_locks = sum(c.lock_ref for c in node.children.values())
        if node.lock_ref < child_locks:
            raise InvariantError(f"{node} lock_ref {node.lock_ref} < its children's {child_locks}")
    if count != tree.node_count:
        raise InvariantError(f"node_count {tree.node_count} but {count} nodes reachable")
    if {k: v for k, v in shared.items() if v} != {k: v for k, v in tree.shared.items() if v}:
        raise InvariantError(f"pages shared by tiers {tree.shared} but nodes hold {shared}")
    if {k: v for k, v in protected_shared.items() if v} != {k: v for k, v in tree.protected_shared.items() if v}:
        raise InvariantError(
            f"protected pages shared by tiers {tree.protected_shared} but locked/pinned nodes hold {protected_shared}"
        )
    for tier in TIERS:
        if pages[tier] != tree.pages[tier]:
            raise InvariantError(f"{tier} page count {tree.pages[tier]} but nodes hold {pages[tier]}")
        if protected[tier] != tree.protected[tier]:
            raise InvariantError(
                f"{tier} protected page count {tree.protected[tier]} but locked/pinned nodes hold {protected[tier]}"
            )
        if members[tier] != tree.resident[tier]:
            raise InvariantError(f"{tier} resident set out of sync with the nodes")
    if tree.gaps.expected(tree.resident) != tree.gaps.missing:
        raise InvariantError("the write-back gap sets are out of sync with the resident sets")
