"""The tree-walk predictor on small hand-built trees, its use through the cache (never evicting), and the
prefetch / prediction precision counters."""

from __future__ import annotations

import pytest
from conftest import make_cache, serve

from sgl_hicache.cache import TieredCache
from sgl_hicache.policy.predictor import Predictor, TreeWalkPredictor
from sgl_hicache.policy.predictor_factory import make_predictor
from sgl_hicache.tiers.base import DEVICE, DISK, HOST
from sgl_hicache.transfer.handlers import execute
from sgl_hicache.tree.node import edge_key_of
from sgl_hicache.tree.traffic import TRAFFIC_HALF_LIFE_S

PS = 4


def seq(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PS))


P = seq(0, 2)  # the shared prefix
H = P + seq(100, 2)  # its hot child
C = P + seq(200, 2)  # its cold child


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def build(hot: int = 5, cold: int = 1, **kw) -> tuple[TieredCache, Clock]:
    """P with two children; `hot` matches went on from P into H, `cold` into C."""
    cache = make_cache(None, **kw)
    clock = Clock()
    cache.clock = clock
    for p in (P, H, C):
        serve(cache, p)  # each serve matches only what the tree held before it: no traffic into H or C yet
    for _ in range(hot):
        cache.match(H)
    for _ in range(cold):
        cache.match(C)
    return cache, clock


def node(cache: TieredCache, tokens):
    return cache.match(tokens, touch=False).last_node


def walker(budget: int = 1000, **kw) -> TreeWalkPredictor:
    kw.setdefault("needs_promotion", lambda n: True)  # pure tests: every node counts as worth promoting
    return TreeWalkPredictor(PS, budget, **kw)


def test_traffic_counts_follow_matches():
    cache, _ = build(hot=5, cold=1)
    p = node(cache, P)
    # the insert that made each child counts as its first request, then one per counted match
    assert p.child_traffic[edge_key_of(seq(100, 1))] == pytest.approx(6)
    assert p.child_traffic[edge_key_of(seq(200, 1))] == pytest.approx(2)


def test_traffic_counted_once_per_request_not_per_match_call():
    """A request re-matched while it waits (the queue head, every step) is one request: only a
    counting match (its arrival: `count=True`, the default of a touching match) adds traffic."""
    cache, _ = build(hot=2, cold=0)
    p = node(cache, P)
    key = edge_key_of(seq(100, 1))
    before = p.child_traffic[key]
    for _ in range(7):
        cache.match(H, count=False)  # re-matches: recency refreshed, traffic not counted
    assert p.child_traffic[key] == pytest.approx(before)
    cache.match(H)
    assert p.child_traffic[key] == pytest.approx(before + 1)


def test_split_keeps_the_count():
    """Splitting a node hands its upper half the traffic that went into it: every request counted
    into a node went through its whole edge, so a split must not restart the count at one."""
    cache = make_cache(None, device=32)
    clock = Clock()
    cache.clock = clock
    long = P + seq(100, 4)
    for _ in range(5):
        serve(cache, long)  # one insert, then four returns: five requests into the long node
    head = P + seq(100, 1) + seq(7000, 1)  # diverges one page into the long node: splits it
    serve(cache, head)
    upper = node(cache, P + seq(100, 1))
    lower_key = edge_key_of(seq(104, 1))
    assert upper.child_traffic[lower_key] * 0.5 ** (
        (clock() - upper.traffic_stamp) / TRAFFIC_HALF_LIFE_S
    ) == pytest.approx(5)


def test_promotes_the_hot_child_not_the_cold_one():
    cache, clock = build(hot=9, cold=0)  # H: 10 requests, C: 1 (its insert): C's 1/11 is below 0.5 / 4
    for min_visits in (1.0, 2.0):
        out = walker(min_probability=0.5, min_visits=min_visits).predict(node(cache, P), clock())
        assert [pr.node for pr in out] == [node(cache, H)]
        assert 0.5 <= out[0].probability < 1.0
    # reversed traffic: reversed prediction
    cache, clock = build(hot=0, cold=9)
    assert [pr.node for pr in walker().predict(node(cache, P), clock())] == [node(cache, C)]


def test_min_probability():
    cache, clock = build(hot=5, cold=0)
    # requests that ended at P since one last went on below it count as a reason to stop there
    from sgl_hicache.tree.traffic import count_stop

    count_stop(node(cache, P), clock())
    count_stop(node(cache, P), clock())  # H: 6 requests, C: 1, stopped at P: 2; H and C together 7 / 9
    assert walker(min_probability=0.8).predict(node(cache, P), clock()) == []
    assert [pr.node for pr in walker(min_probability=0.75).predict(node(cache, P), clock())] == [node(cache, H)]


