"""Client hints (sglang #27574's shape): parsed from trace lines with errors that name the
line and the field, run through the controller (`HintDesk`), pins bounded and expiring, and
replayed by the embedded engine."""

from __future__ import annotations

import json

import pytest
from conftest import make_cache, serve
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.control.lifecycle import ControllerSettings, RequestController
from sgl_hicache.policy.hint_rules import Hint, HintError, HintLimits, hint_tokens
from sgl_hicache.policy.predictor import Predictor
from sgl_hicache.replay import load_trace
from sgl_hicache.replay.trace import TraceError
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.executors import VirtualExecutor, VirtualPipes


def _write(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_trace_hints_are_parsed(tmp_path):
    p = _write(
        tmp_path,
        [
            {"session": "s1", "input_ids": [1, 2, 3, 4], "output_length": 2, "timestamp": 0.0},
            {
                "session": "s2",
                "input_ids": [1, 2, 9, 9],
                "output_length": 2,
                "timestamp": 1.0,
                "hints": [
                    {"action": "prefetch", "session": "s1"},
                    {"action": "pin", "input_ids": [1, 2, 3, 4], "ttl_s": 30, "after_s": 0.5},
                    {"action": "pin", "session": "s1", "ttl_s": 45, "at_finish": True},
                ],
            },
        ],
    )
    reqs = list(load_trace(p, fmt="plain"))
    assert reqs[0].hints == ()
    assert reqs[1].hints == (
        Hint("prefetch", session="s1"),
        Hint("pin", (1, 2, 3, 4), ttl_s=30.0, after_s=0.5),
        Hint("pin", session="s1", ttl_s=45.0, at_finish=True),
    )


@pytest.mark.parametrize(
    "hint, message",
    [
        ({"action": "evict", "session": "s"}, "hints[0]: unknown hint action 'evict'"),
        ({"action": "pin", "session": "s"}, "hints[0]: 'ttl_s' is required for a pin"),
        ({"action": "prefetch", "session": "s", "input_ids": [1]}, "hints[0]: a hint names its prefix by exactly one"),
        ({"action": "prefetch", "input_ids": "12"}, "hints[0]: field 'input_ids' must be an array of integers"),
        ({"action": "pin", "session": "s", "ttl_s": -1}, "hints[0]: field 'ttl_s' must be a finite number >= 0"),
        ({"action": "prefetch", "session": "s", "when": 1}, "hints[0]: unknown field(s) 'when'"),
        ({"action": "prefetch", "session": "s", "at_finish": 1}, "hints[0]: field 'at_finish' must be true or false"),
    ],
)
def test_a_malformed_hint_names_the_line_and_the_field(tmp_path, hint, message):
    p = _write(
        tmp_path,
        [{"input_ids": [1, 2], "output_length": 1}, {"input_ids": [1, 2], "output_length": 1, "hints": [hint]}],
    )
    with pytest.raises(TraceError) as err:
        load_trace(p, fmt="plain")
    assert f"{p}:2: " in str(err.value) and message in str(err.value)


def test_hint_tokens_resolve_sessions():
    assert hint_tokens(Hint("retain", (5, 6)), {}) == (5, 6)
    assert hint_tokens(Hint("retain", session="a"), {"a": [1, 2]}) == [1, 2]
    with pytest.raises(HintError, match="unknown session 'b'"):
        hint_tokens(Hint("retain", session="b"), {"a": [1, 2]})


def _controller(tmp_path, clock, **kw):
    cache = make_cache(tmp_path, device=8, host=8, disk=64, **kw)
    cache.clock = clock
    ex = VirtualExecutor(cache, VirtualPipes(lambda link, tokens: tokens / 1000.0), clock, PS)
    return cache, ex, RequestController(cache, ex, Predictor(), ControllerSettings(), clock)


def _disk_only(cache, tokens):
    serve(cache, tokens)
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    node = cache.match(tokens, touch=False).last_node
    assert node.host is None and node.disk is not None
    return node


def test_prefetch_hint_brings_the_prefix_to_host(tmp_path):
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    node = _disk_only(cache, seq(0, 3))
    assert ctl.hints.apply(Hint("prefetch", tuple(seq(0, 3))), seq(0, 3)) == 3 * PS
    assert ctl.predicted  # a speculative job of the controller, charged on the link
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert node.host is not None and cache.stats.triggers["hint"]["promoted_tokens"] == 3 * PS
    while ctl.predicted:  # and on to the device, which has room (tests/unit/control/test_hbm_promotion.py)
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()
    cache.check()


def test_a_pin_retains_without_locking_and_ends_at_its_time(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=0.5)  # 4 of the 8 device pages
    serve(cache, seq(0, 2))
    node = cache.match(seq(0, 2), touch=False).last_node
    base = node.lock_ref
    ctl.hints.apply(Hint("pin", tuple(seq(0, 2)), ttl_s=5.0), seq(0, 2))
    assert node.lock_ref == base and ctl.hints.pins == 1  # advice, never a lock
    clock.t = 14.0
    for i in range(3):  # other prompts come and go: the retained one is refreshed past them
        serve(cache, seq(1000 * (i + 1), 2))
        ctl.pump_writeback(start_new=False)
    assert node.last_access >= 14.0
    clock.t = 15.0
    ctl.pump_writeback(start_new=False)  # its time is up
    assert ctl.hints.pins == 0 and ctl.hints.pinned_tokens == 0 and ctl.hints.retained_wasted == 1
    ctl.hints.apply(Hint("retain", tuple(seq(0, 2)), ttl_s=5.0), seq(0, 2))
    ctl.shutdown()  # and nothing outlives the controller
    assert node.lock_ref == base and ctl.hints.pins == 0
    cache.check()


def test_a_conversation_that_comes_back_short_of_its_last_page_ends_its_retention(tmp_path):
    # the next turn re-renders the answer's end: it matches all but the retained prefix's last page,
    # which splits the retained node; that is a return (it ends the retention, counted as used)
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(max_pin_share=1.0)
    serve(cache, seq(0, 3))
    ctl.hints.apply(Hint("pin", tuple(seq(0, 3)), ttl_s=60.0), seq(0, 3))
    clock.t = 11.0
    ctl.pump_writeback(start_new=False)
    assert ctl.hints.pins == 1  # nothing came back yet
    serve(cache, seq(0, 2) + seq(900, 1))
    clock.t = 12.0
    ctl.pump_writeback(start_new=False)
    assert ctl.hints.pins == 0 and ctl.hints.retained_used == 1 and ctl.hints.retained_wasted == 0
    serve(cache, seq(0, 3))
    ctl.hints.apply(Hint("pin", tuple(seq(0, 3)), ttl_s=60.0), seq(0, 3))
    serve(cache, seq(5000, 1))  # another prompt: not a return
    clock.t = 13.0
    ctl.pump_writeback(start_new=False)
    assert ctl.hints.pins == 1 and ctl.hints.retained_used == 1
    cache.check()


def test_a_retained_prefix_yields_to_a_request_that_needs_the_room(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=1.0, max_pin_share=1.0)
    serve(cache, seq(0, 2))
    node = cache.match(seq(0, 2), touch=False).last_node
    ctl.hints.apply(Hint("pin", tuple(seq(0, 2)), ttl_s=60.0), seq(0, 2))
    ctl.pump_writeback(start_new=False)
    big = seq(5000, cache.stores[DEVICE].capacity_pages)  # needs every device page
    serve(cache, big)
    assert node.device is None and cache.match(big, touch=False).device_tokens == len(big)
    cache.check()


def test_retention_keeps_within_its_share_of_each_tier(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=0.25, max_pin_share=0.5)  # 2 device pages, 4 host pages
    a, b = seq(0, 2), seq(100, 2)
    serve(cache, a)
    serve(cache, b)
    ctl.hints.apply(Hint("retain", tuple(a), ttl_s=30.0), a)  # ends first: kept first
    ctl.hints.apply(Hint("retain", tuple(b), ttl_s=60.0), b)
    clock.t = 20.0
    ctl.pump_writeback(start_new=False)
    na, nb = cache.match(a, touch=False).last_node, cache.match(b, touch=False).last_node
    assert na.last_access == 20.0 and nb.last_access < 20.0  # b is past the device share: it ages
    assert ctl.hints.refreshed_tokens[DEVICE] == 2 * PS


def test_retained_prefixes_leave_in_the_order_they_are_expected_back(tmp_path):
    # all retained pages are refreshed at once; when room is needed among them, the retention that
    # ends last goes first (not whichever the tie between equal recencies picks)
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=1.0, max_pin_share=1.0)
    sooner, later = seq(0, 2), seq(100, 2)
    serve(cache, sooner)  # the older node: a tie on recency would take it first
    serve(cache, later)
    ctl.hints.apply(Hint("retain", tuple(sooner), ttl_s=30.0), sooner)
    ctl.hints.apply(Hint("retain", tuple(later), ttl_s=60.0), later)
    clock.t = 20.0
    ctl.pump_writeback(start_new=False)
    n_sooner, n_later = cache.match(sooner, touch=False).last_node, cache.match(later, touch=False).last_node
    assert n_sooner.last_access == 20.0 > n_later.last_access > 19.0
    assert cache.evict(DEVICE, 2) == 2
    assert n_later.device is None and n_sooner.device is not None
    cache.check()


