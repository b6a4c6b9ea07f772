"""Demand preempts prefetch (long agentic prompts against a small device tier): a queue prefetch never delays a demand
load on a link, never stalls the head of the queue with the locks it holds, and starts only while the
host tier has room to spare. Behaviour, not figures (those are in docs/results.md)."""

from __future__ import annotations

from conftest import make_cache, serve
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.control.lifecycle import ControllerSettings, RequestController
from sgl_hicache.policy.guard import PromotionGuard
from sgl_hicache.policy.predictor import Predictor
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes


def test_a_demand_copy_goes_ahead_of_queued_prefetches():
    pipes = VirtualPipes(lambda link, tokens: float(tokens))
    pushed = []
    pipes.on_preempt = lambda pipe, start, d, backup=False: pushed.append((pipe, start, d))
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
    _ex, ctl = _controller(cache, clock)
    shared, tail = seq(0, 4), seq(1000, 2)
    _disk_only(cache, shared + tail)
    serve(cache, shared)  # the shared prefix back on the device, the tail on disk only
    before = cache.tree.evictable_pages(DEVICE)
    ticket, m = ctl.arrive(shared + tail)
    assert m.device_tokens == len(shared) and m.disk_tokens == len(tail)
    assert ctl.prefetch(ticket, m)
    assert cache.tree.evictable_pages(DEVICE) == before - 4  # the prefetch locks the device prefix too
    assert ctl.yield_to_demand([ticket], short_pages=4) == 1 and ticket.job is None
    assert cache.tree.evictable_pages(DEVICE) == before and ctl.preempted_prefetches == 1
    cache.check()


def _three_queued_prefetches(tmp_path):
    """Three queued requests with prefetches: two whose device-resident prefixes (2 pages each) the
    prefetch locks, one whose path is on disk only (it locks no device page)."""
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    cache.clock = clock
    _ex, ctl = _controller(cache, clock)
    a, b, c = seq(0, 2), seq(2000, 2), seq(4000, 3)
    _disk_only(cache, a + seq(1000, 2))
    _disk_only(cache, b + seq(3000, 2))
    _disk_only(cache, c)
    serve(cache, a)
    serve(cache, b)
    tickets = []
    for tokens in (a + seq(1000, 2), b + seq(3000, 2), c):
        ticket, m = ctl.arrive(tokens)
        assert ctl.prefetch(ticket, m)
        tickets.append(ticket)
    return cache, ctl, tickets


def test_yield_to_demand_ends_only_the_jobs_holding_what_the_head_lacks(tmp_path):
    # the 480b regression: ending every queued prefetch whenever the head did not fit gave back what
    # prefetch gained; only the jobs whose locks keep the head out may end, the back of the queue first
    cache, ctl, (ta, tb, tc) = _three_queued_prefetches(tmp_path)
    before = cache.tree.evictable_pages(DEVICE)
    assert ctl.yield_plan([ta, tb, tc], 2) == [tb]  # tc (back of the queue) holds no device page
    assert ctl.yield_to_demand([ta, tb, tc], short_pages=2) == 1
    assert tb.job is None and ta.job is not None and tc.job is not None
    assert cache.tree.evictable_pages(DEVICE) == before + 2 and ctl.preempted_prefetches == 1
    for t in (ta, tc):
        ctl.drop(t)
    cache.check()


def test_yield_to_demand_ends_nothing_when_ending_all_would_not_make_room(tmp_path):
    cache, ctl, tickets = _three_queued_prefetches(tmp_path)
    assert ctl.yield_plan(tickets, 4) == [tickets[1], tickets[0]]  # both device holders cover 4 pages
    assert ctl.yield_to_demand(tickets, short_pages=5) == 0  # they hold 4: the head would not fit anyway
    assert ctl.yield_to_demand(tickets, short_pages=0) == 0  # the head fits: nothing to yield
    assert all(t.job is not None for t in tickets) and ctl.preempted_prefetches == 0
    for t in tickets:
        ctl.drop(t)
    cache.check()


