"""Write-through at commit: a request's committed device pages get their host copies
started at commit, not at the next step's pump (which in the server runs after the next admission
has evicted them), so an eviction right after finds them clean. Behaviour, not figures."""

from __future__ import annotations

import torch
from conftest import SMALL_LAYOUT, kv_for
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.config import CacheConfig
from sgl_hicache.control.composition import build_cache
from sgl_hicache.control.lifecycle import ControllerSettings, RequestController
from sgl_hicache.policy.predictor import Predictor
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes


def _setup(device=8, host=16):
    clock = Clock()
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=device * PS,
        host_tokens=host * PS,
        disk_tokens=0,
        page_size=PS,
        write_policy="write_through",
        eviction_demotes="none",
    )
    cache = build_cache(cfg, clock=clock)
    ex = VirtualExecutor(cache, VirtualPipes(lambda link, tokens: tokens / 1000.0), clock, PS)
    return clock, cache, ex, RequestController(cache, ex, Predictor(), ControllerSettings(), clock)


def _insert(cache, tokens):
    m = cache.match(tokens, touch=False)
    fresh = cache.allocate_device(len(tokens) // PS - len(m.device_handles))
    cache.stores[DEVICE].write(fresh, kv_for(cache, tokens)[len(m.device_handles) :])
    r = cache.insert(tokens, m.device_handles + fresh)
    cache.free_device(r.duplicates)
    return cache.match(tokens, touch=False).path


def test_commit_starts_the_host_copy_and_eviction_after_it_lands_drops_nothing():
    clock, cache, _ex, ctl = _setup()
    path = _insert(cache, seq(0, 4))
    assert ctl.commit(path) == 4 and ctl.writeback
    # in flight: the pages are held by the copy (protected, not evictable), never dropped dirty
    assert cache.tree.evictable_pages(DEVICE) == 0
    assert cache.evict(DEVICE, 4) == 0
    clock.t += 1.0
    ctl.pump_writeback(start_new=False)  # records the landed copy; starts nothing
    assert not ctl.writeback and path[-1].host is not None
    assert cache.evict(DEVICE, 4) == 4
    assert cache.stats.dropped_dirty_tokens[DEVICE] == 0
    assert cache.match(seq(0, 4), touch=False).host_tokens == 4 * PS
    cache.check()


def test_a_child_committed_while_its_parent_copy_is_in_flight_follows_in_a_later_round():
    clock, cache, _ex, ctl = _setup()
    assert ctl.commit(_insert(cache, seq(0, 2))) == 2
    child = _insert(cache, seq(0, 2) + seq(500, 2))
    assert ctl.commit(child) == 0  # its parent is not on host yet: prefix closure
    clock.t += 1.0
    ctl.pump_writeback()  # records the parent, and plans the child while nothing else is in flight
    assert child[-1].host is None and HOST in child[-1].incoming
    clock.t += 1.0
    ctl.pump_writeback(start_new=False)
    assert child[-1].host is not None
    assert cache.evict(DEVICE, 8) == 4 and cache.stats.dropped_dirty_tokens[DEVICE] == 0
    cache.check()


def test_commit_does_nothing_under_write_back():
    clock = Clock()
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=8 * PS,
        host_tokens=16 * PS,
        disk_tokens=0,
        page_size=PS,
        write_policy="write_back",
        eviction_demotes="none",
    )
    cache = build_cache(cfg, clock=clock)
    ex = VirtualExecutor(cache, VirtualPipes(lambda link, tokens: tokens / 1000.0), clock, PS)
    ctl = RequestController(cache, ex, Predictor(), ControllerSettings(), clock)
    assert ctl.commit(_insert(cache, seq(0, 4))) == 0 and not ctl.writeback


def test_a_node_whose_copy_is_in_flight_splits_and_both_parts_get_the_copy():
    """A request that shares the first pages of a committed node whose host copy is still in
    flight splits it (it used to stop at the pinned node and insert its own pages as duplicates,
    losing the shared prefix's device hits); the landed copy then covers both parts."""
    clock, cache, _ex, ctl = _setup(device=16, host=16)
    a = seq(0, 4)
    path = _insert(cache, a)
    assert ctl.commit(path) == 4 and HOST in path[-1].incoming
    b = seq(0, 2) + seq(700, 2)  # the same first two pages, then its own
    m = cache.match(b, touch=False)
    assert m.device_tokens == 2 * PS  # the split makes the shared part a hit
    fresh = cache.allocate_device(2)
    cache.stores[DEVICE].write(fresh, kv_for(cache, b)[2:])
    r = cache.insert(b, m.device_handles + fresh)
    assert len(r.duplicates) == 0 and r.prefix_tokens == 2 * PS
    upper, lower = cache.match(a, touch=False).path
    assert upper.num_pages == lower.num_pages == 2 and upper.pins == lower.pins == 1
    assert upper.incoming[HOST] is lower.incoming[HOST]
    cache.tree.check()  # (the host store's pages of a copy in flight are not the tree's yet)
    clock.t += 1.0
    ctl.pump_writeback(start_new=False)
    assert upper.host is not None and lower.host is not None and not upper.pins and not lower.pins
    assert HOST not in upper.incoming and HOST not in lower.incoming
    # the host copy holds each part's own bytes: evict the device and read the prompt back from host
    want = kv_for(cache, a)
    cache.lock(r.last_node)  # b's own pages were never committed: keep them out of this eviction
    assert cache.evict(DEVICE, 16) == 2 and cache.stats.dropped_dirty_tokens[DEVICE] == 0
    m = cache.match(a, touch=False)
    assert (m.device_tokens, m.host_tokens) == (2 * PS, 2 * PS)  # the shared part is b's, locked
    got = cache.stores[HOST].read(list(upper.host) + list(lower.host))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    cache.check()


def test_a_node_larger_than_a_write_batch_is_copied_whole_and_nothing_behind_it_waits():
    """At page size 1 a long prompt's node holds thousands of pages, more than a write batch: it is
    copied alone (at commit, and by the round when commit could not), never left to be dropped dirty,
    and the nodes behind it are copied in the rounds after."""
    clock, cache, ex, _ = _setup(device=16, host=32)
    ctl = RequestController(cache, ex, Predictor(), ControllerSettings(writeback_batch_pages=3), clock)
    big = _insert(cache, seq(0, 6))  # one node of 6 pages, twice the batch
    assert len(big) == 1 and big[0].num_pages == 6
    assert ctl.commit(big) == 6
    second = _insert(cache, seq(900, 5))  # committed while the first copy is in flight; left to a round
    clock.t += 1.0
    ctl.pump_writeback()
    clock.t += 1.0
    ctl.pump_writeback()
    clock.t += 1.0
    ctl.pump_writeback(start_new=False)
    assert big[0].host is not None and second[-1].host is not None
    assert cache.evict(DEVICE, 16) == 11 and cache.stats.dropped_dirty_tokens[DEVICE] == 0
    assert cache.match(seq(0, 6), touch=False).host_tokens == 6 * PS
    cache.check()
