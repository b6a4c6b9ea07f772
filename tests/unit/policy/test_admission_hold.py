"""`admission_hold`: a request offered for the first time to a prefill batch that already
has one waits one round where the measured prefill cost says the split pays (`cost`, the default),
always (`always`) or never (`off`); its second offer always goes through."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from sgl_hicache.client.backend_settings import BackendSettings, SettingsError
from sgl_hicache.policy.admission import PrefillCost, PrefillCostFit, attention_pairs, hold_pays
from sgl_hicache.sglang.scheduler_hooks import hold_new, step_end, step_pairs, time_prefill

LONG_PREFILLS = PrefillCost(fixed_s=0.05, per_token_s=1e-4)  # 1,000 new tokens cost 0.1 s beyond the step's 0.05 s


def _cache(mode: str, cost: PrefillCost | None = LONG_PREFILLS) -> SimpleNamespace:
    return SimpleNamespace(
        settings=BackendSettings(admission_hold=mode),
        held_rids=set(),
        counters=SimpleNamespace(admission_holds=0),
        prefill_cost=lambda: cost,
    )


def _req(rid, new_tokens: int = 1000, host_hits: int = 0, device_prefix: int = 64) -> SimpleNamespace:
    """SGLang's `Req` as admission sees it: its input, the device prefix matched and the host + disk hits."""
    return SimpleNamespace(
        rid=rid,
        full_untruncated_fill_ids=list(range(device_prefix + host_hits + new_tokens)),
        prefix_len=device_prefix,
        host_hit_length=host_hits,
    )


def test_hold_pays_compares_the_batch_delay_with_one_more_fixed_cost():
    # joining delays 1 request by 1e-4 x 1,000 = 0.1 s; holding costs one more fixed 0.05 s
    assert hold_pays(1, 1000, LONG_PREFILLS)
    assert not hold_pays(1, 400, LONG_PREFILLS)  # 0.04 s < 0.05 s
    assert hold_pays(2, 400, LONG_PREFILLS)  # two requests delayed: 0.08 s
    assert not hold_pays(0, 10_000, LONG_PREFILLS)  # an empty batch: nothing to split
    assert not hold_pays(3, 0, LONG_PREFILLS)  # a request that computes nothing
    assert not hold_pays(3, 10_000, None)  # not measured yet


def test_cost_mode_is_the_default_and_holds_only_where_it_pays():
    assert BackendSettings().admission_hold == "cost"
    c = _cache("cost")
    first = _req("a")
    assert not hold_new(c, first, [])  # the batch's first request is never held
    assert hold_new(c, _req("b", 1000), [first])
    assert not hold_new(c, _req("c", 100), [first])  # short: batching it is cheaper than a step
    # host and disk hits are loaded, not computed: 2,000 tokens past the device prefix, 1,900 of them hits
    assert not hold_new(c, _req("d", 100, host_hits=1900), [first])
    assert c.counters.admission_holds == 1 and c.held_rids == {"b"}
    assert not hold_new(_cache("cost", cost=None), _req("e", 100_000), [first])  # unmeasured: no hold


def test_a_held_request_goes_through_on_its_second_offer():
    for mode in ("cost", "always"):
        c = _cache(mode)
        first, second = _req("a"), _req("b")
        assert hold_new(c, second, [first])
        assert not hold_new(c, second, [first])  # its next offer goes through, and it is forgotten
        assert c.held_rids == set()
        assert not hold_new(c, _req(None, 5000), [first])  # nothing to know it by


def test_always_holds_every_new_request_behind_another_and_off_none():
    always, off = _cache("always", cost=None), _cache("off")
    first = _req("a")
    assert hold_new(always, _req("b", 1), [first])
    assert not hold_new(off, _req("b", 100_000), [first])
    with pytest.raises(SettingsError, match="admission_hold"):
        BackendSettings(admission_hold="sometimes")


def test_the_fit_recovers_a_step_cost_from_noisy_steps():
    fit = PrefillCostFit(min_steps=8)
    rng = random.Random(7)
    for i in range(200):
        tokens = rng.randint(50, 6000)
        assert (fit.cost() is None) == (i < 8)
        fit.record(tokens, 0.03 + 2e-5 * tokens + rng.gauss(0, 0.002))
    cost = fit.cost()
    assert cost is not None
    assert cost.fixed_s == pytest.approx(0.03, abs=0.003)
    assert cost.per_token_s == pytest.approx(2e-5, rel=0.05)


def test_the_fit_forgets_an_old_regime():
    fit = PrefillCostFit(half_life_steps=16)
    for i in range(100):
        tokens = 100 + 50 * (i % 20)
        fit.record(tokens, 0.5 + 1e-3 * tokens)
    for i in range(400):  # 25 half-lives: the old steps weigh 3e-8 of the new
        tokens = 100 + 50 * (i % 20)
        fit.record(tokens, 0.01 + 1e-6 * tokens)
    cost = fit.cost()
    assert cost.fixed_s == pytest.approx(0.01, rel=0.05) and cost.per_token_s == pytest.approx(1e-6, rel=0.05)