def test_yield_to_demand_ends_together_the_jobs_sharing_a_locked_prefix(tmp_path):
    # queued agent steps share their tool documentation: no one job frees it, both together do
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    cache.clock = clock
    _ex, ctl = _controller(cache, clock)
    shared = seq(0, 2)
    _disk_only(cache, shared + seq(1000, 2))
    _disk_only(cache, shared + seq(2000, 2))
    serve(cache, shared)
    tickets = []
    for tail in (seq(1000, 2), seq(2000, 2)):
        ticket, m = ctl.arrive(shared + tail)
        assert ctl.prefetch(ticket, m)
        tickets.append(ticket)
    before = cache.tree.evictable_pages(DEVICE)
    assert ctl.yield_to_demand(tickets, short_pages=2) == 2
    assert cache.tree.evictable_pages(DEVICE) == before + 2
    cache.check()


def test_a_demand_load_expedites_a_queued_prefetch_of_its_path(tmp_path):
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    cache.clock = clock
    _ex, ctl = _controller(cache, clock)
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
    # a request behind the head may not: its path would push out what the ones ahead need (agentic
    # trace: 1.03x `demote` TTFT with it, 0.98x without)
    assert not guard.prefetch_fits(held=0, need=6, capacity=8, head=False)
    assert guard.prefetch_fits(held=0, need=4, capacity=8, head=False)
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    _ex, ctl = _controller(cache, clock)
    long, short = seq(0, 6), seq(9000, 2)
    _disk_only(cache, long)
    _disk_only(cache, short)
    ticket, m = ctl.arrive(long)
    assert not ctl.prefetch(ticket, m, head=False) and ctl.prefetch_skipped == 1
    assert ctl.prefetch(ticket, m) and ctl.prefetch_skipped == 1  # 6 of 8 host pages, but no other prefetch holds any
    ctl.drop(ticket)
    cache.check()


def test_the_server_sizes_a_refused_request_shortfall_as_sglang_admits_it():
    # the SGLang hook's input to the controller's yield: extend input + clipped output + overhead + a page,
    # less what the adder can still give
    from types import SimpleNamespace

    from sgl_hicache.sglang.scheduler_hooks import demand_shortfall_tokens

    req = SimpleNamespace(
        full_untruncated_fill_ids=list(range(1000)),
        prefix_len=200,
        output_ids=[1, 2],
        sampling_params=SimpleNamespace(max_new_tokens=100),
    )
    adder = SimpleNamespace(rem_total_tokens=500, per_req_token_overhead=0, page_size=16)
    assert demand_shortfall_tokens(adder, req, clip_max_new_tokens=4096) == 800 + 98 + 16 - 500
    assert demand_shortfall_tokens(adder, req, clip_max_new_tokens=50) == 800 + 50 + 16 - 500
    adder.rem_total_tokens = 10_000
    assert demand_shortfall_tokens(adder, req, clip_max_new_tokens=4096) < 0  # it fits: nothing to yield


def test_a_demand_read_behind_a_busy_disk_is_recomputed_when_that_is_sooner(tmp_path):
    # 0.98 GB/s regime map cell: a disk busy with write-back made a 1,536-token read block the step for
    # 42 s where recomputing took 0.07 s; every policy then sat 2-3x slower than it needed
    clock = Clock()
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)  # 1,000 tokens a second on every link
    tokens = seq(0, 2) + seq(1000, 2)
    serve(cache, seq(0, 2))
    _disk_only(cache, tokens)
    serve(cache, seq(0, 2))  # the first 2 pages back on the device, the last 2 on disk only
    m = cache.match(tokens, touch=False)
    assert m.disk_tokens == 2 * PS
    assert ctl.read_or_recompute(m, recompute_s=1.0) is m  # an idle disk reads 8 tokens in 8 ms
    ex.pipes.schedule("host->disk", 5000, clock())  # 5 s of write-back queued on the disk
    cut = ctl.read_or_recompute(m, recompute_s=1.0)
    assert cut.tokens == m.device_tokens + m.host_tokens and not cut.disk_tokens
    assert ctl.disk_reads_recomputed == 2 * PS
    assert ctl.read_or_recompute(m, recompute_s=10.0) is m  # recomputing would take longer: read it
