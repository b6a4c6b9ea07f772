"""The ``kv_hints`` envelope (`policy/kv_hints.py`): each action mapped onto the `AgentHints` the
``agent_hints`` object gives, versions checked, bounds kept, every malformed field refused by name;
and the namespace rule of handles (`request_hints.namespace`): a prefetch naming another
namespace's handle is refused as unknown and moves nothing."""

from __future__ import annotations

import pytest
from test_agent_hints import _req, _served
from test_hints import _controller
from test_oracle_reuse import PS, Clock, seq

from sgl_hicache.policy.agent_hints import AgentHints
from sgl_hicache.policy.hint_rules import HintError
from sgl_hicache.policy.kv_hints import MAX_ACTIONS, parse_hints, parse_kv_hints
from sgl_hicache.sglang.hints.request_hints import RequestHints
from sgl_hicache.tiers.base import DEVICE, HOST


def _env(*actions, **fields) -> dict:
    return {"protocol_version": "0.1", "message_id": "m1", "actions": list(actions), **fields}


def _act(kind: str, i: int = 0, **payload) -> dict:
    return {"action_id": f"a{i}", "action_type": kind, "action_version": "0.1", "payload": payload}


def test_each_action_maps_onto_the_agent_hints_form():
    assert parse_kv_hints(_env(_act("Retain", ttl_ms=30000, session_id="wf/a"))) == AgentHints(
        retain_s=30.0, session="wf/a", message_id="m1", envelope=True
    )
    assert parse_kv_hints(_env(_act("Pin", ttl_ms=5000))).retain_s == 5.0  # pin = retain: advice, never a lock
    assert parse_kv_hints(_env(_act("Demote", session_id="s"))) == AgentHints(
        end=True, session="s", message_id="m1", envelope=True
    )
    both = parse_kv_hints(_env(_act("Retain", 0, ttl_ms=1000), _act("Prefetch", 1, handle="wf/b")))
    assert both.retain_s == 1.0 and both.prefetch == "wf/b" and not both.end
    share = parse_kv_hints(_env(_act("Share", 0, anything=1), _act("Share", 1)))
    assert share.shares == 2 and share.retain_s is None and share.prefetch is None
    # action_version and message_id are optional; payload defaults to {} where nothing is required
    bare = {"protocol_version": "0.1", "actions": [{"action_id": "x", "action_type": "Demote"}]}
    assert parse_kv_hints(bare).end and parse_kv_hints(bare).message_id is None


def test_the_request_carries_one_form_or_the_other():
    assert parse_hints({"kv_hints": _env(_act("Demote"))}).envelope
    assert parse_hints({"agent_hints": {"reuse_hint": "end"}}) == AgentHints(end=True)
    assert parse_hints({"kv_hints": None}) is None and parse_hints(None) is None
    with pytest.raises(HintError, match="send agent_hints or kv_hints, not both"):
        parse_hints({"agent_hints": {}, "kv_hints": _env(_act("Demote"))})


