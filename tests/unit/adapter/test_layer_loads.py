"""The server's data path off the scheduler thread, with real stores and no SGLang:

- layer-wise demand loads (`sglang.layer_loads.LayerLoads` behind `ThreadExecutor(layers=...)`): the
  controller's load copies nothing on the calling thread, SGLang's counter protocol (`wait_until`,
  `set_consumer`, `batch_index`) hands each layer over bit-identical, the loaded path stays locked
  (not evictable) until `reap` sees the copies done;
- eviction that never copies (`eviction_demotes="none"`): clean pages are freed, dirty ones dropped
  and counted;
- an insert that diverges inside a node a transfer has pinned splits it; the copy lands on both parts.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import kv_for, make_cache, serve

from sgl_hicache.control.lifecycle import ControllerSettings, RequestController
from sgl_hicache.policy.predictor_factory import make_predictor
from sgl_hicache.sglang.layer_loads import LayerLoads
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.engine import TransferEngine
from sgl_hicache.transfer.executors import ThreadExecutor
from sgl_hicache.transfer.handlers import execute


def _spy_copies(cache, record) -> None:
    """Call `record(op)` for every copy any of the cache's handlers makes, on the copying thread."""
    for key, handler in list(cache.handlers.items()):
        cache.handlers[key] = (lambda h: lambda op, start, stop: (record(op), h(op, start, stop))[1])(handler)


def seq(start: int, pages: int, page_size: int = 4) -> list[int]:
    return list(range(start, start + pages * page_size))


def _controller(cache, loads):
    engine = TransferEngine(cache, workers=1)
    ctl = RequestController(
        cache,
        ThreadExecutor(cache, engine, layers=loads),
        make_predictor("none", cache.page_size, 0),
        ControllerSettings(device_writeback_clean_fraction=0, writeback_clean_fraction=0),
        clock=time.monotonic,
    )
    return ctl, engine


def test_layerwise_load_copies_nothing_inline_and_hands_over_each_layer(tmp_path):
    cache = make_cache(None, device=4, host=16)
    prompts = [seq(1000 * i, 4) for i in range(3)]
    for p in prompts:
        serve(cache, p)
    m = cache.match(prompts[0], touch=False)
    assert m.host_tokens == 16 and m.device_tokens == 0  # demoted to host by the later prompts
    loads = LayerLoads(cache)
    ctl, engine = _controller(cache, loads)
    cache.evict(DEVICE, 4)  # room for the load
    inline = []
    _spy_copies(cache, lambda op: inline.append((op.link, threading.get_ident())))
    try:
        m2, _ = ctl.load(prompts[0], cache.match(prompts[0], touch=False))
        assert m2.device_tokens == 16
        assert inline == []  # the host -> device copy was queued, not made on this thread
        node = m2.last_node
        assert node.lock_ref >= 1 and cache.tree.evictable_pages(DEVICE) * 4 < cache.tree.pages[DEVICE] * 4
        index = loads.batch_index()
        assert index >= 0 and loads.batch_index() == -1  # the next batch queued nothing
        loads.set_consumer(index)
        want = kv_for(cache, prompts[0])
        dev = cache.stores[DEVICE]
        for layer in range(loads.num_layers):
            loads.wait_until(layer)
            got = torch.stack([dev.layer_pages(layer, kv)[m2.device_handles] for kv in (0, 1)], dim=1)
            assert torch.equal(got.view(torch.int16), want[:, layer].view(torch.int16))
        for g in list(loads._pending):
            g.loader.synchronize()
        assert loads.reap() is False  # done: unlocked
        assert node.lock_ref == 0
        cache.check()
        assert loads.snapshot()["loads"] == 1 and loads.snapshot()["pages"] == 4
    finally:
        engine.stop()


def test_agreed_layer_loads_unlock_only_what_every_rank_finished(tmp_path):
    """TP >= 2 (`LayerLoads(agreed=True)`): a finished load stays locked until the step's agreement
    names it (`reap_agreed`, in queue order); asking for more than this rank finished is an error."""
    cache = make_cache(None, device=8, host=32)
    prompts = [seq(1000 * i, 2) for i in range(6)]
    for p in prompts:
        serve(cache, p)
    loads = LayerLoads(cache, agreed=True)
    ctl, engine = _controller(cache, loads)
    try:
        nodes = []
        for p in prompts[:2]:
            m = cache.match(p, touch=False)
            assert m.host_tokens == 8 and m.device_tokens == 0
            cache.evict(DEVICE, 2)
            m2, _ = ctl.load(p, m)
            assert m2.device_tokens == 8
            nodes.append(m2.last_node)
        assert loads.queued == 2
        loads.synchronize()
        assert loads.done_prefix() == 2
        assert loads.reap() is True and all(n.lock_ref >= 1 for n in nodes)  # not agreed yet: still locked
        loads.reap_agreed(1)  # the other rank finished only the first
        assert nodes[0].lock_ref == 0 and nodes[1].lock_ref >= 1 and loads.queued == 1
        with pytest.raises(RuntimeError, match="only 1 of 1"):
            loads.reap_agreed(2)
        loads.reap_agreed(1)
        assert nodes[1].lock_ref == 0 and not loads.inflight
        cache.check()
    finally:
        engine.stop()


