"""Eviction over leaves kept incrementally (`tree/leaves.py`), and write-back that keeps evictable_size exact.

- the incremental queue evicts exactly what a heap rebuilt over every leaf on each call evicts
  (same nodes, same order), over a random workload with locks, splits, hits and clean/dirty changes;
- one eviction looks at a handful of nodes, not every resident one (no rebuild per call);
- a background copy locks its node's path: the ancestors it keeps from being leaves are not counted
  evictable, so evicting everything `evictable_pages` claims frees exactly that much;
- eviction that never demotes takes clean pages first and counts the dirty ones it drops.
"""

from __future__ import annotations

import random

import pytest
from conftest import make_cache, serve

from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.handlers import execute


def _prompt(rng: random.Random, shared: list[list[int]], ps: int) -> list[int]:
    """A prompt that often continues an earlier one (so the tree branches and splits)."""
    if shared and rng.random() < 0.6:
        base = rng.choice(shared)
        cut = rng.randrange(1, len(base) // ps + 1) * ps
        tail = [rng.randrange(10, 5000) for _ in range(rng.randrange(1, 4) * ps)]
        return base[:cut] + tail
    return [rng.randrange(10, 5000) for _ in range(rng.randrange(1, 5) * ps)]


@pytest.mark.parametrize("policy,demotes", [("lru", "all"), ("lfu", "all"), ("lru", "none")])
def test_incremental_leaves_evict_what_a_rebuilt_heap_evicts(policy, demotes):
    caches = [make_cache(None, device=24, host=48, eviction_policy=policy, eviction_demotes=demotes) for _ in range(2)]
    caches[1].tree.leaves = None  # the reference: a heap rebuilt over every leaf on each call
    assert caches[0].tree.leaves is not None
    rng = random.Random(7)
    prompts: list[list[int]] = []
    t = 0.0
    for step in range(300):
        t += 1.0
        p = _prompt(rng, prompts, 4)
        prompts.append(p)
        locked = []
        for c in caches:
            c.clock = lambda t=t: t
            _, _handles = serve(c, p)
            if step % 7 == 0:  # a request still running: its path stays locked through the eviction
                m = c.match(p, touch=False)
                c.lock(m.last_node)
                locked.append((c, m.last_node))
            ops = c.plan_writeback(DEVICE, HOST, clean_target_pages=6, max_pages=3) if step % 5 == 0 else []
            for op in ops:
                execute(op, c.handlers)
                c.complete(op)
        n = rng.randrange(1, 6)
        for tier in (DEVICE, HOST):
            freed = [c.evict(tier, n) for c in caches]
            assert freed[0] == freed[1], (step, tier, freed)
        for c, node in locked:
            c.unlock(node)
        a, b = ([(tuple(n.tokens), n.tiers()) for n in sorted(c.tree.nodes(), key=lambda n: n.id)] for c in caches)
        assert a == b, step
    for c in caches:
        c.check()
    assert caches[0].snapshot()["evicted_tokens"] == caches[1].snapshot()["evicted_tokens"]


def test_one_eviction_looks_at_few_nodes_not_every_leaf():
    cache = make_cache(None, device=2000, host=0, disk=0)
    for i in range(1000):  # 1000 one-page leaves
        serve(cache, [10_000 + i] * 4)
    calls = 0
    priority = cache.priority

    def counting(node):
        nonlocal calls
        calls += 1
        return priority(node)

    cache.priority = counting
    assert cache.evict(DEVICE, 1) == 1
    assert calls <= 4, calls  # a rebuilt heap would ask for all 1000 keys
    cache.check()


def test_writeback_locks_its_path_so_evictable_size_is_exact():
    cache = make_cache(None, device=16, host=16, eviction_demotes="none")
    base = list(range(100, 108))  # 2 pages
    serve(cache, base)
    serve(cache, base + list(range(200, 208)))  # a child of 2 pages under it
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=16, max_pages=16)
    assert ops and ops[0].locks_path
    # the parent's copy is in flight (planned first: host must stay prefix-closed)
    node = ops[0].node
    assert node.lock_ref == 1 and node.pins == 1
    claimed = cache.tree.evictable_pages(DEVICE)
    assert cache.evict(DEVICE, 100) == claimed  # every page it claimed, and no more
    for op in ops:
        execute(op, cache.handlers)
        cache.complete(op)
    assert node.lock_ref == 0 and cache.tree.evictable_pages(DEVICE) == cache.tree.pages[DEVICE]
    cache.check()


