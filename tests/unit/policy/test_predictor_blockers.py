"""Each part of the prediction path that could stop promotion on its own, one test each
(learned half-life, windowed per-trigger guard, room made over lower-ranked host pages only, fresh
promoted pages, the head of an oversized node, a budget from lead time x link rate, speculative
copies charged and ordered), and the generated shapes where prediction can pay."""

from __future__ import annotations

import pytest
from conftest import make_cache, serve
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.control.lifecycle import ControllerSettings, RequestController
from sgl_hicache.policy.guard import PromotionGuard, QueueDelay
from sgl_hicache.policy.predictor import Prediction, Predictor, TreeWalkPredictor
from sgl_hicache.replay.shapes import branch, chain, role_of
from sgl_hicache.tiers.base import DEVICE, DISK, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes
from sgl_hicache.tree.traffic import HalfLife


# ---- the half-life ------------------------------------------------------------------------------
def test_half_life_follows_the_long_gaps_not_the_mean():
    hl = HalfLife(initial=60.0, factor=2.0, quantile=0.9, min_samples=8, every=1)
    for _ in range(7):
        hl.observe(4.0)
    assert hl.value == 60.0  # too few gaps yet
    for g in [4.0] * 20 + [300.0] * 5:  # mostly turn gaps, some returns after a 5-minute pause
        hl.observe(g)
    assert hl.value == pytest.approx(600.0)  # 2 x the 90th percentile: the returns, not the 4 s gaps
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        hl.observe(bad)
    assert hl.samples == 32


