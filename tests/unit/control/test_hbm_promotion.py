"""Speculative promotions carried on to the device (`Speculation.carry`): a hint prefetch or a
prediction that lands on host goes on host -> device into free device pages nobody needs, never
into the room kept free, never by evicting; the pages it fills are clean and evictable, and
admission takes them back."""

from __future__ import annotations

from conftest import serve
from test_hints import _controller, _disk_only
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.control.hint_desk import own_tail
from sgl_hicache.policy.hint_rules import Hint
from sgl_hicache.policy.promotion import device_room_pages
from sgl_hicache.tiers.base import DEVICE, HOST


def _land(ctl, ex) -> None:
    """Let every speculative job in flight land, and the controller apply it (as a step does)."""
    while ctl.predicted:
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()


def test_device_room_keeps_the_reserve_and_the_headroom_free():
    assert device_room_pages(free_pages=50, capacity_pages=100, reserved_pages=0, headroom=0.1) == 40
    assert device_room_pages(free_pages=50, capacity_pages=100, reserved_pages=30, headroom=0.1) == 10
    assert device_room_pages(free_pages=5, capacity_pages=100, reserved_pages=0, headroom=0.1) == 0
    assert device_room_pages(free_pages=100, capacity_pages=100, reserved_pages=0, headroom=1.0) == 0
    assert device_room_pages(free_pages=0, capacity_pages=0, reserved_pages=0, headroom=0.1) == 0


def test_a_hint_prefetch_lands_on_the_device_when_it_has_room(tmp_path):
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    tokens = seq(0, 3)
    node = _disk_only(cache, tokens)  # the device is empty: 8 free pages, 1 kept free
    ctl.hints.apply(Hint("prefetch", tuple(tokens)), tokens)
    _land(ctl, ex)
    m = cache.match(tokens, touch=False)
    assert node.device is not None and node.host is not None  # on the device, its host copy kept
    assert m.device_tokens == 3 * PS  # the request that continues it finds a device hit
    assert ctl.speculation.carried_tokens == 3 * PS and cache.stats.promoted_tokens[DEVICE] >= 3 * PS
    cache.check()


def test_a_carry_in_flight_counts_its_device_pages_as_incoming(tmp_path):
    # the copy's destination pages are in no node until it lands: the pool's accounting (SGLang's idle
    # check: free + evictable + protected == the pool) must still find them
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    tokens = seq(0, 3)
    _disk_only(cache, tokens)
    ctl.hints.apply(Hint("prefetch", tuple(tokens)), tokens)
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()  # on host: the carry to the device starts
    dev = cache.stores[DEVICE]
    assert ctl.speculation.carried_tokens == 3 * PS and cache.tx.incoming_pages[DEVICE] == 3
    assert dev.free_pages + cache.tree.pages[DEVICE] + cache.tx.incoming_pages[DEVICE] == dev.capacity_pages
    _land(ctl, ex)
    assert cache.tx.incoming_pages[DEVICE] == 0 and cache.tree.pages[DEVICE] == 3
    assert all(n == 0 for n in cache.tx.incoming_pages.values())
    cache.check()


def test_a_prefetch_on_host_already_goes_straight_to_the_device(tmp_path):
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    tokens = seq(0, 2)
    serve(cache, tokens)
    ctl.pump_writeback()
    _land(ctl, ex)
    ex.finish_all(list(ctl.writeback))
    ctl.pump_writeback(start_new=False)
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    node = cache.match(tokens, touch=False).last_node
    assert node.device is None and node.host is not None
    ctl.hints.apply(Hint("prefetch", tuple(tokens)), tokens)
    _land(ctl, ex)
    assert node.device is not None
    cache.check()


def test_no_room_on_the_device_no_promotion_and_nothing_evicted(tmp_path):
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    tokens = seq(0, 3)
    node = _disk_only(cache, tokens)
    others = [seq(1000 * (i + 1), 2) for i in range(4)]  # 8 device pages of other prompts, evictable
    for o in others:
        serve(cache, o)
    held = {id(cache.match(o, touch=False).last_node) for o in others}
    assert cache.stores[DEVICE].free_pages == 0
    ctl.hints.apply(Hint("prefetch", tuple(tokens)), tokens)
    _land(ctl, ex)
    assert node.host is not None and node.device is None  # up to host only
    assert all(cache.match(o, touch=False).last_node.device is not None for o in others)  # none displaced
    assert len(held) == 4 and ctl.speculation.carried_tokens == 0
    cache.check()


