"""`admission_order`: under SGLang's default `fcfs`, the waiting queue's head is offered to
the prefill batch cheapest first at the measured prefill cost, and a request passed over by
`max_bypasses` prefill batches goes first (`policy.admission.QueueOrder`,
`sglang.scheduler_hooks.order_queue`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_hicache.policy.admission import PrefillCost, QueueOrder
from sgl_hicache.sglang import scheduler_hooks
from sgl_hicache.sglang.scheduler_hooks import order_queue, queued_work
from sgl_hicache.sglang.settings import BackendSettings, SettingsError

COST = PrefillCost(fixed_s=0.05, per_token_s=1e-4, per_pair_s=1e-8)


def test_cheapest_first_ties_keep_arrival_order():
    q = QueueOrder()
    assert q.order(["a", "b", "c", "d"], [3.0, 1.0, 2.0, 1.0]) == [1, 3, 2, 0]
    assert q.order(["a", "b"], [1.0, 2.0]) == [0, 1]
    assert q.reordered == 1  # only the call whose order changed


def test_a_request_passed_over_max_bypasses_batches_goes_first():
    q = QueueOrder(max_bypasses=2)
    rids = ["long", "s1"]
    assert q.order(rids, [9.0, 1.0]) == [1, 0]
    q.batch_formed()  # s1 admitted; long passed over once
    assert q.order(["long", "s2"], [9.0, 1.0]) == [1, 0]
    q.batch_formed()  # twice: overdue now
    assert q.order(["long", "s3", "s4"], [9.0, 1.0, 0.5]) == [0, 2, 1]
    # a request that left the queue (admitted, aborted) is forgotten: back again, its age starts over
    assert q.order(["s5"], [1.0]) == [0]
    assert q.order(["long", "s6"], [9.0, 1.0]) == [1, 0]


def test_two_ranks_given_the_same_queue_and_batches_agree():
    a, b = QueueOrder(), QueueOrder()
    queues = [(["r1", "r2", "r3"], [2.0, 1.0, 3.0]), (["r1", "r3", "r4"], [2.0, 3.0, 0.1]), (["r3", "r5"], [3.0, 3.0])]
    for rids, costs in queues:
        assert a.order(rids, costs) == b.order(rids, costs)
        a.batch_formed()
        b.batch_formed()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_bypasses"):
        QueueOrder(max_bypasses=0)
    with pytest.raises(ValueError, match="2 rids but 1 costs"):
        QueueOrder().order(["a", "b"], [1.0])
    assert BackendSettings().admission_order == "fcfs"  # cost measured no better (docs/benchmarks.md)
    with pytest.raises(SettingsError, match="admission_order"):
        BackendSettings(admission_order="shortest")


# ---------------------------------------------------------------------------------------- the hook
class _Tree:
    def __init__(self, cached: int) -> None:
        self.cached, self.calls = cached, 0

    def page_aligned(self, tokens) -> int:
        return len(tokens) - len(tokens) % 16

    def match(self, tokens, touch: bool = True):
        assert not touch  # a peek must not refresh recency or count traffic
        self.calls += 1
        return SimpleNamespace(device_tokens=min(self.cached, len(tokens)), host_tokens=0, disk_tokens=0, lower_tier_tokens=0)


def _cache(order: str = "cost", cost: PrefillCost | None = COST, cached: int = 0, matches: dict | None = None):
    tree = _Tree(cached)
    states = {rid: SimpleNamespace(last_match=m) for rid, m in (matches or {}).items()}
    return SimpleNamespace(settings=BackendSettings(admission_order=order), prefill_cost=lambda: cost,
                           queue_order=QueueOrder(), req_states=SimpleNamespace(get=states.get),
                           cache=SimpleNamespace(match=tree.match, tree=tree))


class _Req:  # SGLang's `Req` as the queue sees it (weak-referenceable, like the real one)
    def __init__(self, rid: str, tokens: int) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, list(range(tokens)), []
        self.extra_key = self.cache_salt = None


def _policy(cache, name: str = "fcfs", priority: bool = False):
    return SimpleNamespace(tree_cache=cache, policy=SimpleNamespace(value=name), enable_priority_scheduling=priority)


@pytest.fixture(autouse=True)
def _fakes_are_our_cache(monkeypatch):
    monkeypatch.setattr(scheduler_hooks, "_our_cache", lambda cache: cache)


def _ordered(policy, queue: list) -> list[str]:
    order_queue(None, policy, queue)
    return [r.rid for r in queue]


def test_the_hook_offers_short_prefills_first_under_fcfs_only():
    def queue():
        return [_Req("long", 4000), _Req("short", 200), _Req("mid", 1000)]

    assert _ordered(_policy(_cache()), queue()) == ["short", "mid", "long"]
    # the user's own order, priority scheduling, `fcfs` asked for, or no measured cost yet: untouched
    for policy in (_policy(_cache(), name="lpm"), _policy(_cache(), priority=True), _policy(_cache(order="fcfs")),
                   _policy(_cache(cost=None))):
        assert _ordered(policy, queue()) == ["long", "short", "mid"]


def test_the_hook_reorders_only_the_queue_head(monkeypatch):
    monkeypatch.setattr(scheduler_hooks, "ORDER_WINDOW", 2)
    q = [_Req("long", 4000), _Req("mid", 1000), _Req("short", 200)]
    assert _ordered(_policy(_cache()), q) == ["mid", "long", "short"]


def test_work_counts_cached_tokens_from_the_last_match_else_one_peek():
    # a 3,000-token prompt with 2,900 cached costs less than a 1,000-token one with nothing cached...
    matched = SimpleNamespace(device_tokens=2000, host_tokens=900, disk_tokens=0, lower_tier_tokens=900)
    cache = _cache(matches={"cached": matched})
    assert queued_work(cache, _Req("cached", 3000)) == (100, 2900)
    assert _ordered(_policy(cache), [_Req("cold", 1000), _Req("cached", 3000)]) == ["cached", "cold"]
    # ...a request never matched is peeked once (the walk hashes its pages), then remembered
    peeked = _cache(cached=512)
    r = _Req("new", 2000)
    assert queued_work(peeked, r) == (1488, 512)
    assert queued_work(peeked, r) == (1488, 512)
    assert peeked.cache.tree.calls == 1
    # a salted or extra-keyed request matches nothing: all of it is computed
    salted = _Req("salted", 2000)
    salted.cache_salt = "tenant-a"
    assert queued_work(_cache(cached=512), salted) == (2000, 0)