def test_expected_value_threshold_summed_over_siblings():
    """n equally likely branches: no one of them reaches 0.5, but together they are sure to be used;
    the walk takes them all (a per-node threshold, `max_siblings=1`, takes none)."""
    cache, clock = build(hot=4, cold=4)  # H and C: 5 requests each, nothing stopped at P
    got = walker(min_probability=0.6).predict(node(cache, P), clock())
    assert {pr.node for pr in got} == {node(cache, H), node(cache, C)}
    assert all(pr.probability == pytest.approx(0.5) for pr in got)
    assert walker(min_probability=0.6, max_siblings=1).predict(node(cache, P), clock()) == []
    # the siblings together must still be likely: with many stops at P they are not
    from sgl_hicache.tree.traffic import count_stop

    for _ in range(20):
        count_stop(node(cache, P), clock())
    assert walker(min_probability=0.6).predict(node(cache, P), clock()) == []


def test_min_visits():
    cache, clock = build(hot=3, cold=0)  # H: 4 requests
    assert walker(min_visits=5).predict(node(cache, P), clock()) == []
    assert [pr.node for pr in walker(min_visits=2).predict(node(cache, P), clock())] == [node(cache, H)]


def test_one_earlier_request_is_enough():
    """The minimum is one request: a child one earlier request went into, within a half-life, is
    predicted when nothing else competes (the first return of a session)."""
    cache, clock = build(hot=0, cold=0)
    drop = node(cache, P).child_traffic
    from sgl_hicache.tree.traffic import drop_edge

    drop_edge(node(cache, P), edge_key_of(seq(200, 1)))  # only H's insert is left: one request
    assert len(drop) == 1
    clock.t += TRAFFIC_HALF_LIFE_S / 2
    assert [pr.node for pr in walker().predict(node(cache, P), clock())] == [node(cache, H)]
    clock.t += 2 * TRAFFIC_HALF_LIFE_S  # long past: the one request no longer counts
    assert walker().predict(node(cache, P), clock()) == []


def test_stays_within_budget_parents_first():
    cache = make_cache(None, device=16)
    clock = Clock()
    cache.clock = clock
    a = P + seq(100, 2)
    b = a + seq(300, 2)
    c = b + seq(500, 3)
    for p in (P, a, b, c):
        serve(cache, p)
    for _ in range(10):
        cache.match(c)
    start = node(cache, P)
    na, nb, nc = node(cache, a), node(cache, b), node(cache, c)
    # a node larger than what is left is taken by its head (`pages`), and the walk ends there
    for budget, want in (
        (0, []),
        (3, []),
        (7, [(na, 1)]),
        (8, [(na, None)]),
        (15, [(na, None), (nb, 1)]),
        (16, [(na, None), (nb, None)]),
        (27, [(na, None), (nb, None), (nc, 2)]),
        (28, [(na, None), (nb, None), (nc, None)]),
    ):
        out = walker(budget, min_probability=0.1).predict(start, clock())
        assert [(pr.node, pr.pages) for pr in out] == want, budget
        assert sum(pr.pages or pr.node.num_pages for pr in out) * PS <= budget
    # probabilities multiply down the path (never grow)
    out = walker(100, min_probability=0.1).predict(start, clock())
    assert out[0].probability >= out[1].probability >= out[2].probability
    # a node that needs no promotion costs no budget; the walk still goes on below it
    out = walker(12, min_probability=0.1, needs_promotion=lambda n: n is not na).predict(start, clock())
    assert [(pr.node, pr.pages) for pr in out] == [(nb, None), (nc, 1)]


def test_budget_counts_only_nodes_that_need_promotion():
    cache = make_cache(None, device=16)
    clock = Clock()
    cache.clock = clock
    a = P + seq(100, 2)
    b = a + seq(300, 2)
    for p in (P, a, b):
        serve(cache, p)
    for _ in range(10):
        cache.match(b)
    na, nb = node(cache, a), node(cache, b)
    # default: only nodes off the device need promoting; a is on the device, walked through, not counted
    nb_device = nb.device
    nb.device = None  # pretend b was demoted (a view for the predictor only; restored below)
    try:
        out = TreeWalkPredictor(PS, 8, min_probability=0.1).predict(node(cache, P), clock())
        assert [pr.node for pr in out] == [nb]
    finally:
        nb.device = nb_device
    assert TreeWalkPredictor(PS, 8, min_probability=0.1).predict(node(cache, P), clock()) == []
    assert na.device is not None


def test_old_traffic_decays_away():
    cache, clock = build(hot=5, cold=0)
    w = walker(min_visits=2)
    p = node(cache, P)
    hl = TRAFFIC_HALF_LIFE_S  # the one half-life the cache writes and the predictor reads with
    assert len(w.predict(p, clock() + hl)) == 1  # 5 -> 2.5 visits: still a pattern
    assert w.predict(p, clock() + 2 * hl) == []  # 5 -> 1.25: no longer
    assert w.predict(p, clock() + 100 * hl) == []


