"""Shadow bets (`policy/shadow.py`): a trigger with no record writes its picks down instead of
copying them, and makes real copies only once requests have used enough of what it wrote down."""

from __future__ import annotations

from conftest import make_cache
from test_oracle_reuse import PS, Clock, seq
from test_predictor_blockers import _controller, _disk_only, _Fixed

from sgl_hicache.policy.guard import PromotionGuard
from sgl_hicache.policy.predictor import Prediction
from sgl_hicache.policy.shadow import ShadowBets
from sgl_hicache.tree.node import TreeNode


def _node(pages: int = 1) -> TreeNode:
    return TreeNode(None, tuple(range(pages * PS)), None, pages)


def test_a_pick_on_an_admitted_path_is_used_and_the_rest_expires_wasted():
    a, b, c = _node(), _node(2), _node()
    book = ShadowBets()
    assert book.bet("t", [(a, 4, 0.0, 99.0), (b, 8, 0.0, 99.0)], now=0.0, horizon_s=10.0) == 12
    book.observe([c, a], now=5.0)  # a request through `a` (and a node never bet on)
    assert book.used["t"] == 4 and book.wasted["t"] == 0
    book.observe([a], now=6.0)  # used once: a second request does not count it again
    assert book.used["t"] == 4
    book.observe([b], now=10.0)  # at the horizon: too late, `b` was wasted
    assert book.used["t"] == 4 and book.wasted["t"] == 8


def test_a_pick_whose_copy_would_still_be_on_its_way_is_wasted():
    a, b = _node(), _node()
    book = ShadowBets()
    book.bet("t", [(a, 4, 1.0, 99.0), (b, 4, 3.0, 99.0)], now=0.0, horizon_s=10.0)  # b queued behind a
    book.observe([a, b], now=2.0)  # a would have landed; b not yet
    assert book.used["t"] == 4 and book.wasted["t"] == 4 and book.judged["t"] == 1


def test_a_pick_the_host_would_have_evicted_before_the_request_came_is_wasted():
    a = _node()
    book = ShadowBets()
    book.bet("t", [(a, 4, 1.0, 2.0)], now=0.0, horizon_s=10.0)  # on host from 1 s to 2 s
    book.observe([a], now=3.0)
    assert book.used["t"] == 0 and book.wasted["t"] == 4


def test_a_node_already_bet_on_is_not_bet_again_and_triggers_are_kept_apart():
    a, b = _node(), _node()
    book = ShadowBets()
    book.bet("x", [(a, 4, 0.0, 99.0)], now=0.0, horizon_s=10.0)
    assert book.bet("y", [(a, 4, 1.0, 99.0), (b, 4, 1.0, 99.0)], now=1.0, horizon_s=10.0) == 4  # only `b` is new
    book.observe([a, b], now=2.0)
    assert book.used == {"x": 4, "y": 4}
    assert book.summary() == {
        "x": {"used_tokens": 4, "wasted_tokens": 0, "bets_judged": 1, "live": False},
        "y": {"used_tokens": 4, "wasted_tokens": 0, "bets_judged": 1, "live": False},
    }


def test_proven_needs_enough_judged_bets_at_the_guards_precision():
    g = PromotionGuard(min_precision=0.5, shadow_bets=2)
    assert not g.proven(600, 0, bets=1)  # one lucky bet is not a record
    assert g.proven(60, 40, bets=2)
    assert not g.proven(40, 60, bets=5)
    assert PromotionGuard(shadow_bets=0).proven(0, 0, bets=0)  # no shadow phase


def test_a_bet_is_judged_by_its_first_used_pick_or_at_its_horizon():
    a, b, c = _node(), _node(), _node()
    book = ShadowBets()
    book.bet("t", [(a, 4, 0.5, 99.0), (b, 4, 0.5, 99.0)], now=0.0, horizon_s=10.0)  # two siblings
    book.bet("t", [(c, 4, 0.5, 99.0)], now=0.0, horizon_s=10.0)
    book.observe([a], now=1.0)
    assert book.judged["t"] == 1  # the first bet: one of its picks was used
    book.observe([b], now=2.0)
    assert book.judged["t"] == 1  # (not twice)
    book.expire(10.0)
    assert book.judged["t"] == 2 and book.wasted["t"] == 4  # the second: nothing by the horizon


def _setup(tmp_path):
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    cache.clock = clock
    ex, ctl = _controller(cache, clock)
    ctl.speculation.guard = PromotionGuard(shadow_bets=1)
    cache.tree.half_life.value = 30.0  # the shadow horizon
    child = _disk_only(cache, seq(0, 2) + seq(100, 2))
    ctl.speculation.predictor = _Fixed([Prediction(child, 1.0)])
    return cache, ex, ctl, clock, child


def test_an_unproven_trigger_copies_nothing_until_requests_use_its_shadow_picks(tmp_path):
    cache, ex, ctl, clock, child = _setup(tmp_path)
    moved = dict(cache.stats.bytes_moved)
    ctl.arrive(seq(9000, 1))
    assert not ctl.predicted and dict(cache.stats.bytes_moved) == moved  # written down, not copied
    assert sum(ctl.speculation.shadow.used.values()) == 0
    # a request admitted through the pick within the horizon: the record is made
    clock.t += 5.0
    ctl.account(None, 4 * PS, cache.match(seq(0, 2) + seq(100, 2), touch=False))
    assert sum(ctl.speculation.shadow.used.values()) == child.num_pages * PS
    clock.t += 1.0
    ctl.arrive(seq(9001, 1))
    assert len(ctl.predicted) == 1  # proven: a real copy now
    assert ctl.speculation.shadow.live
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert child.host is not None
    cache.check()


def test_a_trigger_whose_shadow_picks_go_unused_never_copies(tmp_path):
    cache, _ex, ctl, clock, _child = _setup(tmp_path)
    for i in range(4):
        ctl.arrive(seq(9000 + i, 1))
        clock.t += 31.0  # past the horizon: the bet expires unused
    assert not ctl.predicted and not ctl.speculation.shadow.live
    assert sum(ctl.speculation.shadow.wasted.values()) > 0 and sum(ctl.speculation.shadow.used.values()) == 0
    assert cache.stats.prefetch["predict"]["promoted_tokens"] == 0