def test_wait_until_with_nothing_pending_returns_at_once():
    cache = make_cache(None, device=4, host=4)
    loads = LayerLoads(cache)
    loads.set_consumer(-1)
    loads.wait_until(0)
    assert loads.reap() is False and not loads.inflight


def test_eviction_without_demotion_frees_clean_pages_and_counts_dirty_drops():
    cache = make_cache(None, device=4, host=16, eviction_demotes="none")
    a, b = seq(0, 2), seq(5000, 2)
    serve(cache, a)
    serve(cache, b)
    node_a = cache.match(a, touch=False).last_node
    assert cache.copy_now(node_a, HOST, kind="backup", may_evict=False)  # a is clean (on host too)
    copies = []
    _spy_copies(cache, lambda op: copies.append(op.link))
    assert cache.evict(DEVICE, 4) == 4
    assert copies == []  # eviction copied nothing
    assert cache.match(a, touch=False).host_tokens == 8  # the clean one survives on host
    assert cache.match(b, touch=False).tokens == 0  # the dirty one is gone
    assert cache.snapshot()["dropped_dirty_tokens"][DEVICE] == 8
    cache.check()


def test_insert_beside_a_node_whose_copy_is_in_flight_splits_it_and_adopts_the_callers_branch():
    """A host copy in flight pins its node; a request diverging inside that node still splits it (a
    pinned node used to stop the walk, and the request's pages all became duplicates): the shared
    part is the tree's, the divergent part is adopted, and the copy lands on both parts."""
    cache = make_cache(None, device=8, host=8, eviction_demotes="none")
    a = seq(0, 4)
    serve(cache, a)
    node = cache.match(a, touch=False).last_node
    op = cache.prepare(node, HOST, kind="backup", may_evict=False)
    assert op is not None and node.pins == 1
    b = a[:8] + seq(9000, 2)  # shares 2 of its 4 pages, then diverges
    m = cache.match(b, touch=False)
    assert m.device_tokens == 8
    fresh = cache.allocate_device(2)
    r = cache.insert(b, m.device_handles + fresh)
    assert r.adopted_pages == 2 and len(r.duplicates) == 0
    upper = node.parent
    assert upper.num_pages == node.num_pages == 2 and upper.incoming[HOST] is op and upper.pins == 1
    execute(op, cache.handlers)
    assert cache.complete(op)
    assert upper.host is not None and node.host is not None and upper.pins == node.pins == 0
    cache.check()


def test_eviction_keeps_a_parent_whose_child_is_being_copied_into_the_tier():
    """A background copy of a child into host was prepared while its parent was on host: evicting the
    parent from host before the copy lands would leave host residency not prefix-closed."""
    cache = make_cache(None, device=8, host=8, eviction_demotes="none")
    a = seq(0, 2)
    serve(cache, a)
    serve(cache, a + seq(7000, 2))
    parent = cache.match(a, touch=False).last_node
    assert cache.copy_now(parent, HOST, kind="backup", may_evict=False)
    [op] = cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8)  # the child, device -> host
    assert op.node.parent is parent
    assert cache.evict(HOST, 2) == 0  # the parent is the only host leaf, and its child is on its way
    execute(op, cache.handlers)
    cache.complete(op)
    cache.check()


def test_a_copy_that_must_evict_for_room_never_evicts_its_own_parent():
    """Background device -> host write-back of a child whose parent is the coldest host page: making
    room in host must not evict that parent (host would not be prefix-closed once the copy lands)."""
    cache = make_cache(None, device=8, host=2, eviction_demotes="none")
    a = seq(0, 2)
    serve(cache, a)
    serve(cache, a + seq(7000, 2))
    parent = cache.match(a, touch=False).last_node
    assert cache.copy_now(parent, HOST, kind="backup", may_evict=False)  # host is full with the parent
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8)
    assert ops == []  # no room without evicting the parent: nothing planned
    assert parent.host is not None
    cache.check()