def test_a_retention_held_past_when_the_others_came_back_is_overdue(tmp_path):
    # the client's retentions come back about 1 s after they start; one held for 10 s is overdue:
    # it counts against the precision, and a fresh retention is kept ahead of it although it asked
    # to be kept longer (a client retaining what never comes back loses its share in seconds)
    from sgl_hicache.control.hint_desk import MIN_RETURNS

    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=1.0, max_pin_share=1.0)
    for i in range(MIN_RETURNS):
        p = seq(1000 + 10 * i, 1)
        serve(cache, p)
        ctl.hints.apply(Hint("retain", tuple(p), ttl_s=30.0), p)
        clock.t += 1.0
        serve(cache, p)  # it came back
        ctl.pump_writeback(start_new=False)
        clock.t += 0.5
    assert ctl.hints.retained_used == MIN_RETURNS and ctl.hints.overdue == 0
    stale, fresh = seq(0, 2), seq(100, 2)
    serve(cache, stale)
    serve(cache, fresh)
    ctl.hints.apply(Hint("retain", tuple(stale), ttl_s=30.0), stale)  # ends first: kept first, while on time
    clock.t += 10.0
    ctl.hints.apply(Hint("retain", tuple(fresh), ttl_s=60.0), fresh)
    clock.t += 0.5
    ctl.pump_writeback(start_new=False)
    n_stale, n_fresh = cache.match(stale, touch=False).last_node, cache.match(fresh, touch=False).last_node
    assert ctl.hints.overdue == 1 and ctl.hints.precision() == MIN_RETURNS / (MIN_RETURNS + 1)
    assert n_fresh.last_access == clock.t > n_stale.last_access
    cache.check()