def test_eviction_without_demotion_takes_clean_pages_first_and_counts_dropped_dirty():
    cache = make_cache(None, device=8, host=16, eviction_demotes="none")
    cold, warm = [list(range(1000, 1008)), list(range(2000, 2008))]
    serve(cache, cold)
    serve(cache, warm)
    # copy the *warm* prompt to host by hand: clean, though the cold one is older
    op = cache.prepare(cache.match(warm, touch=False).path[-1], HOST, "backup", may_evict=False)
    execute(op, cache.handlers)
    cache.complete(op)
    assert cache.evict(DEVICE, 2) == 2
    assert cache.match(cold, touch=False).device_tokens == 8  # the dirty cold prompt stayed
    assert cache.match(warm, touch=False).host_tokens == 8  # the clean warm one went: a free drop
    assert cache.snapshot()["dropped_dirty_tokens"][DEVICE] == 0
    assert cache.snapshot()["bytes_moved"]["device->host"] == op.nbytes  # nothing copied by eviction
    assert cache.evict(DEVICE, 2) == 2  # now the dirty one: dropped and counted
    assert cache.snapshot()["dropped_dirty_tokens"][DEVICE] == 8
    cache.check()


def _land(cache, ops) -> None:
    for op in ops:
        execute(op, cache.handlers)
        assert cache.complete(op)


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_write_through_never_pushes_out_another_device_pages_host_copy(policy):
    """Host holds only copies of device pages: a write-through copy of one more device page finds no
    room and waits, instead of evicting a copy the next round would make again (churn)."""
    cache = make_cache(None, device=8, host=4, eviction_demotes="none", eviction_policy=policy)
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    serve(cache, a)
    serve(cache, b)
    _land(cache, cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8))
    held = {n.id for n in cache.nodes_in(HOST)}
    assert len(held) == 2 and cache.tree.pages[HOST] == 4
    serve(cache, c)
    assert cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8) == []
    assert {n.id for n in cache.nodes_in(HOST)} == held
    # a host page the device no longer holds is fair game: evict a's device copy, then c goes in
    cache.evict(DEVICE, 2)
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8)
    assert len(ops) == 1 and cache.tree.pages[HOST] == 2
    _land(cache, ops)
    assert cache.tree.pages[HOST] == 4
    cache.check()


def _served_tree(policy: str):
    """Three one-page paths a, b, c served at t = 1, 2, 3; a hit twice more (t = 4, 5), b once (t = 6):
    hit counts a 2, b 1, c 0; LRU order c (3) < a (5) < b (6)."""
    cache = make_cache(None, device=3, host=0, disk=0, eviction_policy=policy)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    for t, p in enumerate([a, b, c, a, a, b], start=1):
        cache.clock = lambda t=t: float(t)
        serve(cache, p)
    return cache, {cache.match(p, touch=False).last_node.tokens[0]: p for p in (a, b, c)}


def _eviction_order(cache) -> list[int]:
    order = []
    while cache.tree.pages[DEVICE]:
        before = {n.tokens[0] for n in cache.nodes_in(DEVICE)}
        assert cache.evict(DEVICE, 1) == 1
        order += sorted(before - {n.tokens[0] for n in cache.nodes_in(DEVICE)})
    return order


@pytest.mark.parametrize(
    "policy,order",
    [
        ("lru", [3, 1, 2]),  # by last use: c (3), a (5), b (6)
        ("lfu", [3, 2, 1]),
    ],
)
def test_policy_order_on_a_small_tree(policy, order):
    cache, _ = _served_tree(policy)
    assert cache.tree.leaves is not None  # every one of these keeps the incremental queue
    assert _eviction_order(cache) == order
    cache.check()


def test_a_given_priority_is_never_kept_incrementally():
    """The oracle's Belady key falls as the future comes closer (a node whose next use passed is
    never used again): a queue built on keys that only grow would evict in a stale order."""
    cache = make_cache(None, device=4, host=0, disk=0, priority=lambda n: (n.last_access, n.id))
    assert cache.tree.leaves is None
