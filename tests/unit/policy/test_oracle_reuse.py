"""The oracle (Belady + perfect prefetch), the reuse model's retention, and the guard
against harmful promotion. Behaviour, not figures: the figures are in benchmarks/engine/regime_map.py."""

from __future__ import annotations

import random
from array import array

import pytest
from conftest import make_cache, serve

from sgl_hicache.control.lifecycle import ControllerSettings, RequestController
from sgl_hicache.policy.guard import PromotionGuard
from sgl_hicache.policy.oracle import Oracle
from sgl_hicache.policy.predictor import Prediction, Predictor
from sgl_hicache.policy.predictor_factory import make_predictor
from sgl_hicache.policy.reuse import ContinuationPredictor, ReuseModel, equal_value_idle
from sgl_hicache.replay.trace import Request
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.run import run_policy
from sgl_hicache.sim.simulator import EngineConfig
from sgl_hicache.tiers.base import DEVICE, DISK, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes

PS = 4


def seq(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PS))


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def chat_trace(seed: int, n: int = 60) -> list[Request]:
    """Multi-turn chat: a shared system page, conversations that return (or not) after a gap."""
    rng = random.Random(seed)
    system = seq(0, 1)
    convs: list[list[int]] = []
    out, t = [], 0.0
    for i in range(n):
        t += rng.uniform(0.05, 0.5)
        c = rng.randrange(len(convs)) if convs else 0
        if convs and rng.random() < 0.5 and len(convs[c]) <= 6 * PS:
            convs[c] = convs[c] + seq(100_000 + 1000 * i, rng.randint(1, 3))
            tokens = convs[c]
        else:
            tokens = system + seq(10_000 * (i + 1), rng.randint(2, 6))
            convs.append(tokens)
        out.append(Request(f"r{i}", None, t, array("q", tokens), 2, i + 1))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_never_fewer_hits_than_lru(seed):
    reqs = chat_trace(seed)
    base = dict(
        model=get_model("tiny-llama"),
        hardware=get_hardware("cpu-local"),
        device_tokens=64,
        host_tokens=24,
        disk_tokens=32,
        page_size=PS,
        concurrency=1,
    )
    lru = run_policy(reqs, EngineConfig("demote", **base))
    oracle = run_policy(reqs, EngineConfig("oracle", **base))
    assert oracle["hit_rate"] >= lru["hit_rate"]


def test_oracle_evicts_the_page_used_last():
    a, b, c = seq(0, 2), seq(1000, 2), seq(2000, 2)
    future = [a, b, c, b, a, c]  # after the first three: b is used next, then a, then c
    oracle = Oracle(PS)
    cache = make_cache(None, device=8, host=0, priority=oracle.priority)
    oracle.bind(future, cache.tree)
    for i, p in enumerate(future[:3]):
        serve(cache, p)
        oracle.admitted(i)
    # room for one more page pair: LRU would drop a (the oldest); Belady drops c (used last)
    cache.evict(DEVICE, 2 + cache.stores[DEVICE].free_pages - cache.stores[DEVICE].free_pages)
    held = {tuple(n.tokens[:PS]) for n in cache.nodes_in(DEVICE)}
    assert tuple(c[:PS]) not in held and tuple(a[:PS]) in held and tuple(b[:PS]) in held


