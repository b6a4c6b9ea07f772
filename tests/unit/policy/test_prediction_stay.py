"""A prediction is made only where its copy would outlive its lead: the host tier takes a
prediction's pages (on disk, not on the device: a free drop) before the copies of device pages, so
under host pressure with no free drops ahead of it (or a pool of them running out) a copy is
evicted before its request arrives."""

from __future__ import annotations

from conftest import make_cache, serve
from test_oracle_reuse import PS, Clock, seq
from test_predictor_blockers import _controller, _disk_only, _Fixed

from sgl_hicache.policy.guard import PromotionGuard
from sgl_hicache.policy.predictor import Prediction
from sgl_hicache.policy.writeback_choice import fresh_copy_stay_s, host_pages_before_fresh_copy
from sgl_hicache.tiers.base import DEVICE, DISK, HOST


def _host_and_disk(cache, tokens):
    """A path held on host and disk, not on the device (the rank a prediction's copy has)."""
    serve(cache, tokens)
    node = cache.match(tokens, touch=False).last_node
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    if node.disk is None:
        assert cache.copy_now(node, DISK, kind="demote", may_evict=True)
    assert node.host is not None and node.disk is not None and node.device is None
    return node


def test_only_host_pages_on_disk_and_off_the_device_go_before_a_fresh_copy(tmp_path):
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    assert host_pages_before_fresh_copy(cache.tree, cache.config) == 0
    _host_and_disk(cache, seq(0, 3))  # 3 pages of rank 0
    serve(cache, seq(500, 2))  # on the device and host: its host copy goes last
    assert cache.match(seq(500, 2), touch=False).last_node.device is not None
    assert host_pages_before_fresh_copy(cache.tree, cache.config) == 3
    cache.tree.lock(cache.match(seq(0, 3), touch=False).last_node)  # a locked page is not evictable
    assert host_pages_before_fresh_copy(cache.tree, cache.config) == 0


def test_under_demoting_eviction_every_evictable_host_page_goes_before_it(tmp_path):
    cache = make_cache(tmp_path, device=8, host=16, disk=64, eviction_demotes="all")
    _host_and_disk(cache, seq(0, 3))
    serve(cache, seq(500, 2))
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)  # demoted: on host only, rank 1
    node = cache.match(seq(500, 2), touch=False).last_node
    assert node.host is not None and node.disk is None and node.device is None
    assert host_pages_before_fresh_copy(cache.tree, cache.config) == cache.tree.evictable_pages(HOST) == 5


def test_a_fresh_copy_lasts_while_the_pool_ahead_of_it_lasts():
    inf = float("inf")
    assert fresh_copy_stay_s(0, 0.0, evict_rate=0.2, lead_s=2.0) == inf  # the host evicts no page in the lead
    assert fresh_copy_stay_s(0, 0.0, evict_rate=5.0, lead_s=2.0) == 0.0  # nothing before it: the next to go
    assert fresh_copy_stay_s(40, -10.0, evict_rate=20.0, lead_s=2.0) == 4.0  # 40 pages, shrinking by 10/s
    assert fresh_copy_stay_s(40, 0.0, evict_rate=20.0, lead_s=2.0) == inf  # refilled as fast as it is taken
    assert fresh_copy_stay_s(40, 3.0, evict_rate=20.0, lead_s=2.0) == inf


def test_outlives_lead_refuses_a_stay_shorter_than_the_lead_and_counts_it():
    g = PromotionGuard()
    assert g.outlives_lead(float("inf"), 2.0) and g.outlives_lead(2.0, 2.0)
    assert not g.outlives_lead(1.9, 2.0) and g.short_stay == 1
    assert g.outlives_lead(0.0, 0.0)  # no lead: nothing to outlive


def _clocked(tmp_path):
    """A controller over a 8 / 16 / 64-page cache on a test clock, lead 2 s, no shadow phase."""
    clock = Clock(100.0)
    cache = make_cache(tmp_path, device=8, host=16, disk=64)
    cache.clock = clock
    _, ctl = _controller(cache, clock, predictor_lead_s=2.0)
    return clock, cache, ctl