@pytest.mark.parametrize(
    "env, field",
    [
        ([], "kv_hints must be an object"),
        ({**_env(_act("Demote")), "extra": 1}, "kv_hints: unknown field(s) extra"),
        ({"actions": [_act("Demote")]}, "kv_hints.protocol_version is required; supported: 0.1"),
        (_env(_act("Demote"), protocol_version="2.0"), "kv_hints.protocol_version '2.0' is not supported"),
        (_env(_act("Demote"), protocol_version=0.1), "kv_hints.protocol_version 0.1 is not supported"),
        (_env(_act("Demote"), message_id=""), "kv_hints.message_id must be a string"),
        (_env(_act("Demote"), message_id="m" * 300), "kv_hints.message_id must be a string of 1-256"),
        (_env(), "kv_hints.actions must be a list of 1-8 actions"),
        (_env(*[_act("Share", i) for i in range(MAX_ACTIONS + 1)]), "kv_hints.actions must be a list of 1-8"),
        (_env(actions={"a": 1}), "kv_hints.actions must be a list"),
        (_env("Demote"), "kv_hints.actions[0] must be an object"),
        (_env({**_act("Demote"), "when": 1}), "kv_hints.actions[0]: unknown field(s) when"),
        (_env({**_act("Demote"), "action_id": 7}), "kv_hints.actions[0].action_id must be a string"),
        (_env(_act("Share", 0), _act("Demote", 0)), "kv_hints.actions[1].action_id 'a0' repeats"),
        (_env(_act("Evict")), "kv_hints.actions[0].action_type must be one of Share, Prefetch, Demote, Pin, Retain"),
        (_env(_act("retain", ttl_ms=5)), "kv_hints.actions[0].action_type must be one of"),
        (
            _env({**_act("Demote"), "action_version": "9"}),
            "kv_hints.actions[0].action_version '9' is not supported; supported (strings): 0.1",
        ),
        (_env({**_act("Demote"), "payload": [1]}), "kv_hints.actions[0].payload must be an object"),
        (_env(_act("Retain")), "kv_hints.actions[0].payload.ttl_ms is required for Retain"),
        (_env(_act("Retain", ttl_ms=-1)), "kv_hints.actions[0].payload.ttl_ms must be a finite number"),
        (_env(_act("Pin", ttl_ms=0)), "kv_hints.actions[0].payload.ttl_ms must be a finite number of milliseconds > 0"),
        (_env(_act("Pin", ttl_ms="60")), "kv_hints.actions[0].payload.ttl_ms must be a finite number"),
        (_env(_act("Retain", ttl_ms=True)), "kv_hints.actions[0].payload.ttl_ms must be a finite number"),
        (_env(_act("Retain", ttl_ms=5, tll=1)), "kv_hints.actions[0].payload: unknown field(s) tll"),
        (_env(_act("Demote", session_id=5)), "kv_hints.actions[0].payload.session_id must be a string"),
        (_env(_act("Demote", ttl_ms=5)), "kv_hints.actions[0].payload: unknown field(s) ttl_ms"),
        (_env(_act("Prefetch")), "kv_hints.actions[0].payload.handle is required for Prefetch"),
        (_env(_act("Prefetch", handle="")), "kv_hints.actions[0].payload.handle must be a string"),
        (_env(_act("Prefetch", handle="h" * 257)), "kv_hints.actions[0].payload.handle must be a string"),
        (_env(_act("Prefetch", 0, handle="a"), _act("Prefetch", 1, handle="b")), "actions[1]: one Prefetch per"),
        (_env(_act("Retain", 0, ttl_ms=5), _act("Demote", 1)), "kv_hints.actions[1]: one of Retain, Pin, Demote"),
        (_env(_act("Share", 0, **{str(k): k for k in range(17)})), "kv_hints.actions[0].payload must be an object"),
    ],
)
def test_every_malformed_field_is_refused_by_name(env, field):
    with pytest.raises(HintError) as err:
        parse_hints({"kv_hints": env})
    assert field in str(err.value)
    assert err.value.reason == "malformed"


def test_a_handle_lives_in_its_senders_namespace(tmp_path):
    _, cache, ex, ctl, rh, prompt, answer = _served(tmp_path)
    req = _req("r1", prompt, answer, kv=_env(_act("Retain", ttl_ms=4000, session_id="wf/a")))
    rh.on_arrival(req)
    rh.on_finish(req)
    assert ctl.hints.counts["retain"] == 1 and rh.status()["with_kv_hints"] == 1
    cache.evict(DEVICE, cache.stores[DEVICE].capacity_pages)
    cache.evict(HOST, cache.stores[HOST].capacity_pages)
    # another namespace (a salt, a LoRA extra key) naming the handle: unknown, nothing moves
    for i, (salt, key) in enumerate((("s", None), (None, "lora-1"))):
        rh.on_arrival(_req(f"x{i}", seq(900, 1), salt=salt, extra_key=key, kv=_env(_act("Prefetch", handle="wf/a"))))
        rh.on_arrival(_req(f"y{i}", seq(900, 1), salt=salt, extra_key=key, prefetch="r1"))
    assert ctl.hints.refused == {"unknown": 4} and ctl.hints.counts["prefetch"] == 0 and not ctl.predicted
    assert rh.status()["last_error"] == "agent_hints.prefetch: unknown handle 'r1'"
    assert cache.match(prompt + answer, touch=False).disk_tokens == 2 * PS
    # a salted request's own retention or end acts on nothing (it is served without the cache), and it
    # records no handle that would name the shared tree's conversation
    salted = _req("r2", prompt, answer, salt="s", kv=_env(_act("Demote", session_id="wf/s")))
    rh.on_arrival(salted)
    rh.on_finish(salted)
    assert ctl.hints.counts["demote"] == 0 and rh.status()["uncached_namespace"] == 1
    assert {h for (_space, h) in rh.handles} == {"r1", "wf/a"}
    # the sender's own namespace finds it
    rh.on_arrival(_req("r3", seq(900, 1), kv=_env(_act("Prefetch", handle="wf/a"), _act("Share", 1))))
    assert ctl.hints.counts["prefetch"] == 1 and ctl.predicted and rh.status()["shares_ignored"] == 1
    while ctl.predicted:
        ex.finish_all([op for job in ctl.predicted for op in job.ops()])
        ctl.advance_predictions()
    assert cache.match(prompt + answer, touch=False).disk_tokens == 0
    cache.check()


def test_a_malformed_envelope_aborts_its_request_with_the_field_named(tmp_path):
    cache, _, ctl = _controller(tmp_path, Clock(10.0))
    rh = RequestHints(cache, ctl.hints)
    bad = _req("r1", seq(0, 1), kv=_env(_act("Retain", ttl_ms=-5)))
    rh.on_arrival(bad)
    assert "kv_hints.actions[0].payload.ttl_ms" in bad.aborted and rh.aborted == 1
    assert ctl.hints.refused == {"malformed": 1}