def test_half_life_reads_the_quantile_of_the_last_window_of_gaps_only():
    import random

    rng = random.Random(7)
    hl = HalfLife(initial=60.0, factor=1.0, quantile=0.75, window=16, min_samples=1, every=1, ceiling=1e9)
    seen = []
    for i in range(400):
        # repeats and a drift upward: old small gaps must leave the window exactly as they entered
        gap = float(rng.choice([1, 2, 2, 3, 5, 8]) * (1 + i // 100))
        hl.observe(gap)
        seen.append(gap)
        window = sorted(seen[-16:])
        assert hl.value == window[min(15, int(0.75 * len(window)))], i


def test_cache_learns_the_half_life_from_returns_to_a_node_with_children():
    cache = make_cache(None, device=64)
    clock = Clock(0.0)
    cache.clock = clock
    cache.tree.half_life = HalfLife(initial=60.0, min_samples=1, every=1)
    for i in range(6):  # a conversation's turns, 2 s apart: each match ends at a tip, no sample
        clock.t = 2.0 * i
        serve(cache, seq(0, 1 + i))
    assert cache.tree.half_life.samples == 0
    clock.t = 500.0  # a probe on the head of the conversation: it ends where the walk starts
    serve(cache, seq(0, 1) + seq(9000, 1))
    assert cache.tree.half_life.samples == 1 and cache.tree.half_life.value == pytest.approx(2 * (500.0 - 10.0))


# ---- the guard ----------------------------------------------------------------------------------
def test_guard_is_windowed_misses_age_out():
    guard = PromotionGuard(min_precision=0.5, min_resolved_tokens=100, window_tokens=1000, probe_every=1000)
    assert not guard.allow(0, 5000)  # a long run of misses: stopped
    # the pattern comes back (the probes' hits): cumulative precision is 1,200 / 6,200, but the
    # window (the last >= 1,000 resolved tokens) holds hits only
    assert guard.allow(1200, 5000)
    g2 = PromotionGuard(min_precision=0.5, min_resolved_tokens=100, window_tokens=1000, probe_every=1000)
    assert g2.allow(5000, 0)  # a long run of hits
    assert g2.allow(5000, 600)
    # cumulative precision is still 0.75, but the last 1,100 resolved tokens were all misses
    assert not g2.allow(5000, 1700)


def test_guard_judges_each_trigger_alone():
    guard = PromotionGuard(min_precision=0.5, min_resolved_tokens=100, probe_every=1000)
    assert not guard.allow(0, 500, trigger="tree_walk/5+")
    assert guard.allow(0, 0, trigger="tree_walk/1")  # the shared prompt's misses stop only its own class
    assert guard.allow(400, 100, trigger="tree_walk/1")
    assert not guard.allow(0, 500, trigger="tree_walk/5+")


# ---- the controller: room, freshness, heads, budget ----------------------------------------------
class _Fixed(Predictor):
    """Predicts the nodes it is given (a fake: the test decides what is predicted)."""

    name = "fixed"
    may_evict = True

    def __init__(self, preds):
        self.preds = preds

    def predict(self, start, now, budget_tokens=None):
        return list(self.preds)


def _disk_only(cache, tokens):
    serve(cache, tokens)
    node = cache.match(tokens, touch=False).last_node
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    assert node.disk is not None and node.host is None and node.device is None
    return node


def _controller(cache, clock, seconds=lambda link, tokens: tokens / 1000.0, **settings):
    ex = VirtualExecutor(cache, VirtualPipes(seconds), clock, PS)
    settings.setdefault("device_headroom", 1.0)  # the disk -> host step alone (the device: test_hbm_promotion.py)
    ctl = RequestController(cache, ex, Predictor(), ControllerSettings(**settings), clock)
    ctl.speculation.guard = PromotionGuard(shadow_bets=0)  # these tests are about real copies: no shadow phase
    return ex, ctl


def test_promotion_evicts_only_host_pages_ranked_below_and_is_fresh(tmp_path):
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=4, host=4, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    target = _disk_only(cache, seq(5000, 2))
    clock.t = 110.0
    old = seq(0, 2)
    serve(cache, old)  # on the device and (write-through) host, last used at 110
    clock.t = 120.0
    serve(cache, seq(100, 2))
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    assert cache.stores[HOST].free_pages == 0  # the host is full of the two earlier prompts
    old_node = cache.match(old, touch=False).last_node
    assert ctl.speculation.predictor.predict(old_node, 0.0) == []  # (the controller's default predictor: none)
    ctl.speculation.predictor = _Fixed([Prediction(target, 1.0)])
    ctl.arrive(seq(7000, 1))
    assert ctl.predicted == []  # the host pages have no copy below: a guess never drops them
    for n in list(cache.nodes_in(HOST)):
        assert cache.copy_now(n, DISK, kind="backup", may_evict=True)  # now they are clean
    clock.t = 130.0
    ctl.arrive(seq(7000, 1))
    assert len(ctl.predicted) == 1  # it made room: the free-pages-only rule would have refused
    assert old_node.host is None  # the least recently used host page went, for a fresher one
    assert target.last_access == 130.0  # the promoted page is as fresh as the prediction
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert target.host is not None
    cache.check()


def test_promotion_never_evicts_a_page_ranked_above(tmp_path):
    rank: dict[int, int] = {}
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=4, host=4, disk=64, priority=lambda n: (rank.get(n.id, 1), n.last_access, n.id))
    cache.clock = clock
    _ex, ctl = _controller(cache, clock)
    target = _disk_only(cache, seq(5000, 2))
    rank[target.id] = 0  # the eviction order puts it below every host page, fresh or not
    serve(cache, seq(0, 2))
    serve(cache, seq(100, 2))
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    assert cache.stores[HOST].free_pages == 0
    held = {n.id for n in cache.nodes_in(HOST)}
    clock.t = 130.0
    ctl.speculation.predictor = _Fixed([Prediction(target, 1.0)])
    ctl.arrive(seq(7000, 1))
    assert ctl.predicted == [] and target.host is None
    assert {n.id for n in cache.nodes_in(HOST)} == held  # nothing pushed out for it
    cache.check()


def test_the_head_of_an_oversized_node_is_promoted(tmp_path):
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    big = _disk_only(cache, seq(0, 6))
    ctl.speculation.predictor = _Fixed([Prediction(big, 1.0, pages=2)])
    ctl.arrive(seq(9000, 1))
    assert len(ctl.predicted) == 1
    head = ctl.predicted[0].stages[-1].node
    assert head.num_pages == 2 and head.children and next(iter(head.children.values())).num_pages == 4
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert head.host is not None and next(iter(head.children.values())).host is None
    cache.check()


def test_tree_walk_takes_the_head_of_a_node_larger_than_the_budget():
    cache = make_cache(None, device=32)
    clock = Clock()
    cache.clock = clock
    for p in (seq(0, 1), seq(0, 1) + seq(100, 10)):
        serve(cache, p)
    start = cache.match(seq(0, 1), touch=False).last_node
    out = TreeWalkPredictor(PS, 3 * PS, needs_promotion=lambda n: True).predict(start, clock())
    assert [(pr.node.num_pages, pr.pages) for pr in out] == [(10, 3)]  # skipped before: nothing promoted


def test_budget_is_lead_time_times_the_link_rate(tmp_path):
    clock = Clock()
    cache = make_cache(tmp_path)
    _, ctl = _controller(cache, clock, seconds=lambda link, tokens: tokens / 500.0, predictor_lead_s=2.0)
    assert ctl.speculation.prediction_budget() == 1000
    _, ctl = _controller(cache, clock, seconds=lambda link, tokens: tokens / 2000.0, predictor_lead_s=0.5)
    assert ctl.speculation.prediction_budget() == 1000
    _, ctl = _controller(cache, clock, predictor_lead_s=0.0)
    assert ctl.speculation.prediction_budget() is None  # the predictor's own budget


# ---- speculation charged and ordered -------------------------------------------------------------
def test_speculative_copies_queue_behind_demand_and_ahead_of_write_back():
    pipes = VirtualPipes(lambda link, tokens: float(tokens))
    pushed = []
    pipes.on_preempt = lambda pipe, start, d, backup=False: pushed.append((pipe, start, d, backup))
    assert pipes.schedule("disk->host", 4, 0.0) == 4.0  # a demand read
    assert pipes.schedule("host->disk", 10, 0.0, backup=True) == 14.0  # write-back behind it
    assert pipes.schedule_speculative("disk->host", 3, 0.0) == 7.0  # behind the demand, ahead of write-back
    assert pushed == [("disk", 4.0, 3.0, True)]  # the write-back learns it lands 3 s later (17)
    assert pipes.schedule_speculative("disk->host", 2, 0.0) == 9.0  # FIFO among speculative copies
    assert pipes.schedule("disk->host", 1, 0.0) == 20.0  # it paid: later demand waits for all of it


def test_executor_moves_write_back_behind_a_speculative_copy(tmp_path):
    clock = Clock(0.0)
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, _ctl = _controller(cache, clock, seconds=lambda link, tokens: float(tokens))
    target = _disk_only(cache, seq(5000, 2))
    serve(cache, seq(0, 2))
    ops = cache.plan_writeback(HOST, "disk", 8, 8) or cache.plan_writeback(DEVICE, HOST, 8, 8)
    assert ops
    ex.submit_ops(ops)
    before = {id(op): ex.finish[id(op)] for op in ops}
    job = cache.plan_promotion(target.path_from_root(), kind="predict", target=HOST, evict=False)
    ex.submit_job(job, speculative=True)
    disk_ops = [op for op in ops if ex.pipes.pipe(op.link) == "disk"]
    spec = job.ops()[0]
    if disk_ops:  # write-back on the disk pipe is pushed back by the speculative read's duration
        assert all(ex.finish[id(op)] == before[id(op)] + 8.0 for op in disk_ops)
        assert ex.finish[id(spec)] == 8.0
    ex.finish_all(job.ops() + ops)
    cache.advance(job)
    cache.release(job)
    for op in ops:
        cache.complete(op)
    cache.check()


# ---- the shapes, and prediction paying on them ---------------------------------------------------
def test_shapes_are_deterministic_and_tagged():
    a, b = chain(sessions=3, seed=1), chain(sessions=3, seed=1)
    assert [(r.request_id, r.arrival_s, list(r.input_ids)) for r in a] == [
        (r.request_id, r.arrival_s, list(r.input_ids)) for r in b
    ]
    roles = [role_of(r) for r in a]
    assert roles.count("probe") == 3 and roles.count("cont") == 3
    by = {r.request_id: r for r in a}
    probe, cont = by["chain0/probe"], by["chain0/cont"]
    assert cont.arrival_s - probe.arrival_s == pytest.approx(2.0)
    assert list(cont.input_ids[: 1024 + 256]) == list(probe.input_ids[: 1024 + 256])  # the probe is its head
    last = by["chain0/turn3"]
    assert list(cont.input_ids[: len(last.input_ids)]) == list(last.input_ids)  # the continuation needs it all
    br = branch(sessions=2, siblings=3)
    assert sum(role_of(r).startswith("revisit") for r in br) == 6
    with pytest.raises(ValueError, match="shorter than one page"):
        chain(turn_tokens=10)


@pytest.mark.parametrize("shape", ["chain", "branch"])
def test_predict_gets_the_continuation_up_before_it_arrives(shape):
    """On a shape where the request that needs a spilled path is announced `lead_s` ahead, `predict`
    serves it sooner than `prefetch` (virtual time: exact), with the promoted pages used."""
    from sgl_hicache.sim.presets import get_hardware, get_model
    from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig

    reqs = (
        chain(sessions=12, turn_tokens=2048)
        if shape == "chain"
        else branch(sessions=12, doc_tokens=2048, branch_tokens=1024)
    )
    target = "cont" if shape == "chain" else "revisit"
    arrival = {r.arrival_s: role_of(r) for r in reqs}
    out = {}
    for policy in ("prefetch", "predict"):
        cfg = EngineConfig(
            policy=policy,
            model=get_model("llama3-8b"),
            hardware=get_hardware("h200"),
            device_tokens=16_384,
            host_tokens=32_768,
            disk_tokens=1_000_000,
            concurrency=None,
            byte_mode="metadata",
        )
        eng = EmbeddedEngine(cfg)
        eng.run(reqs)
        eng.cache.check()
        ttft = [t for a, t in zip(eng.records.arrival_s, eng.records.ttft_s) if arrival[a].startswith(target)]
        snap = eng.cache.snapshot()
        out[policy] = (sum(ttft) / len(ttft), snap["prefetch"]["predict"], sum(snap["hit_tokens"].values()))
        eng.close()
    assert out["predict"][0] < 0.9 * out["prefetch"][0]
    # nothing lost for it: a disk read of a node a prediction is bringing up waits for that copy
    # (recomputing it instead cost the branch shape 10k hit tokens)
    assert out["predict"][2] >= out["prefetch"][2]
    pred = out["predict"][1]
    assert pred["used_tokens"] >= 0.8 * pred["promoted_tokens"] > 0


def test_a_trigger_is_charged_once_for_each_page_it_copies(tmp_path):
    """Two picks in one call, the second below the first: the second job waits on the first's copy
    of the parent and must not charge it again (a double count made the guard refuse a walk whose
    every page was used)."""
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    serve(cache, seq(0, 2))  # two nodes: the parent, then the child below it
    child = _disk_only(cache, seq(0, 2) + seq(100, 2))
    parent = child.parent
    assert parent.disk is not None and parent.host is None
    ctl.speculation.predictor = _Fixed([Prediction(parent, 1.0), Prediction(child, 1.0)])
    ctl.arrive(seq(9000, 1))
    assert len(ctl.predicted) == 2
    trigger = ctl.speculation.trigger_of(cache.match(seq(9000, 1), touch=False).last_node)
    assert ctl.speculation.planned[trigger] == (parent.num_pages + child.num_pages) * PS
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert child.host is not None and child.prefetch_trigger == trigger
    cache.check()


def _own_path_and_child(tmp_path):
    """A disk-only parent (the arriving request's own match) with a disk-only child below it."""
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    serve(cache, seq(0, 2))
    child = _disk_only(cache, seq(0, 2) + seq(100, 2))
    assert child.parent.disk is not None and child.parent.host is None
    ctl.speculation.predictor = _Fixed([Prediction(child, 1.0)])
    return cache, ex, ctl, child


def test_the_guard_is_charged_for_the_arriving_requests_own_path_a_prediction_brings(tmp_path):
    """A pick below a disk-only match brings the request's own path along (prefix closure): the
    trigger is charged for it too, so a request that never uses it (evicted before it is
    scheduled, far back in a long queue) counts against the trigger."""
    cache, ex, ctl, child = _own_path_and_child(tmp_path)
    arriving = seq(0, 2) + seq(7000, 1)
    ctl.arrive(arriving)
    trigger = ctl.speculation.trigger_of(child.parent)
    assert ctl.speculation.planned[trigger] == (child.parent.num_pages + child.num_pages) * PS
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert child.parent.prefetch_trigger == trigger and child.prefetch_trigger == trigger
    cache.check()


def test_a_probe_never_brings_more_than_a_probe_own_path_included(tmp_path):
    cache, _ex, ctl, _child = _own_path_and_child(tmp_path)
    ctl.speculation.guard.admit = lambda used, wasted, trigger=None: PS  # the guard allows a one-page probe
    ctl.arrive(seq(0, 2) + seq(7000, 1))  # its own disk path alone is two pages: no probe
    assert not ctl.predicted and not ctl.speculation.planned
    cache.check()


def test_the_arriving_requests_own_path_comes_out_of_the_budget(tmp_path):
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=256, disk=64)  # room to spare: the lead's budget binds
    cache.clock = clock
    _ex, ctl = _controller(cache, clock, seconds=lambda link, tokens: tokens / 20.0, predictor_lead_s=1.0)
    serve(cache, seq(0, 2))
    _disk_only(cache, seq(0, 2) + seq(100, 2))
    seen = []
    ctl.speculation.predictor = _Fixed([])
    ctl.speculation.predictor.predict = lambda start, now, budget_tokens=None: seen.append(budget_tokens) or []
    full = ctl.speculation.prediction_budget()
    assert full == 20 and full < ctl.speculation.host_room(0)
    ctl.arrive(seq(9000, 1))  # nothing of its own on disk
    ctl.arrive(seq(0, 2) + seq(7000, 1))  # two pages of its own on disk
    assert seen == [full, full - 2 * PS]


