"""The radix tree alone: match, insert, split, residency bookkeeping and check()."""

from __future__ import annotations

import pytest

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, chain_keys, page_key
from sgl_hicache.tree.node import edge_key_of
from sgl_hicache.tree.radix import InvariantError, RadixTree

NS = Namespace.for_model(KVLayout(2, 2, 8), 2)


def tree_with(*seqs, page_size=2):
    t = RadixTree(page_size, NS)
    for seq in seqs:
        path, matched = t.walk(seq)
        parent = path[-1] if path else t.root
        limit = t.page_aligned(seq)
        if matched < limit:
            node = t.add_child(parent, seq[matched:limit])
            t.set_resident(node, "device", list(range(100 + matched, 100 + matched + (limit - matched) // page_size)))
    return t


def test_walk_matches_whole_pages_only():
    t = tree_with([1, 2, 3, 4, 5, 6])
    path, matched = t.walk([1, 2, 3, 4, 5])  # the trailing 5 is a partial page
    assert matched == 4 and len(path) == 1 and tuple(path[0].tokens) == (1, 2, 3, 4)
    t.check()


def test_walk_splits_at_page_boundary_and_keeps_handles():
    t = tree_with([1, 2, 3, 4, 5, 6])
    node = t.root.children[edge_key_of((1, 2))]
    handles = list(node.device)
    path, matched = t.walk([1, 2, 3, 4, 9, 9])
    assert matched == 4 and tuple(path[-1].tokens) == (1, 2, 3, 4)
    assert list(path[-1].device + path[-1].children[edge_key_of((5, 6))].device) == handles
    assert t.node_count == 2
    t.check()


def test_page_size_one():
    t = tree_with([1, 2, 3], [1, 2, 4], page_size=1)
    assert t.walk([1, 2, 4])[1] == 3
    assert t.walk([1, 5])[1] == 1
    t.check()


def test_keys_are_chained_and_namespaced():
    other = Namespace.for_model(KVLayout(2, 2, 8), 2, tenant_salt="tenant-b")
    a = chain_keys(NS.root, [1, 2, 3, 4], 2)
    b = chain_keys(other.root, [1, 2, 3, 4], 2)
    assert a[1] == page_key(a[0], [3, 4])
    assert not set(a) & set(b)
    assert chain_keys(NS.root, [9, 9, 3, 4], 2)[1] != a[1]  # same page tokens, other prefix


def test_tier_leaves_are_leaf_first_per_tier():
    t = tree_with([1, 2, 3, 4])
    t.walk([1, 2, 5, 6])
    upper = t.root.children[edge_key_of((1, 2))]
    t.check()
    assert set(t.tier_leaves("device")) == set(upper.children.values())


def test_check_catches_broken_prefix_closure():
    t = tree_with([1, 2, 3, 4])
    t.walk([1, 2, 5, 6])  # split: upper (1,2) + lower (3,4)
    upper = t.root.children[edge_key_of((1, 2))]
    lower = upper.children[edge_key_of((3, 4))]
    t.set_resident(lower, "host", [7])
    with pytest.raises(InvariantError, match="prefix-closed"):
        t.check()


def test_check_catches_page_count_drift_and_negative_locks():
    t = tree_with([1, 2, 3, 4])
    t.pages["device"] += 1
    with pytest.raises(InvariantError, match="page count"):
        t.check()
    t.pages["device"] -= 1
    node = t.root.children[edge_key_of((1, 2))]
    with pytest.raises(InvariantError):
        t.unlock(node)


def test_locks_cover_the_whole_path():
    t = tree_with([1, 2, 3, 4])
    t.walk([1, 2, 5, 6])
    lower = t.root.children[edge_key_of((1, 2))].children[edge_key_of((3, 4))]
    t.lock(lower)
    assert lower.lock_ref == 1 and lower.parent.lock_ref == 1
    assert not lower.evictable
    t.unlock(lower)
    t.check()


def test_edges_are_int64_arrays_and_any_sequence_matches_alike():
    from array import array

    t = tree_with([1, 2, 3, 4, 5, 6])
    node = t.root.children[edge_key_of((1, 2))]
    assert isinstance(node.tokens, array) and node.tokens.typecode == "q"  # 8 bytes a token, not a tuple
    for prompt in ([1, 2, 3, 4, 5, 6, 7], (1, 2, 3, 4, 5, 6, 7), array("q", [1, 2, 3, 4, 5, 6, 7])):
        assert t.walk(prompt, split=False) == ([node], 6)
        assert t.walk(prompt[:5], split=False) == ([], 0)  # ends inside the edge: no split, no match
    t.check()


def test_leaf_sets_follow_residency_changes():
    import random

    rng = random.Random(0)
    t = RadixTree(2, NS)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(2, 12))]
        path, matched = t.walk(seq)
        parent = path[-1] if path else t.root
        limit = t.page_aligned(seq)
        if matched < limit and (parent.is_root or parent.host is not None):
            node = t.add_child(parent, seq[matched:limit])
            t.set_resident(node, "host", list(range(node.num_pages)))
        leaves = list(t.tier_leaves("host"))
        if leaves and rng.random() < 0.4:
            victim = rng.choice(leaves)
            t.clear_resident(victim, "host")
            t.remove_leaf(victim) if not victim.children else None
        # the kept sets equal a rescan of every resident node and its children
        assert set(t.tier_leaves("host")) == {
            n for n in t.resident["host"] if not any(c.host is not None for c in n.children.values())
        }
        t.check()


def test_writeback_gaps_follow_residency_and_splits():
    """`tree.gaps` holds exactly the nodes of each write-back link's upper tier that lack the lower
    copy, through copies landing, copies dropped and splits (the planner walks only these)."""
    t = tree_with([1, 2, 3, 4, 5, 6])
    node = t.root.children[edge_key_of((1, 2))]
    assert t.gaps.missing[("device", "host")] == {node} and not t.gaps.missing[("host", "disk")]
    t.set_resident(node, "host", [7, 8, 9])  # its host copy landed: no longer a device gap, now a host one
    assert not t.gaps.missing[("device", "host")] and t.gaps.missing[("host", "disk")] == {node}
    path, _ = t.walk([1, 2, 9, 9])  # a split: the upper half has the same copies, so the same gaps
    upper = path[-1]
    assert upper is not node and t.gaps.missing[("host", "disk")] == {upper, node}
    t.set_resident(upper, "disk")
    t.set_resident(node, "disk")
    t.clear_resident(node, "host")  # on device and disk: a device gap again, not a host one
    assert t.gaps.missing[("device", "host")] == {node} and not t.gaps.missing[("host", "disk")]
    t.check()
    t.gaps.missing[("device", "host")].clear()
    with pytest.raises(InvariantError, match="gap"):
        t.check()