def test_a_retention_over_the_device_share_lands_on_host_as_just_used(tmp_path):
    # a conversation larger than the device share ages out of the device; the eviction that takes it
    # off makes it just used, so the host keeps it ahead of older unhinted pages in the same evictions
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=0.1, max_pin_share=0.5)  # device: 0 pages; host: 4 pages
    conv, other = seq(0, 3), seq(100, 2)
    serve(cache, conv)
    clock.t = 11.0
    serve(cache, other)  # newer than the conversation
    ctl.pump_writeback()
    ex.finish_all(list(ctl.writeback))
    ctl.pump_writeback(start_new=False)  # both have host copies now
    node = cache.match(conv, touch=False).last_node
    ctl.hints.apply(Hint("retain", tuple(conv), ttl_s=60.0), conv)
    node.last_access = 10.0  # as if retained long ago: only the host share keeps it now
    clock.t = 20.0
    ctl.pump_writeback(start_new=False)  # the refresh: past the device share, kept for host
    assert node.last_access == 10.0 and node.keep_until > 20.0 and ctl.hints.refreshed_tokens[HOST] == 3 * PS
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    assert node.device is None and node.host is not None and node.last_access == 20.0
    other_node = cache.match(other, touch=False).last_node
    cache.evict(HOST, 2)  # the host's oldest goes first: the unhinted prompt, not the retained one
    assert other_node.host is None and node.host is not None
    ctl.hints.apply(Hint("demote", tuple(conv)), conv)  # and a conversation that ends is kept no longer
    assert node.keep_until == 0.0
    cache.check()


