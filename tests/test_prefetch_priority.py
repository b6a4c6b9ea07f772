"""Demand preempts prefetch (issue 13's agentic regression): a queue prefetch never delays a demand
load on a link, never stalls the head of the queue with the locks it holds, and starts only while the
host tier has room to spare. Behaviour, not figures (those are in docs/results.md)."""

from __future__ import annotations

from conftest import make_cache, serve
from sgl_hicache.controller import ControllerSettings, RequestController
from sgl_hicache.policy.guard import PromotionGuard
from sgl_hicache.policy.predictor import Predictor
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes
from test_oracle_reuse import PS, Clock, seq


def test_a_demand_copy_goes_ahead_of_queued_prefetches():
    pipes = VirtualPipes(lambda link, tokens: float(tokens))
    pushed = []
    pipes.on_preempt = lambda pipe, start, d: pushed.append((pipe, start, d))
    assert pipes.schedule_low("disk->host", 10, 0.0) == 10.0
    assert pipes.schedule("disk->host", 5, 0.0) == 5.0  # not behind the prefetch (15 in a FIFO)
    assert pushed == [("disk", 0.0, 5.0)]  # the prefetch learns it lands 5 s later
    assert pipes.schedule_low("disk->host", 1, 0.0) == 16.0  # new low work goes behind everything
    assert pipes.schedule("host->disk", 2, 0.0) == 7.0  # reads and writes share the disk
    assert pipes.schedule("host->device", 3, 0.0) == 3.0  # other links are their own pipes


def _disk_only(cache, tokens):
    """Serve `tokens`, then push them down to disk only."""
    serve(cache, tokens)
    node = cache.match(tokens, touch=False).last_node
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    assert node.disk is not None and node.host is None and node.device is None
    return node


def _controller(cache, clock, seconds=lambda link, tokens: tokens / 1000.0):
    ex = VirtualExecutor(cache, VirtualPipes(seconds), clock, PS)
    return ex, RequestController(cache, ex, Predictor(), ControllerSettings(), clock)


def test_yield_to_demand_unlocks_the_device_pages_a_prefetch_held(tmp_path):
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    shared, tail = seq(0, 4), seq(1000, 2)
    _disk_only(cache, shared + tail)
    serve(cache, shared)  # the shared prefix back on the device, the tail on disk only
    before = cache.tree.evictable_pages(DEVICE)
    ticket, m = ctl.arrive(shared + tail)
    assert m.device_tokens == len(shared) and m.disk_tokens == len(tail)
    assert ctl.prefetch(ticket, m)
    assert cache.tree.evictable_pages(DEVICE) == before - 4  # the prefetch locks the device prefix too
    assert ctl.yield_to_demand([ticket]) == 1 and ticket.job is None
    assert cache.tree.evictable_pages(DEVICE) == before and ctl.preempted_prefetches == 1
    cache.check()


def test_a_demand_load_expedites_a_queued_prefetch_of_its_path(tmp_path):
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    tokens = seq(0, 3)
    longer = tokens + seq(5000, 2)
    _disk_only(cache, tokens)
    _disk_only(cache, longer)  # two nodes: the shared 3 pages, then 2 more
    queued, m = ctl.arrive(longer)  # a request further back: its prefetch brings the shared 3 pages too
    assert ctl.prefetch(queued, m)
    head, _ = ctl.arrive(tokens)
    m, cost = ctl.load(tokens, cache.match(tokens, touch=False))  # the head is scheduled first
    # loaded in full (not stopped at the node the prefetch has in flight), and only its own 3 pages
    # were waited for, at demand priority
    assert m.device_tokens == len(tokens)
    assert 0 < cost.blocking <= 3 * PS / 1000.0 + 1e-9
    ctl.drop(queued)
    ctl.drop(head)
    cache.check()


def test_prefetch_starts_only_while_host_has_room_to_spare(tmp_path):
    guard = PromotionGuard(prefetch_share=0.5)
    assert guard.prefetch_fits(held=2, need=2, capacity=8)
    assert not guard.prefetch_fits(held=2, need=3, capacity=8)
    assert guard.prefetch_fits(held=0, need=6, capacity=8)  # a lone prefetch crowds no other
    assert not guard.prefetch_fits(held=0, need=9, capacity=8)
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    long, short = seq(0, 6), seq(9000, 2)
    _disk_only(cache, long)
    _disk_only(cache, short)
    ticket, m = ctl.arrive(long)
    assert ctl.prefetch(ticket, m) and ctl.prefetch_skipped == 0  # 6 of 8 host pages, but no other prefetch holds any
    ctl.drop(ticket)
    cache.check()