def test_retention_keeps_the_node_worth_more():
    """Two idle leaves of the same age: the one whose kind of node has come back before is kept."""
    clock = Clock()
    cache = make_cache(None, device=8, host=0, eviction_policy="reuse")
    cache.clock = clock
    model = cache.reuse
    assert model is not None and cache.priority == model.priority
    root_sys = seq(0, 1)
    # history: conversations under the system page return (depth 2 nodes reused)
    for i in range(3):
        serve(cache, root_sys + seq(1000 * (i + 1), 1))
        clock.t += 1
        serve(cache, root_sys + seq(1000 * (i + 1), 1) + seq(50_000 + 1000 * i, 1))
        clock.t += 1
    # a one-shot prompt with no history of returning (a depth-1 node, never reused)
    lone = seq(90_000, 1)
    serve(cache, lone)
    conv = root_sys + seq(7000, 1)
    serve(cache, conv)
    clock.t += 5
    lone_node = cache.match(lone, touch=False).last_node
    conv_node = cache.match(conv, touch=False).last_node
    assert model.value(conv_node) > model.value(lone_node)
    # free device pages one at a time, lowest priority first: the lone prompt goes before the conversation
    while lone_node.device is not None and conv_node.device is not None:
        assert cache.evict(DEVICE, 1) >= 1
    assert conv_node.device is not None and lone_node.device is None
    cache.check()


def test_reuse_probability_falls_with_idle_time():
    clock = Clock()
    cache = make_cache(None, device=16, host=0, eviction_policy="reuse")
    cache.clock = clock
    for i in range(4):
        serve(cache, seq(0, 1) + seq(1000 * (i + 1), 1))
        clock.t += 10
        serve(cache, seq(0, 1) + seq(1000 * (i + 1), 1) + seq(70_000 + 100 * i, 1))
    node = cache.match(seq(0, 1) + seq(4000, 1) + seq(70_300, 1), touch=False).last_node  # inserted last
    clock.t += 1  # idle for less than every gap seen (10 s)
    early = cache.reuse.p_reuse(node)
    clock.t += 10_000
    assert cache.reuse.p_reuse(node) < early


def test_guard_stops_promotion_under_low_precision():
    guard = PromotionGuard(min_precision=0.6, min_resolved_tokens=100, probe_every=10)
    assert guard.allow(0, 50)  # too little evidence yet
    assert guard.allow(70, 30)  # precision 0.7
    answers = [guard.allow(10, 90) for _ in range(30)]  # precision 0.1: stopped but for probes
    assert answers.count(True) == 3 and guard.stopped == 27


class _Wrong(Predictor):
    """Always predicts the disk-only node given, which no request ever uses."""

    name = "wrong"

    def __init__(self, nodes):
        self.nodes = nodes

    def predict(self, start, now, budget_tokens=None):
        return [Prediction(n, 1.0) for n in self.nodes if n.host is None and n.device is None]


def test_guard_stops_a_wrong_predictor_through_the_controller(tmp_path):
    cache = make_cache(tmp_path, device=4, host=4, disk=256)
    clock = Clock()
    cache.clock = clock
    ex = VirtualExecutor(cache, VirtualPipes(lambda link, tokens: 0.0), clock, PS)
    ctl = RequestController(cache, ex, Predictor(), ControllerSettings(max_predicted_jobs=1), clock)
    ctl.speculation.guard = PromotionGuard(
        min_precision=0.5, min_resolved_tokens=2 * PS, probe_every=1000, shadow_bets=0
    )
    junk = [seq(500_000 + 1000 * i, 1) for i in range(40)]
    for p in junk:
        serve(cache, p)
    nodes = [cache.match(p, touch=False).last_node for p in junk]
    assert all(not n.in_tier(HOST) and n.disk is not None for n in nodes[:20])
    ctl.speculation.predictor = _Wrong(nodes[:20])
    for i in range(30):
        cache.evict(HOST, 2)  # room for a promotion
        ctl.arrive(seq(900_000 + 1000 * i, 1))
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()
        serve(cache, seq(900_000 + 1000 * i, 1))  # evicts the unused promotions: wasted
    promoted = cache.stats.prefetch["predict"]["promoted_tokens"]
    assert cache.stats.prefetch["predict"]["used_tokens"] == 0
    assert ctl.speculation.guard.stopped > 0 and promoted < 20 * PS  # it stopped long before promoting all 20
    cache.check()