def test_a_prediction_gets_no_more_host_room_than_a_queue_prefetch(tmp_path):
    """A prediction is a speculative prefetch: its own path and its picks together fit in what a
    queue prefetch of a request not at the head may hold (`PromotionGuard.prefetch_room`)."""
    _cache, _ex, ctl, _child = _own_path_and_child(tmp_path)  # host: 8 pages; a prefetch may hold 4
    seen = []
    ctl.speculation.predictor.predict = lambda start, now, budget_tokens=None: seen.append(budget_tokens) or []
    assert ctl.speculation.prediction_budget() > 4 * PS  # the room binds, not the lead
    ctl.arrive(seq(9000, 1))
    ctl.arrive(seq(0, 2) + seq(7000, 1))  # two pages of its own on disk: two left for picks
    assert seen == [4 * PS, 2 * PS]
    ctl.speculation.guard.prefetch_share = 0.25  # a prefetch may hold 2 pages: its own path fills them
    ctl.arrive(seq(0, 2) + seq(7001, 1))
    assert len(seen) == 2 and not ctl.predicted  # no room for a pick below its own path


# ---- a deep queue: the demand's own prefetch has the lead ------------------------------------------
def test_queue_delay_is_an_average_over_recent_admissions():
    d = QueueDelay(half_life=2)
    assert d.seconds == 0.0
    assert d.add(4.0) == 4.0  # the first admission is the estimate
    d.add(0.0)
    d.add(0.0)  # two half-lives of zero delay since
    assert d.seconds == pytest.approx(2.0)
    assert d.add(-1.0) < 2.0  # a clock step back counts as no delay, never a negative one