def test_promoted_pages_are_clean_evictable_and_admission_takes_them_back(tmp_path):
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    tokens = seq(0, 3)
    node = _disk_only(cache, tokens)
    ctl.hints.apply(Hint("prefetch", tuple(tokens)), tokens)
    _land(ctl, ex)
    assert node.device is not None and node.lock_ref == 0 and node.pins == 0  # evictable
    host_handles = list(node.host)
    demoted = cache.stats.demoted_tokens[DEVICE]
    # a request needs the whole device: admission evicts the promoted pages (a drop: they are clean)
    pages = cache.allocate_device(cache.stores[DEVICE].capacity_pages)
    assert pages is not None and len(pages) == cache.stores[DEVICE].capacity_pages
    assert node.device is None and list(node.host) == host_handles  # the host copy stays
    assert cache.stats.demoted_tokens[DEVICE] == demoted  # nothing copied back down
    cache.free_device(pages)
    cache.check()


def test_an_ended_conversation_spares_the_prefix_others_share(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    system = seq(0, 1)
    a, b = system + seq(100, 2), system + seq(200, 2)
    serve(cache, a)
    serve(cache, b)
    path = cache.match(a, touch=False).path
    assert own_tail(path) == path[1:]  # the shared system prompt is not the conversation's own
    clock.t = 20.0
    ctl.hints.apply(Hint("demote", tuple(a)), a)
    shared = path[0]
    assert shared.last_access > 0 and path[-1].last_access == 0.0
    assert HOST in cache.stores
    cache.check()


def test_the_room_the_running_requests_may_still_decode_stays_free(tmp_path):
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    tokens = seq(0, 3)
    node = _disk_only(cache, tokens)
    ctl.speculation.device_reserve = lambda: 5  # 8 free pages: 5 reserved, 1 headroom, 2 left for 3
    ctl.hints.apply(Hint("prefetch", tuple(tokens)), tokens)
    _land(ctl, ex)
    m = cache.match(tokens, touch=False)
    assert node.host is not None and m.device_tokens < 3 * PS  # the head only, or nothing
    assert cache.stores[DEVICE].free_pages >= 5 + 1
    cache.check()


def test_the_server_reserves_what_its_running_requests_may_still_decode():
    from types import SimpleNamespace as NS

    from sgl_hicache.sglang.scheduler_hooks import running_reserve_tokens

    def req(max_new: int, out: int, ignore_eos: bool = False) -> NS:
        return NS(sampling_params=NS(max_new_tokens=max_new, ignore_eos=ignore_eos), output_ids=[0] * out)

    running = [req(100, 20), req(10_000, 0), req(50, 10, ignore_eos=True)]
    scheduler = NS(running_batch=NS(reqs=running), new_token_ratio=0.5)
    # 80 x 0.5 + min(10,000, 4,096) x 0.5 + 40 x 1 (ignore_eos: no early end expected)
    assert running_reserve_tokens(scheduler, clip_max_new_tokens=4096) == 2128
    assert running_reserve_tokens(NS(running_batch=None), clip_max_new_tokens=4096) == 0


def test_a_prefetched_prefix_is_held_as_long_as_prefetches_come_early(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    desk = ctl.hints
    assert desk.prefetch_hold_s() == desk.limits.prefetch_retain_s  # nothing measured yet
    for i in range(10):  # each prefetched 30 s before a request uses it
        tokens = seq(1000 * (i + 1), 1)
        serve(cache, tokens)
        clock.t += 1.0
        desk.apply(Hint("prefetch", tuple(tokens)), tokens)
        clock.t += 30.0
        serve(cache, tokens)
        ctl.pump_writeback(start_new=False)
        clock.t += 1.0
    assert 30.0 <= desk.prefetch_hold_s() <= 31.0
    assert desk.summary()["prefetch_hold_s"] == desk.prefetch_hold_s()
    cache.check()
