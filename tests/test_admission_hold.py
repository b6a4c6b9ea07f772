"""`hold_new_admissions` (issue 23's experiment, off by default): a request offered for the first
time while the prefill batch has one already waits one round, and its second offer goes through."""

from __future__ import annotations

from types import SimpleNamespace

from sgl_hicache.sglang.scheduler_hooks import hold_new
from sgl_hicache.sglang.settings import BackendSettings


def _cache(on: bool) -> SimpleNamespace:
    return SimpleNamespace(settings=BackendSettings(hold_new_admissions=on), held_rids=set(),
                           counters=SimpleNamespace(admission_holds=0))


def test_off_by_default_holds_nothing():
    assert BackendSettings().hold_new_admissions is False
    c = _cache(False)
    assert not hold_new(c, SimpleNamespace(rid="a"), ["x"])


def test_a_new_request_behind_another_waits_one_round_then_goes():
    c = _cache(True)
    first, second = SimpleNamespace(rid="a"), SimpleNamespace(rid="b")
    assert not hold_new(c, first, [])  # the batch's first request is never held
    assert hold_new(c, second, [first])  # a new one behind it waits a round
    assert c.counters.admission_holds == 1 and c.held_rids == {"b"}
    assert not hold_new(c, second, [])  # its next offer goes through, and it is forgotten
    assert c.held_rids == set()
    assert not hold_new(c, SimpleNamespace(rid=None), [first])  # nothing to know it by: not held