def test_demote_ends_the_retention_of_its_conversation(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(max_pin_share=1.0)
    serve(cache, seq(0, 3))
    ctl.hints.apply(Hint("pin", tuple(seq(0, 3)), ttl_s=60.0), seq(0, 3))
    ctl.hints.apply(Hint("demote", tuple(seq(0, 2))), seq(0, 2))  # the conversation ends at its head
    assert ctl.hints.pins == 0 and ctl.hints.pinned_tokens == 0


def test_hostile_hints_are_refused_and_counted_by_reason(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(max_retained=2, max_hints_per_s=10.0, burst=5)
    serve(cache, seq(0, 1))
    with pytest.raises(HintError, match="'ttl_s' of 1e\\+06 s exceeds"):
        ctl.hints.apply(Hint("retain", tuple(seq(0, 1)), ttl_s=1e6), seq(0, 1))
    for _ in range(2):
        ctl.hints.apply(Hint("retain", tuple(seq(0, 1)), ttl_s=30.0), seq(0, 1))
    with pytest.raises(HintError, match="2 prefixes are retained already"):
        ctl.hints.apply(Hint("retain", tuple(seq(0, 1)), ttl_s=30.0), seq(0, 1))
    refused = 0
    for _ in range(20):  # a flood in one instant: the bucket (5) is spent, the rest refused
        try:
            ctl.hints.apply(Hint("retain", tuple(seq(0, 1))), seq(0, 1))
        except HintError as e:
            assert "hints per second" in str(e)
            refused += 1
    assert refused == 19 and ctl.hints.refused == {"limit": 1, "flood": 20}
    assert ctl.hints.rejected == 21


def test_an_oversized_or_overlong_pin_is_refused(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(max_ttl_s=60.0, max_pin_share=0.25)  # 25 % of an 8-page host: 2 pages
    serve(cache, seq(0, 3))
    with pytest.raises(HintError, match="over 25% of the 32-token host tier"):
        ctl.hints.apply(Hint("pin", tuple(seq(0, 3)), ttl_s=10.0), seq(0, 3))
    with pytest.raises(HintError, match="exceeds the longest allowed, 60 s"):
        ctl.hints.apply(Hint("pin", tuple(seq(0, 1)), ttl_s=61.0), seq(0, 1))
    assert ctl.hints.rejected == 2 and ctl.hints.pins == 0
    with pytest.raises(HintError, match="at least one whole page"):
        ctl.hints.apply(Hint("prefetch", (1,)), [1])


def test_retain_and_demote_move_the_prefix_in_the_eviction_order(tmp_path):
    clock = Clock(10.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    a, b = seq(0, 2), seq(500, 2)
    serve(cache, a)
    clock.t = 20.0
    serve(cache, b)
    na, nb = cache.match(a, touch=False).last_node, cache.match(b, touch=False).last_node
    clock.t = 30.0
    ctl.hints.apply(Hint("retain", tuple(a)), a)  # a is now the more recent
    assert na.last_access == 30.0 and cache.priority(na) > cache.priority(nb)
    ctl.hints.apply(Hint("demote", tuple(a)), a)  # and now the first to go
    assert cache.priority(na) < cache.priority(nb)
    cache.evict(DEVICE, 2)
    assert na.device is None and nb.device is not None
    cache.check()


def _engine():
    """An embedded engine (llama3-8b on the H200 cost model) with room on every tier."""
    from sgl_hicache.sim.presets import get_hardware, get_model
    from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig

    cfg = EngineConfig(
        policy="prefetch",
        model=get_model("llama3-8b"),
        hardware=get_hardware("h200"),
        device_tokens=16_384,
        host_tokens=32_768,
        disk_tokens=1_000_000,
        concurrency=None,
        byte_mode="metadata",
    )
    return EmbeddedEngine(cfg)


def test_the_engine_replays_hints_through_the_controller():
    from sgl_hicache.replay.shapes import chain, role_of

    out = {}
    for hints in (False, True):
        reqs = chain(sessions=12, turn_tokens=2048, hints=hints)
        role = {r.arrival_s: role_of(r) for r in reqs}
        eng = _engine()
        eng.run(reqs)
        eng.cache.check()
        ttft = [t for a, t in zip(eng.records.arrival_s, eng.records.ttft_s) if role[a] == "cont"]
        out[hints] = (
            sum(ttft) / len(ttft),
            eng.controller.hints.counts["prefetch"],
            eng.hints_rejected,
            eng.cache.stats.triggers["hint"]["used_tokens"],
        )
        eng.close()
    assert out[False][1] == 0 and out[True][1] == 12 and out[True][2] == 0
    assert out[True][3] > 0 and out[True][0] < out[False][0]  # the client's word got the history up in time


def test_the_engine_runs_an_at_finish_hint_when_its_request_ends():
    # a request's own retention (``agent_hints``) starts when its answer is complete, on the server and
    # in a replay alike; an arrival-relative hint runs at arrival + after_s
    from array import array

    from sgl_hicache.replay.trace import Request

    prompt = tuple(range(1, 4097))
    hints = (Hint("pin", prompt, ttl_s=30.0, at_finish=True), Hint("retain", prompt, ttl_s=30.0, after_s=0.001))
    later = array("q", range(5000, 5256))  # the replay goes on after a/1 ends
    reqs = [Request("a/1", "a", 0.0, array("q", prompt), 200, 1, hints=hints), Request("b/1", "b", 60.0, later, 4, 2)]
    eng = _engine()
    applied: list[tuple[str, float]] = []
    apply = eng.controller.hints.apply

    def spy(hint, tokens):
        applied.append((hint.action, eng.now))
        return apply(hint, tokens)

    eng.controller.hints.apply = spy
    eng.run(reqs)
    finish = eng.records.finish_s[0]
    eng.close()
    assert [a for a, _ in applied] == ["retain", "pin"], applied
    assert applied[0][1] <= eng.records.arrival_s[0] + eng.records.ttft_s[0]  # by its first step
    assert applied[1][1] >= finish > eng.records.ttft_s[0]  # once its 200 tokens were decoded


@pytest.mark.parametrize("others_return", [True, False])
def test_a_retention_ranks_against_what_the_unhinted_pages_are_worth(tmp_path, others_return):
    # Where the other conversations come back within ~2 s, a prefix the client wants back in 100 s
    # is worth less per second held than a page used a second ago: it ranks behind it. Where the
    # other prompts never come back, it ranks ahead of every unhinted page, as just used.
    clock = Clock(0.0)
    cache, _ex, ctl = _controller(tmp_path, clock)
    ctl.hints.limits = HintLimits(device_share=1.0, max_pin_share=1.0)
    cache.learn_reuse()  # the hint desk's model (made at its first hint), learning from the start
    for i in range(40):
        first = seq(1000 * (i + 1), 1)
        serve(cache, first)
        clock.t += 2.0
        if others_return:
            serve(cache, first + seq(1000 * (i + 1) + 500, 1))
    retained, unhinted = seq(0, 2), seq(100, 2)
    serve(cache, retained)
    ctl.hints.apply(Hint("retain", tuple(retained), ttl_s=100.0), retained)
    clock.t += 1.0
    serve(cache, unhinted)
    clock.t += 1.0
    ctl.pump_writeback(start_new=False)
    n_retained = cache.match(retained, touch=False).last_node
    n_unhinted = cache.match(unhinted, touch=False).last_node
    if others_return:
        assert n_retained.last_access < n_unhinted.last_access
    else:
        assert n_retained.last_access == clock.t > n_unhinted.last_access
    cache.check()


def _turns_with_pauses(tmp_path, clock, learn: bool, pauses: tuple[float, ...]):
    """A controller (`learn_returns=learn`) that served one conversation whose turns came `pauses`
    apart (each turn's prompt one page longer); returns (cache, executor, controller, last prompt)."""
    cache, ex, _ = _controller(tmp_path, clock)
    ctl = RequestController(cache, ex, Predictor(), ControllerSettings(learn_returns=learn), clock)
    prompt = seq(0, 1)
    for turn, pause in enumerate((*pauses, 0.0)):
        ctl.arrive(prompt)
        prompt = prompt + seq(100 * (turn + 1), 1)
        serve(cache, prompt)
        path = cache.match(prompt, touch=False).path
        ctl.commit(path)
        ctl.finished(path)  # what it ended in unknown: the pauses' median
        clock.t += pause
    return cache, ex, ctl, prompt


@pytest.mark.parametrize("learn", [True, False])
def test_the_server_retains_a_conversation_for_the_pause_its_history_predicts(tmp_path, learn):
    # no client hint: a conversation that came back 2 s and 4 s after its last two turns is retained
    # at its next end for the median pause with the clients' margin; with learning off, nothing is
    clock = Clock(0.0)
    cache, _ex, ctl, prompt = _turns_with_pauses(tmp_path, clock, learn, (2.0, 4.0))
    assert ctl.hints.counts == dict.fromkeys(("prefetch", "pin", "retain", "demote"), 0)  # no client hint
    if not learn:
        assert ctl.hints.pins == 0 and ctl.hints.summary()["learned"]["retained"] == 0
        return
    assert ctl.hints.pins == 1 and ctl.hints.summary()["learned"]["retained"] == 1
    (r,) = ctl.hints._retained
    assert r.learned and r.until == pytest.approx(clock.t + 3.0 * 1.25)
    clock.t += 1.0
    ctl.arrive(prompt + seq(900, 1))  # it came back: the retention ends at the next expiry, used
    serve(cache, prompt + seq(900, 1))
    clock.t += 0.5
    ctl.hints.expire()
    assert ctl.hints.pins == 0 and ctl.hints.summary()["learned"]["used"] == 1
    assert ctl.hints.retained_used == 0  # the clients' precision counts only the clients' retentions


def test_the_servers_retention_brings_a_conversation_back_up_before_it_is_due(tmp_path):
    # its pages left for disk during the pause: 2 s before the predicted return they come back up
    # to host, as a guarded speculative job (the one a client's prefetch would start)
    clock = Clock(0.0)
    cache, ex, ctl, prompt = _turns_with_pauses(tmp_path, clock, True, (5.0, 5.0))
    (r,) = ctl.hints._retained
    assert r.prefetch_at == pytest.approx(clock.t + 5.0 - 2.0)
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    assert cache.match(prompt, touch=False).disk_tokens == len(prompt)
    clock.t = r.prefetch_at - 0.5
    ctl.hints.expire()
    assert not ctl.predicted and ctl.hints.learned["prefetched"] == 0  # not yet due
    clock.t = r.prefetch_at + 0.5
    ctl.hints.expire()
    assert ctl.predicted and ctl.hints.learned["prefetched"] == 1
    while ctl.predicted:  # up to host, and on to the device, which has room
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()
    assert cache.match(prompt, touch=False).disk_tokens == 0
    cache.check()