@pytest.mark.parametrize("waited, predicts", [(0.5, True), (3.0, False)])
def test_no_prediction_while_requests_queue_longer_than_the_lead(tmp_path, waited, predicts):
    """A request that waits longer than the lead has its path brought by its own queue prefetch:
    a prediction for it adds copies only. The controller measures arrival -> admission."""
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock, predictor_lead_s=2.0)
    target = _disk_only(cache, seq(0, 2))
    first = seq(5000, 1)
    ticket, _ = ctl.arrive(first)  # nothing predicted yet
    clock.t += waited
    ctl.admitted(ticket)  # it left the queue `waited` s after it arrived
    ctl.admitted(ticket)  # (once per request)
    assert ctl.queue_delay.seconds == pytest.approx(waited)
    ctl.speculation.predictor = _Fixed([Prediction(target, 1.0)])
    ctl.arrive(seq(9000, 1))
    assert bool(ctl.predicted) is predicts
    assert ctl.speculation.guard.queue_deep == (0 if predicts else 1)
    counters = ctl.speculation.counters()  # what the server's stats and the engine's benchmarks report
    assert counters["queue_deep"] == ctl.speculation.guard.queue_deep and counters["queue_delay_s"] == pytest.approx(
        waited
    )
    if predicts:
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()
        assert target.host is not None
    else:
        assert target.host is None and not ctl.speculation.planned
    cache.check()
