"""Random sequences of insert, match, lock, unlock, evict and promote; check() after every step."""

from __future__ import annotations

import tempfile
from pathlib import Path

from conftest import kv_for, make_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_hicache.tiers.base import DEVICE, DISK, HOST

# prompts from a small alphabet so they share prefixes and split each other
prompt = st.lists(st.integers(0, 2), min_size=1, max_size=12).map(lambda xs: [t for x in xs for t in (x, x + 1)])
op = st.one_of(
    st.tuples(st.just("serve"), prompt),
    st.tuples(st.just("match"), prompt),
    st.tuples(st.just("lock"), prompt),
    st.tuples(st.just("unlock"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.sampled_from([DEVICE, HOST, DISK]), st.integers(1, 6)),
    st.tuples(st.just("promote"), prompt),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    page_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["lru", "lfu"]),
    write=st.sampled_from(["write_back", "write_through", "write_through_selective"]),
)
def test_random_operations_keep_every_invariant(ops, page_size, policy, write):
    with tempfile.TemporaryDirectory() as d:
        cache = make_cache(
            Path(d), device=6, host=5, disk=8, page_size=page_size, eviction_policy=policy, write_policy=write
        )
        locked = []
        for step in ops:
            kind = step[0]
            if kind == "serve":
                tokens = step[1]
                m = cache.promote(cache.match(tokens))
                cache.lock(m.last_node)
                fresh = cache.allocate_device(len(tokens) // page_size - len(m.device_handles))
                if fresh is not None:
                    cache.stores[DEVICE].write(fresh, kv_for(cache, tokens)[len(m.device_handles) :])
                    r = cache.insert(tokens, m.device_handles + fresh)
                    cache.free_device(r.duplicates)
                cache.unlock(m.last_node)
            elif kind == "match":
                cache.match(step[1])
            elif kind == "lock":
                m = cache.match(step[1])
                cache.lock(m.last_node)
                locked.append(m.last_node)
            elif kind == "unlock" and locked:
                cache.unlock(locked.pop(step[1] % len(locked)))
            elif kind == "evict":
                before = {n for n in cache.nodes_in(step[1]) if n.lock_ref}
                cache.evict(step[1], step[2])
                assert before <= set(cache.nodes_in(step[1])), "a locked node was evicted"
            elif kind == "promote":
                m = cache.promote(cache.match(step[1]))
                if m.device_tokens:  # what came up is the right KV
                    got = cache.stores[DEVICE].read(m.device_handles)
                    want = kv_for(cache, step[1][: m.device_tokens])
                    assert got.view(-1).view(dtype=got.dtype).equal(want.view(-1)), "promoted KV differs"
            cache.check()
        for node in locked:
            cache.unlock(node)
        cache.check()
