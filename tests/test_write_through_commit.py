"""Write-through at commit (issue 23): a request's committed device pages get their host copies
started at commit, not at the next step's pump (which in the server runs after the next admission
has evicted them), so an eviction right after finds them clean. Behaviour, not figures."""

from __future__ import annotations

from conftest import SMALL_LAYOUT, kv_for
from sgl_hicache.assemble import build_cache
from sgl_hicache.config import CacheConfig
from sgl_hicache.controller import ControllerSettings, RequestController
from sgl_hicache.policy.predictor import Predictor
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes
from test_oracle_reuse import PS, Clock, seq


def _setup(device=8, host=16):
    clock = Clock()
    cfg = CacheConfig(SMALL_LAYOUT, device_tokens=device * PS, host_tokens=host * PS, disk_tokens=0, page_size=PS,
                      write_policy="write_through", eviction_demotes="none")
    cache = build_cache(cfg, clock=clock)
    ex = VirtualExecutor(cache, VirtualPipes(lambda link, tokens: tokens / 1000.0), clock, PS)
    return clock, cache, ex, RequestController(cache, ex, Predictor(), ControllerSettings(), clock)


def _insert(cache, tokens):
    m = cache.match(tokens, touch=False)
    fresh = cache.allocate_device(len(tokens) // PS - len(m.device_handles))
    cache.stores[DEVICE].write(fresh, kv_for(cache, tokens)[len(m.device_handles):])
    r = cache.insert(tokens, m.device_handles + fresh)
    cache.free_device(r.duplicates)
    return cache.match(tokens, touch=False).path


def test_commit_starts_the_host_copy_and_eviction_after_it_lands_drops_nothing():
    clock, cache, ex, ctl = _setup()
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
    clock, cache, ex, ctl = _setup()
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
    cfg = CacheConfig(SMALL_LAYOUT, device_tokens=8 * PS, host_tokens=16 * PS, disk_tokens=0, page_size=PS,
                      write_policy="write_back", eviction_demotes="none")
    cache = build_cache(cfg, clock=clock)
    ex = VirtualExecutor(cache, VirtualPipes(lambda link, tokens: tokens / 1000.0), clock, PS)
    ctl = RequestController(cache, ex, Predictor(), ControllerSettings(), clock)
    assert ctl.commit(_insert(cache, seq(0, 4))) == 0 and not ctl.writeback
