"""The ``kv_hints`` envelope end to end at ``--tp 2``: a real SGLang 0.5.23 server on CPU
(`--radix-cache-backend sgl_hicache`, consensus check on, the tiny Llama with its tokenizer), the
envelope sent in ``custom_params`` through ``/generate`` and, with the ``openai`` client, the OpenAI
API's ``/v1/completions`` and ``/v1/chat/completions``, its effect read from the stats:

- Retain (with a ``session_id``), Share, Prefetch of that session and Demote are applied on both
  ranks alike (a difference in their trees would stop the server), counted in the stats;
- a Prefetch naming that session from another namespace (a ``cache_salt``) is refused as unknown
  and applies nothing;
- a malformed envelope, or one beside ``agent_hints``, is refused with a 400 naming the field, from
  all three, and the server keeps serving;
- both hint kinds through the OpenAI client's chat completions and ``/generate``, applied and
  refused alike (`_check_hint_kinds_through_both_apis`, the same check the TP 1 server runs).
"""

from __future__ import annotations

import shutil

import pytest
from test_sglang_agent_hints import (
    TP_ENV,
    _check_hint_kinds_through_both_apis,
    _client,
    _env,
    _generate,
    _hints,
    _refusals,
    _servers,
)
from test_sglang_e2e import _prompt, _settled_pool, make_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("kv_hints_e2e")
    servers = _servers(work, make_model(work / "model", tokenizer=True))
    try:
        yield servers.start("tp2", work / "disk", tp=2, **TP_ENV)
    finally:
        servers.close()
        shutil.rmtree(work, ignore_errors=True)


def _complete(srv, ids, kv: dict, n: int = 4) -> None:
    """`/v1/completions` with the envelope, through the OpenAI client."""
    reply = _client(srv).completions.create(
        model="default", prompt=list(ids), max_tokens=n, temperature=0.0, extra_body={"custom_params": {"kv_hints": kv}}
    )
    assert reply.usage.completion_tokens >= 1, reply


def test_the_envelopes_actions_apply_on_both_ranks_within_the_senders_namespace(server):
    conv = _prompt(80, 320)
    before = _hints(server)
    _generate(server, conv, {"kv_hints": _env(("Retain", {"ttl_ms": 60_000, "session_id": "wf/kv"}), ("Share", {}))})
    st = _hints(server)
    assert st["applied"]["retain"] == before["applied"]["retain"] + 1 and st["retained"] >= 1, st
    assert st["requests"]["with_kv_hints"] == before["requests"]["with_kv_hints"] + 1
    assert st["requests"]["shares_ignored"] == before["requests"]["shares_ignored"] + 1
    # another namespace names the session: refused as unknown, nothing applied
    _generate(
        server, _prompt(81, 32), {"kv_hints": _env(("Prefetch", {"handle": "wf/kv"}))}, n=1, cache_salt="tenant-b"
    )
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
    for text in _refusals(server, custom):
        assert field in text, text
    assert server.alive()
    r = _generate(server, _prompt(90, 40), {"kv_hints": _env(("Share", {}))}, n=2)  # and it keeps serving
    assert len(r["output_ids"]) == 2


def test_both_hint_kinds_apply_on_both_ranks_through_the_openai_client_and_generate(server):
    _check_hint_kinds_through_both_apis(server)
    assert _settled_pool(server)["backend"]["tp"]["digests_checked"] > 0