def test_promotion_never_evicts_a_page_worth_more():
    clock = Clock()
    cache = make_cache(None, device=8, host=4)
    cache.clock = clock
    ranks = {}
    prio = lambda n: (ranks.get(n.id, 0), n.id)  # noqa: E731
    a, b = seq(0, 2), seq(1000, 2)
    serve(cache, a)
    serve(cache, b)
    na, nb = (cache.match(p, touch=False).last_node for p in (a, b))
    ranks[na.id], ranks[nb.id] = 5, 1
    assert not PromotionGuard.worth_evicting([na], 2, nb, prio)  # bringing b would push out a: refused
    assert PromotionGuard.worth_evicting([nb], 2, na, prio)
    assert PromotionGuard.worth_evicting([], 0, na, prio)
    assert not PromotionGuard.worth_evicting([nb], 4, na, prio)  # not enough room even then


def test_continuation_predictor_needs_the_model_and_promotes_disk_tips(tmp_path):
    with pytest.raises(ValueError, match="reuse model"):
        make_predictor("continuation", PS, 64)
    clock = Clock()
    cache = make_cache(tmp_path, device=4, host=4, disk=64, predictor="continuation")
    cache.clock = clock
    pred = make_predictor("continuation", PS, 64, model=cache.reuse)
    assert isinstance(pred, ContinuationPredictor) and pred.may_evict
    pred.min_probability = 0.0
    tip = seq(0, 1) + seq(1000, 1)
    serve(cache, tip)
    for i in range(6):
        serve(cache, seq(10_000 * (i + 1), 2))
    node = cache.match(tip, touch=False).last_node
    assert node.disk is not None and node.host is None
    assert node in [p.node for p in pred.predict(cache.tree.root, clock())]


def test_admission_drops_pages_not_worth_a_copy_below(tmp_path):
    cache = make_cache(tmp_path, device=4, host=4, disk=64, admission_min_probability=1.0)
    assert isinstance(cache.reuse, ReuseModel)
    for i in range(6):
        serve(cache, seq(10_000 * (i + 1), 2))
    assert cache.stats.bytes_moved["device->host"] == 0  # nothing was worth keeping below
    assert cache.snapshot()["stored_tokens"][DISK] == 0
    cache.check()


def _conversations(cache, clock, count: int, gap_s: float, returns: bool) -> None:
    """`count` two-turn conversations `gap_s` apart (the second turn only where `returns`), then
    `count` one-turn prompts that never come back where not."""
    for i in range(count):
        first = seq(10_000 * (i + 1), 1)
        serve(cache, first)
        clock.t += gap_s
        if returns:
            serve(cache, first + seq(10_000 * (i + 1) + 500, 1))


def test_the_return_curve_values_nodes_that_come_back_soon_and_not_those_that_never_do():
    clock = Clock()
    back = make_cache(None, device=256, host=0)
    back.clock = clock
    model = back.learn_reuse()
    assert back.learn_reuse() is model  # one model per cache, created on the first call
    _conversations(back, clock, 40, 2.0, returns=True)
    curve = model.return_curve()
    # each conversation inserted two nodes, and the first came back: one in two
    assert model.gaps >= 32 and 0.4 < model.population_q() < 0.6
    # a node idle for less than the gaps seen is worth more per second held than one idle for longer
    assert dict(curve)[0.0] > dict(curve)[0.5 * 1.5**8] >= 0.0

    clock2 = Clock()
    never = make_cache(None, device=256, host=0)
    never.clock = clock2
    lone = never.learn_reuse()
    _conversations(never, clock2, 40, 2.0, returns=False)
    assert lone.population_q() < 0.1
    assert max(v for _, v in lone.return_curve()) < min(v for _, v in curve[:4])


def test_equal_value_idle_finds_the_first_idle_time_worth_no_more():
    curve = [(0.0, 1.0), (1.0, 0.5), (2.0, 0.25)]
    assert equal_value_idle(curve, 2.0) == 0.0
    assert equal_value_idle(curve, 0.5) == 1.0
    assert equal_value_idle(curve, 0.3) == 2.0
    assert equal_value_idle(curve, 0.1) == float("inf")
