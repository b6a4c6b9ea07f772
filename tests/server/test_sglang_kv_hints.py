"""The ``kv_hints`` envelope end to end at ``--tp 2``: a real SGLang 0.5.23 server on CPU
(`--radix-cache-backend sgl_hicache`, consensus check on), the envelope sent in ``custom_params``
through ``/generate`` and the OpenAI API's ``/v1/completions``, its effect read from the stats:

- Retain (with a ``session_id``), Share, Prefetch of that session and Demote are applied on both
  ranks alike (a difference in their trees would stop the server), counted in the stats;
- a Prefetch naming that session from another namespace (a ``cache_salt``) is refused as unknown
  and applies nothing;
- a malformed envelope, or one beside ``agent_hints``, is refused with a 400 naming the field, from
  both APIs, and the server keeps serving.
"""

from __future__ import annotations

import shutil
import urllib.error

import pytest
from test_sglang_agent_hints import TP_ENV, _hints, _refusal, _servers
from test_sglang_e2e import _prompt, _settled_pool, make_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("kv_hints_e2e")
    servers = _servers(work, make_model(work / "model"))
    try:
        yield servers.start("tp2", work / "disk", tp=2, **TP_ENV)
    finally:
        servers.close()
        shutil.rmtree(work, ignore_errors=True)


def _env(*actions: tuple[str, dict]) -> dict:
    return {
        "protocol_version": "0.1",
        "message_id": "m",
        "actions": [
            {"action_id": f"a{i}", "action_type": kind, "action_version": "0.1", "payload": payload}
            for i, (kind, payload) in enumerate(actions)
        ],
    }


def _generate(srv, ids, kv: dict, n: int = 4, **extra) -> dict:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, "custom_params": {"kv_hints": kv}}
    return srv.post("/generate", {"input_ids": list(ids), "sampling_params": params, **extra})


def _complete(srv, ids, kv: dict, n: int = 4) -> None:
    """`/v1/completions` with the envelope. The test server has no tokenizer (`--skip-tokenizer-init`),
    so the OpenAI layer cannot render the reply's text and answers 500 after the scheduler ran the
    request (and its hints): the effect is read from the stats, never from this reply."""
    body = {"model": "default", "prompt": list(ids), "max_tokens": n, "temperature": 0.0}
    try:
        srv.post("/v1/completions", {**body, "custom_params": {"kv_hints": kv}})
    except urllib.error.HTTPError as e:
        assert e.code == 500, e.code


def test_the_envelopes_actions_apply_on_both_ranks_within_the_senders_namespace(server):
    conv = _prompt(80, 320)
    before = _hints(server)
    r = _generate(server, conv, _env(("Retain", {"ttl_ms": 60_000, "session_id": "wf/kv"}), ("Share", {})))
    assert r["meta_info"]["finish_reason"]["type"] != "abort", r["meta_info"]
    st = _hints(server)
    assert st["applied"]["retain"] == before["applied"]["retain"] + 1 and st["retained"] >= 1, st
    assert st["requests"]["with_kv_hints"] == before["requests"]["with_kv_hints"] + 1
    assert st["requests"]["shares_ignored"] == before["requests"]["shares_ignored"] + 1
    # another namespace names the session: refused as unknown, nothing applied
    _generate(server, _prompt(81, 32), _env(("Prefetch", {"handle": "wf/kv"})), n=1, cache_salt="tenant-b")
    st = _hints(server)
    assert st["refused"].get("unknown", 0) == before["refused"].get("unknown", 0) + 1, st
    assert st["applied"]["prefetch"] == before["applied"]["prefetch"], st
    # its own namespace, through the OpenAI API: applied
    _complete(server, _prompt(82, 32), _env(("Prefetch", {"handle": "wf/kv"})), n=1)
    assert _hints(server)["applied"]["prefetch"] == before["applied"]["prefetch"] + 1
    _complete(server, conv, _env(("Demote", {"session_id": "wf/kv"})))
    st = _settled_pool(server)
    assert st["agent_hints"]["applied"]["demote"] == before["applied"]["demote"] + 1
    assert st["backend"]["tp"]["digests_checked"] > 0  # both ranks' trees compared every step: no divergence


@pytest.mark.parametrize(
    "custom, field",
    [
        ({"kv_hints": {**_env(("Demote", {})), "protocol_version": "9"}}, "kv_hints.protocol_version '9'"),
        ({"kv_hints": _env(("Retain", {"ttl_ms": -1}))}, "kv_hints.actions[0].payload.ttl_ms"),
        ({"kv_hints": _env(("Evict", {}))}, "kv_hints.actions[0].action_type"),
        ({"kv_hints": _env(("Demote", {})), "agent_hints": {}}, "send agent_hints or kv_hints, not both"),
    ],
)
def test_a_malformed_envelope_is_refused_with_the_field_named(server, custom, field):
    ids = _prompt(90, 40)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "custom_params": custom}}
    assert field in _refusal(server, "/generate", body)
    body = {"model": "default", "prompt": ids, "max_tokens": 2, "custom_params": custom}
    assert field in _refusal(server, "/v1/completions", body)
    assert server.alive()
    r = _generate(server, ids, _env(("Share", {})), n=2)  # and it keeps serving
    assert len(r["output_ids"]) == 2