def test_fresh_traffic_overtakes_old_traffic():
    cache, clock = build(hot=0, cold=10)  # C was hot long ago
    clock.t += 600  # ten of the cache's 60 s half-lives later, traffic goes to H
    for _ in range(3):
        cache.match(H)
    out = walker(min_visits=2).predict(node(cache, P), clock())
    assert [pr.node for pr in out] == [node(cache, H)]


def test_none_predictor_and_bad_arguments():
    cache, clock = build()
    assert make_predictor("none", PS, 1000).predict(node(cache, P), clock()) == []
    assert Predictor().predict(node(cache, P), clock()) == []
    assert isinstance(make_predictor("tree_walk", PS, 1000), TreeWalkPredictor)
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("oracle", PS, 1000)
    with pytest.raises(ValueError):
        TreeWalkPredictor(PS, -1)
    with pytest.raises(ValueError):
        TreeWalkPredictor(PS, 10, min_probability=1.5)


# ---- through the cache: a prediction never evicts ---------------------------------------


def device_state(cache: TieredCache) -> dict:
    return {tuple(n.tokens[:PS]): list(n.device) for n in cache.nodes_in(DEVICE)}


def test_prediction_through_the_cache_never_evicts():
    cache = make_cache(None, device=12, host=8)
    clock = Clock(10.0)
    cache.clock = clock
    for p in (P, H, C):
        serve(cache, p)
    for _ in range(5):
        cache.match(H)
    cache.match(C)
    # H and C go down to host: the device holds P and hotter, more recent prompts
    clock.t = 20.0
    for i in range(3):
        serve(cache, seq(10_000 * (i + 1), 2))
        clock.t += 1
    cache.evict(DEVICE, 4)
    assert node(cache, H).device is None and node(cache, H).host is not None
    assert node(cache, C).device is None
    pred = TreeWalkPredictor(PS, 64, min_probability=0.5)
    out = pred.predict(node(cache, P), clock())
    assert out[0].node is node(cache, H)
    # the device is full (of pages a running request holds, or colder ones: it does not matter)
    filler = cache.allocate_device(cache.stores[DEVICE].free_pages)
    assert cache.stores[DEVICE].free_pages == 0
    before_dev, before_stats = device_state(cache), cache.snapshot()
    job = cache.plan_promotion(out[0].node.path_from_root(), kind="predict", target=DEVICE, evict=False)
    assert job is None
    assert device_state(cache) == before_dev
    assert cache.snapshot()["evicted_tokens"] == before_stats["evicted_tokens"]
    cache.check()
    # two free pages: the prediction fills exactly them and pushes nothing out
    cache.free_device(filler[:2])
    job = cache.plan_promotion(out[0].node.path_from_root(), kind="predict", target=DEVICE, evict=False)
    assert job is not None
    for op in job.ops():
        execute(op, cache.handlers)
    assert cache.advance(job) and not job.failed
    cache.release(job)
    after = device_state(cache)
    assert all(after.get(k) == v for k, v in before_dev.items())  # every page that was there still is
    assert node(cache, H).device is not None
    assert cache.snapshot()["evicted_tokens"] == before_stats["evicted_tokens"]
    assert cache.snapshot()["prefetch"]["predict"]["promoted_tokens"] == 8
    cache.free_device(filler[2:])
    cache.check()


def test_prediction_to_host_never_evicts_host(tmp_path):
    cache = make_cache(tmp_path, device=4, host=4, disk=64)
    cold = seq(0, 2)
    serve(cache, cold)
    for i in range(4):
        serve(cache, seq(1000 * (i + 1), 2))
    assert cache.match(cold, touch=False).disk_tokens == 8
    assert cache.stores[HOST].free_pages == 0
    host_before = {tuple(n.tokens[:PS]) for n in cache.nodes_in(HOST)}
    evicted_before = dict(cache.snapshot()["evicted_tokens"])
    assert cache.plan_promotion(cache.match(cold), kind="predict", target=HOST, evict=False) is None
    assert {tuple(n.tokens[:PS]) for n in cache.nodes_in(HOST)} == host_before
    assert cache.snapshot()["evicted_tokens"] == evicted_before
    assert cache.match(cold, touch=False).disk_tokens == 8
    cache.check()


# ---- precision and coverage counters ------------------------------------------------------


def run_job(cache: TieredCache, job) -> None:
    assert job is not None
    for op in job.ops():
        execute(op, cache.handlers)
    assert cache.advance(job) and not job.failed
    cache.release(job)


def to_disk(cache: TieredCache, prompt, start: int) -> None:
    serve(cache, prompt)
    for i in range(8):
        serve(cache, seq(start + 1000 * i, 2))
    assert cache.match(prompt, touch=False).disk_tokens == len(prompt)