def test_the_fit_needs_a_spread_and_clamps_to_non_negative():
    fit = PrefillCostFit(min_steps=4)
    for _ in range(50):
        fit.record(1024, 0.2)  # one size only: no slope to read
    assert fit.cost() is None
    fit = PrefillCostFit(min_steps=4)
    for tokens in (100, 200, 400, 800, 1600) * 4:
        fit.record(tokens, 0.3 - 1e-4 * tokens)  # falls with tokens (noise): read as free tokens
    cost = fit.cost()
    assert cost.per_token_s == 0.0 and cost.fixed_s > 0
    fit.record(0, 5.0)  # ignored: no tokens, or no time
    fit.record(100, 0.0)
    fit.record(100, float("nan"))
    assert fit.steps == 20
    with pytest.raises(ValueError):
        PrefillCostFit(half_life_steps=0)


class _Mode:
    def __init__(self, extend: bool) -> None:
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


def test_the_hook_times_prefill_batches_from_their_launch(monkeypatch):
    from sgl_hicache.sglang import scheduler_hooks

    fit = PrefillCostFit(min_steps=2)
    cache = SimpleNamespace(prefill_cost_fit=fit)
    monkeypatch.setattr(scheduler_hooks, "_our_cache", lambda c: c)
    monkeypatch.setattr(scheduler_hooks.time, "monotonic", lambda: 10.25)
    scheduler = SimpleNamespace(tree_cache=cache)
    prefill = SimpleNamespace(forward_mode=_Mode(True), launch_ts=10.0, extend_num_tokens=500)
    decode = SimpleNamespace(forward_mode=_Mode(False), launch_ts=9.0, extend_num_tokens=4)
    assert time_prefill("r", scheduler, prefill, "result") == "r"
    time_prefill(None, scheduler, decode, "result")  # decode steps are not prefill cost
    time_prefill(None, scheduler, SimpleNamespace(forward_mode=_Mode(True), launch_ts=None, extend_num_tokens=9))
    assert fit.steps == 1 and fit._b[0] == pytest.approx(0.25)


ATTENTION_BOUND = PrefillCost(fixed_s=0.17, per_token_s=2e-4, per_pair_s=4e-7)  # the shape measured on CPU


def test_attention_makes_a_short_prompt_after_a_long_context_worth_holding():
    # 100 new tokens alone: 0.02 s + 0.002 s of attention, under a fixed 0.17 s: batch it
    assert not hold_pays(1, 100, ATTENTION_BOUND, context_tokens=0)
    # the same 100 tokens after 6,000 cached ones attend to all of them: 0.02 + 0.242 s > 0.17 s
    assert hold_pays(1, 100, ATTENTION_BOUND, context_tokens=6000)
    assert ATTENTION_BOUND.marginal_s(100, 6000) == pytest.approx(2e-4 * 100 + 4e-7 * 100 * 6050)
    assert attention_pairs(4, 10) == 4 * 12
    c = _cache("cost", cost=ATTENTION_BOUND)
    first = _req("a")
    assert not hold_new(c, _req("b", 100, device_prefix=0), [first])
    assert hold_new(c, _req("c", 100, device_prefix=3000, host_hits=3000), [first])  # host hits are context too


def test_the_fit_recovers_the_attention_term_and_keeps_every_part_non_negative():
    rng = random.Random(11)
    fit = PrefillCostFit(min_steps=8)
    for _ in range(400):
        reqs = [(rng.randint(16, 3000), rng.choice((0, 0, 500, 4000))) for _ in range(rng.randint(1, 3))]
        tokens, pairs = sum(t for t, _ in reqs), sum(attention_pairs(t, c) for t, c in reqs)
        fit.record(tokens, 0.17 + 2e-4 * tokens + 4e-7 * pairs + rng.gauss(0, 0.02), pairs)
    cost = fit.cost()
    assert cost.fixed_s == pytest.approx(0.17, abs=0.02)
    assert cost.per_token_s == pytest.approx(2e-4, rel=0.1) and cost.per_pair_s == pytest.approx(4e-7, rel=0.05)
    # a convex cost read without pairs has a negative intercept: the fit drops the intercept rather
    # than report one below zero
    convex = PrefillCostFit(min_steps=4)
    for t in (100, 400, 1600, 3200) * 5:
        convex.record(t, 1e-4 * t + 1e-7 * t * t)
    cost = convex.cost()
    assert cost.fixed_s == 0.0 and cost.per_token_s > 0 and cost.per_pair_s == 0.0


class _Loc:
    def __init__(self, device: str) -> None:
        self.device = SimpleNamespace(type=device)


def test_a_cpu_step_ends_when_the_overlap_scheduler_launches_the_next_one():
    nxt = SimpleNamespace(launch_ts=10.4)
    scheduler = SimpleNamespace(result_queue=[(nxt, None)])
    cpu = SimpleNamespace(launch_ts=10.0, out_cache_loc=_Loc("cpu"))
    # on a CPU the next launch ran the next forward: this step ended when it began
    assert step_end(scheduler, cpu, now=11.0) == 10.4
    assert step_end(SimpleNamespace(result_queue=[]), cpu, now=11.0) == 11.0  # processed before any launch
    assert step_end(scheduler, SimpleNamespace(launch_ts=10.0, out_cache_loc=_Loc("cuda")), now=11.0) == 11.0
    assert step_end(SimpleNamespace(result_queue=[(SimpleNamespace(launch_ts=9.0), None)]), cpu, now=11.0) == 11.0


def test_step_pairs_counts_each_request_against_its_prefix():
    batch = SimpleNamespace(extend_lens=[100, 8], prefix_lens=[0, 4000])
    assert step_pairs(batch) == attention_pairs(100, 0) + attention_pairs(8, 4000)
    assert step_pairs(SimpleNamespace(extend_lens=None, prefix_lens=None)) == 0.0
