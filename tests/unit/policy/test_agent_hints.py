"""Hints that travel with the request (`custom_params["agent_hints"]`): every malformed field refused
with a message naming it; a tool call's retention, a conversation's end and a prefetch by handle
applied through the controller's `HintDesk` (the scheduler's calls, with a stand-in request)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import serve
from test_hints import _controller
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.policy.agent_hints import TTL_MARGIN, AgentHints, parse_agent_hints
from sgl_hicache.policy.hint_rules import HintError
from sgl_hicache.sglang.hints.request_hints import RequestHints
from sgl_hicache.tiers.base import DEVICE, HOST


def test_the_schema_parses():
    hints = parse_agent_hints(
        {
            "agent_hints": {
                "workflow_id": "wf",
                "agent_id": "a",
                "step_id": 3,
                "tool_name": "pytest",
                "expected_tool_duration_ms": 8000,
                "parent_step_id": "2",
                "child_step_ids": [4, "5"],
            },
            "other": 1,
        }
    )
    assert hints == AgentHints(retain_s=10.0, session="wf/a", tool_name="pytest", step_id="3")
    assert (
        parse_agent_hints({"agent_hints": {"cache_ttl_ms": 30000, "expected_tool_duration_ms": 8000}}).retain_s == 30.0
    )
    assert parse_agent_hints({"agent_hints": {"reuse_hint": "end"}}).end
    assert parse_agent_hints({"agent_hints": {"prefetch": "req-1"}}).prefetch == "req-1"
    assert parse_agent_hints(None) is None and parse_agent_hints({"thinking_budget": 5}) is None


@pytest.mark.parametrize(
    "obj, field",
    [
        ([1], "agent_hints must be an object"),
        ({"ttl": 5}, "unknown field(s) ttl"),
        ({"workflow_id": 7}, "agent_hints.workflow_id must be a string"),
        ({"agent_id": ""}, "agent_hints.agent_id must be a string"),
        ({"step_id": True}, "agent_hints.step_id must be a string or an integer"),
        ({"tool_name": "x" * 300}, "agent_hints.tool_name must be a string"),
        ({"expected_tool_duration_ms": -1}, "agent_hints.expected_tool_duration_ms must be a finite number"),
        ({"expected_tool_duration_ms": float("nan")}, "agent_hints.expected_tool_duration_ms must be a finite number"),
        ({"cache_ttl_ms": 0}, "agent_hints.cache_ttl_ms must be a finite number of milliseconds > 0"),
        ({"cache_ttl_ms": "60"}, "agent_hints.cache_ttl_ms must be a finite number"),
        ({"reuse_hint": "forever"}, "agent_hints.reuse_hint must be one of retain, end, none"),
        ({"reuse_hint": "end", "cache_ttl_ms": 5}, "agent_hints.reuse_hint 'end' contradicts"),
        ({"prefetch": 5}, "agent_hints.prefetch must be a string"),
        ({"child_step_ids": "4"}, "agent_hints.child_step_ids must be a list"),
    ],
)
def test_every_malformed_field_is_refused_by_name(obj, field):
    with pytest.raises(HintError) as err:
        parse_agent_hints({"agent_hints": obj})
    assert field in str(err.value)


class _Req(SimpleNamespace):
    def finished(self) -> bool:
        return self.done

    def set_finish_with_abort(self, message: str) -> None:
        self.aborted = message


def _req(rid, prompt, output=(), salt=None, extra_key=None, kv=None, **agent_hints):
    """A finished request carrying `agent_hints` (or the ``kv_hints`` envelope `kv`), with SGLang's
    ``cache_salt`` / ``extra_key``."""
    params = {"kv_hints": kv} if kv else ({"agent_hints": agent_hints} if agent_hints else None)
    return _Req(
        rid=rid,
        origin_input_ids=list(prompt),
        output_ids=list(output),
        done=True,
        aborted=None,
        cache_salt=salt,
        extra_key=extra_key,
        sampling_params=SimpleNamespace(custom_params=params),
    )


def _served(tmp_path):
    """A controller's cache holding one conversation (a page of prompt, a page of answer), and the
    `RequestHints` on its desk: (clock, cache, executor, controller, hints, prompt, answer)."""
    clock = Clock(10.0)
    cache, ex, ctl = _controller(tmp_path, clock)
    prompt, answer = seq(0, 1), seq(50, 1)
    serve(cache, prompt + answer)
    return clock, cache, ex, ctl, RequestHints(cache, ctl.hints), prompt, answer


def test_a_request_retains_its_conversation_ends_it_and_prefetches_it_by_handle(tmp_path):
    clock, cache, ex, ctl, rh, prompt, answer = _served(tmp_path)
    req = _req("r1", prompt, answer, workflow_id="wf", agent_id="a", expected_tool_duration_ms=4000)
    rh.on_arrival(req)
    rh.on_finish(req)
    assert ctl.hints.counts["retain"] == 1 and ctl.hints.pins == 1 and ctl.hints.pinned_tokens == 2 * PS
    assert set(rh.handles) == {(("", ""), "r1"), (("", ""), "wf/a")}  # in the empty namespace
    clock.t = 16.0  # 4 s x 1.25: over
    ctl.pump_writeback(start_new=False)
    assert ctl.hints.pins == 0
    # the conversation goes to disk; a prefetch naming it by its session key brings it up
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    assert cache.match(prompt + answer, touch=False).disk_tokens == 2 * PS
    rh.on_arrival(_req("r2", seq(900, 1), prefetch="wf/a"))
    assert ctl.hints.counts["prefetch"] == 1 and ctl.predicted
    ex.finish_all([op for job in ctl.predicted for op in job.ops()])
    ctl.advance_predictions()
    assert cache.match(prompt + answer, touch=False).host_tokens == 2 * PS
    while ctl.predicted:  # and on to the device, which has room (`Speculation.carry`)
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()
    assert cache.match(prompt + answer, touch=False).device_tokens == 2 * PS
    # "this one ends here": demoted when it ends
    req = _req("r3", prompt, answer, reuse_hint="end")
    rh.on_arrival(req)
    rh.on_finish(req)
    assert ctl.hints.counts["demote"] == 1
    cache.check()


def test_malformed_and_unknown_hints_are_refused_and_counted(tmp_path):
    clock = Clock(10.0)
    cache, _, ctl = _controller(tmp_path, clock)
    rh = RequestHints(cache, ctl.hints)
    bad = _req("r1", seq(0, 1), cache_ttl_ms=-5)
    rh.on_arrival(bad)
    assert "agent_hints.cache_ttl_ms" in bad.aborted and rh.aborted == 1
    unknown = _req("r2", seq(0, 1), prefetch="nobody")
    rh.on_arrival(unknown)
    assert unknown.aborted is None  # it runs as it would without the hint
    assert (
        ctl.hints.refused == {"malformed": 1, "unknown": 1} and "unknown handle 'nobody'" in rh.status()["last_error"]
    )
    huge = _req("r3", seq(0, 1), cache_ttl_ms=1e9)
    serve(cache, seq(0, 1))
    rh.on_arrival(huge)
    rh.on_finish(huge)
    assert ctl.hints.refused["limit"] == 1 and ctl.hints.pins == 0


def test_the_agent_shape_with_pins_keeps_its_requests_and_estimates_with_noise():
    from sgl_hicache.replay.shapes import agent

    plain = agent(sessions=3, steps=4)
    pinned = agent(sessions=3, steps=4, pins=True, estimate_sigma=0.5)
    assert [(r.request_id, r.arrival_s, list(r.input_ids)) for r in plain] == [
        (r.request_id, r.arrival_s, list(r.input_ids)) for r in pinned
    ]
    hinted = [r for r in pinned if r.hints]
    assert len(hinted) == 3 * 3  # every step followed by a tool call
    by_id = {r.request_id: r for r in pinned}
    errors = []
    for r in hinted:
        pin, prefetch = r.hints
        # both run when the step's request finishes (the tool starts then), as the server applies them
        assert pin.action == "pin" and pin.input_ids == tuple(r.input_ids) and pin.at_finish and pin.after_s == 0
        estimate = pin.ttl_s / TTL_MARGIN  # the server's margin on an expected tool duration
        assert prefetch.action == "prefetch" and prefetch.at_finish
        if pin.ttl_s > 1.0:  # (the server keeps at least 1 s)
            assert prefetch.after_s == pytest.approx(max(0.0, estimate - 2.0), abs=1e-5)  # 2 s before it ends
        s, k = r.request_id.rsplit("/", 1)
        step = 0 if k == "start" else int(k[len("resume") :])
        true_tool = by_id[f"{s}/resume{step + 1}"].arrival_s - r.arrival_s - 2.0
        errors.append(estimate / true_tool)
    assert any(abs(e - 1) > 0.05 for e in errors)  # the framework's estimates are noisy