def test_prefetch_used_and_wasted_counters(tmp_path):
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    a, b = seq(0, 2), seq(500, 2)
    serve(cache, b)
    to_disk(cache, a, 100_000)
    assert cache.match(b, touch=False).disk_tokens == 8
    cache.evict(HOST, 8)  # room on host

    # a: prefetched disk -> host -> device (two copies, counted once), then used by a request
    run_job(cache, cache.plan_promotion(cache.match(a), "prefetch", target=DEVICE))
    pf = cache.snapshot()["prefetch"]["prefetch"]
    assert pf["promoted_tokens"] == 8 and pf["used_tokens"] == 0 and pf["precision"] == 0
    m = cache.match(a)
    assert m.device_tokens == 8
    cache.record_request(len(a), m)
    pf = cache.snapshot()["prefetch"]["prefetch"]
    assert pf["used_tokens"] == 8 and pf["precision"] == 1.0
    cache.record_request(len(a), cache.match(a))  # a second use is not counted again
    assert cache.snapshot()["prefetch"]["prefetch"]["used_tokens"] == 8

    # b: prefetched to host, then evicted from host unused: wasted
    run_job(cache, cache.plan_promotion(cache.match(b), "prefetch", target=HOST))
    assert cache.match(b, touch=False).host_tokens == 8
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    assert cache.match(b, touch=False).host_tokens == 0
    pf = cache.snapshot()["prefetch"]["prefetch"]
    assert pf["promoted_tokens"] == 16 and pf["used_tokens"] == 8 and pf["wasted_tokens"] == 8
    assert pf["precision"] == 0.5
    # predictions are counted apart from prefetches
    run_job(cache, cache.plan_promotion(cache.match(b), "predict", target=HOST, evict=False))
    snap = cache.snapshot()["prefetch"]
    assert snap["predict"]["promoted_tokens"] == 8 and snap["prefetch"]["promoted_tokens"] == 16
    cache.record_request(len(b), cache.match(b))
    assert cache.snapshot()["prefetch"]["predict"]["used_tokens"] == 8
    assert cache.snapshot()["prefetch"]["prefetch"]["used_tokens"] == 8
    cache.check()


def test_coverage_counter():
    cache = make_cache(None)
    m = cache.match(seq(0, 2))
    assert cache.snapshot()["coverage"] is None
    from sgl_hicache.cache import PrefixMatch

    fake = PrefixMatch(m.path, 0, 8, 8, [], m.last_node, m.last_device_node)
    cache.record_request(20, fake, covered_by_prefetch=12)
    snap = cache.snapshot()
    assert snap["coverage"] == pytest.approx(12 / 16)
    assert snap["hit_tokens"][HOST] == 8 and snap["hit_tokens"][DISK] == 8 and snap["miss_tokens"] == 4


def test_traffic_counts_decay_exactly_whatever_the_match_rate():
    """The cache keeps counts as of a stamp it moves only now and then; read as of any time they are
    the sum of 0.5 ** (age / 60 s) over the matches, however close together the matches came."""
    cache, clock = build(hot=0, cold=0)
    times = [1000.0, 1000.2, 1000.5, 1003.0, 1030.0, 1030.1, 1100.0, 1100.01]
    for t in times:
        clock.t = t
        cache.match(H)
    p = node(cache, P)
    now = 1200.0
    got = p.child_traffic[edge_key_of(seq(100, 1))] * 0.5 ** ((now - p.traffic_stamp) / 60.0)
    want = sum(0.5 ** ((now - t) / 60.0) for t in [1000.0] + times)  # H's insert (at 1000 s) counted too
    assert got == pytest.approx(want, rel=1e-9)


def test_edge_counts_match_a_dict_float_for_float():
    """`EdgeCounts` (the traffic counts' store) reads exactly like the dict it replaces: same keys
    in the same order, the very same floats after any mix of sets, pops and rebases (vectorised
    above a few dozen slots, a loop below)."""
    import random

    from sgl_hicache.tree.edge_counts import EdgeCounts

    rnd = random.Random(7)
    ref: dict[tuple[int, ...], float] = {}
    got = EdgeCounts()
    for _ in range(5000):
        op = rnd.random()
        key = (rnd.randrange(120),)
        if op < 0.5:
            add = 2.0 ** rnd.random()
            ref[key] = ref.get(key, 0.0) + add
            got[key] = got.get(key, 0.0) + add
        elif op < 0.7:
            assert got.pop(key, None) == ref.pop(key, None)
        else:
            f = 0.5 ** rnd.random()
            for k in ref:
                ref[k] *= f
            got.scale(f)
        assert list(got) == list(ref) and got.items() == list(ref.items()) and len(got) == len(ref)
    assert len(ref) >= 32  # the vectorised path ran (a few dozen live keys)