def _live_prediction(tmp_path, ahead_pages: int):
    _clock, cache, ctl = _clocked(tmp_path)
    target = _disk_only(cache, seq(5000, 2))
    if ahead_pages:
        _host_and_disk(cache, seq(0, ahead_pages))
    ctl.speculation.predictor = _Fixed([Prediction(target, 1.0)])
    return cache, ctl, target


def test_a_live_prediction_is_refused_while_the_host_would_evict_it_within_its_lead(tmp_path):
    cache, ctl, _target = _live_prediction(tmp_path, ahead_pages=0)
    ctl.eviction_rates[HOST].rate = 4.0  # pages/s: host eviction is under way, nothing goes before it
    assert ctl.speculation.host_stay_s() == 0.0
    ctl.arrive(seq(9000, 1))
    assert ctl.predicted == [] and ctl.speculation.guard.short_stay == 1
    assert cache.stats.prefetch["predict"]["promoted_tokens"] == 0


def test_a_live_prediction_goes_ahead_while_the_free_drops_before_it_last_its_lead(tmp_path):
    _cache, ctl, _target = _live_prediction(tmp_path, ahead_pages=4)
    ctl.eviction_rates[HOST].rate = 8.0
    ctl.free_drop_trend.rate = -2.0  # 4 pages ahead of it, shrinking by 2 pages/s: 2 s, the lead
    assert ctl.speculation.host_stay_s() == 2.0
    ctl.arrive(seq(9000, 1))
    assert len(ctl.predicted) == 1 and ctl.speculation.guard.short_stay == 0


def test_a_live_prediction_is_refused_while_the_free_drops_before_it_run_out_within_its_lead(tmp_path):
    _cache, ctl, _target = _live_prediction(tmp_path, ahead_pages=4)
    ctl.eviction_rates[HOST].rate = 8.0
    ctl.free_drop_trend.rate = -4.0  # gone in 1 s
    ctl.arrive(seq(9000, 1))
    assert ctl.predicted == [] and ctl.speculation.guard.short_stay == 1


def test_the_pool_trend_is_measured_at_each_write_back_round(tmp_path):
    clock, cache, ctl = _clocked(tmp_path)
    _host_and_disk(cache, seq(0, 3))
    ctl._plan_copies_down(clock())
    _host_and_disk(cache, seq(300, 3))  # 3 more free drops in 1 s
    clock.t += 1.0
    ctl._plan_copies_down(clock())
    assert ctl.free_drop_trend.rate > 0
    cache.evict(HOST, 6)
    clock.t += 1.0
    ctl._plan_copies_down(clock())
    assert host_pages_before_fresh_copy(cache.tree, cache.config) == 0 and ctl.free_drop_trend.rate < 0


def test_a_host_that_evicts_nothing_keeps_a_prediction_however_few_pages_go_before_it(tmp_path):
    _cache, ctl, _target = _live_prediction(tmp_path, ahead_pages=0)
    assert ctl.eviction_rates[HOST].rate == 0 and ctl.speculation.host_stay_s() == float("inf")
    ctl.arrive(seq(9000, 1))
    assert len(ctl.predicted) == 1


def test_a_shadow_pick_the_host_would_evict_at_once_is_judged_wasted(tmp_path):
    clock, cache, ctl = _clocked(tmp_path)
    ctl.speculation.guard = PromotionGuard(shadow_bets=1)
    cache.tree.half_life.value = 30.0
    target = _disk_only(cache, seq(0, 2) + seq(100, 2))
    ctl.speculation.predictor = _Fixed([Prediction(target, 1.0)])
    ctl.eviction_rates[HOST].rate = 4.0  # nothing ranks before the copy: gone as soon as it lands
    ctl.arrive(seq(9000, 1))
    assert not ctl.predicted
    clock.t += 5.0  # the request the bet was for, well after the copy would have landed
    ctl.account(None, 4 * PS, cache.match(seq(0, 2) + seq(100, 2), touch=False))
    assert (
        sum(ctl.speculation.shadow.used.values()) == 0
        and sum(ctl.speculation.shadow.wasted.values()) == target.num_pages * PS
    )
