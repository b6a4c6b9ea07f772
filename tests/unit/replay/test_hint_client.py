"""The HTTP replayer's side of the hint API (`replay/hint_client.py`), against the real listener
(`sglang/hint_server.HintListener`, no SGLang): a trace's hints are resolved as the embedded engine
resolves them, posted at their due time in due order, a refusal is counted with its reason, and a
hint API that does not answer fails the replay before anything is sent. The replay against a running
server is tests/server/test_sglang_hints_e2e.py."""

from __future__ import annotations

import time
from array import array

import pytest

from sgl_hicache.client.server import free_port
from sgl_hicache.policy.hint_rules import Hint
from sgl_hicache.replay.hint_client import (
    HintApiError,
    HintSender,
    ResolvedHint,
    hint_api_status,
    hint_api_url,
    resolve_hints,
)
from sgl_hicache.replay.http import ServerError, ServerModel, replay_http
from sgl_hicache.replay.trace import Request
from sgl_hicache.sglang.hints.hint_server import HintListener


def _req(rid: str, session: str, t: float, ids: list[int], hints: tuple = ()) -> Request:
    return Request(rid, session, t, array("q", ids), 4, 1, hints=hints)


@pytest.fixture
def listener():
    lst = HintListener(0, vocab_size=1000, page_size=4, host_tokens=64)
    yield lst
    lst.close()


def _drained(lst: HintListener, n: int, timeout_s: float = 10.0) -> list[Hint]:
    got: list[Hint] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += lst.drain()
        time.sleep(0.01)
    return got


def test_a_session_hint_names_that_sessions_latest_prompt_before_its_request():
    a1 = _req("a/1", "a", 0.0, [1, 2, 3, 4])
    a2 = _req("a/2", "a", 1.0, [1, 2, 3, 4, 5, 6, 7, 8])
    probe = _req(
        "b/1",
        "b",
        2.0,
        [9, 9, 9, 9],
        hints=(
            Hint("prefetch", session="a"),
            Hint("pin", session="b", ttl_s=5),
            Hint("demote", input_ids=(7, 7, 7, 7)),
        ),
    )
    resolved, unresolved = resolve_hints([probe, a2, a1])  # any order: resolved in arrival order
    assert [(h.hint.action, h.tokens) for h in resolved[id(probe)]] == [
        ("prefetch", (1, 2, 3, 4, 5, 6, 7, 8)),
        ("demote", (7, 7, 7, 7)),
    ]
    assert unresolved == ["request b/1: hints[1] (pin): unknown session 'b'"]  # its own prompt is not "before" it
    assert resolved[id(probe)][0].body() == {"action": "prefetch", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8]}
    assert ResolvedHint("x", Hint("pin", input_ids=(1,), ttl_s=3.0), (1,)).body() == {
        "action": "pin",
        "input_ids": [1],
        "ttl_s": 3.0,
    }


def test_hints_are_posted_at_their_due_time_in_due_order(listener):
    sender = HintSender(f"http://127.0.0.1:{listener.port}")
    t0 = time.perf_counter()
    late = ResolvedHint("r2", Hint("retain", input_ids=(5, 6, 7, 8)), (5, 6, 7, 8))
    early = ResolvedHint("r1", Hint("prefetch", input_ids=(1, 2, 3, 4)), (1, 2, 3, 4))
    sender.schedule(t0 + 2.0, late)
    sender.schedule(t0 + 1.0, early)
    got = _drained(listener, 2)
    assert time.perf_counter() - t0 >= 2.0  # never before its due time (a lower bound: no machine makes it fail)
    assert [h.action for h in got] == ["prefetch", "retain"]
    counts = sender.close()
    assert (counts.sent, counts.accepted, counts.refused, counts.unsent) == (2, 2, 0, 0)


def test_a_refused_hint_is_counted_with_its_reason_and_the_rest_still_go(listener):
    sender = HintSender(f"127.0.0.1:{listener.port}/hints")
    now = time.perf_counter()
    sender.schedule(now, ResolvedHint("r1", Hint("prefetch", input_ids=(1, 2)), (1, 2)))  # shorter than a page
    sender.schedule(
        now, ResolvedHint("r2", Hint("pin", input_ids=tuple(range(48)), ttl_s=5.0), tuple(range(48)))
    )  # > 50 % of 64
    sender.schedule(now, ResolvedHint("r3", Hint("prefetch", input_ids=(1, 2, 3, 4)), (1, 2, 3, 4)))
    sender.schedule(now + 0.5, ResolvedHint("r4", Hint("retain", input_ids=(5, 6, 7, 8)), (5, 6, 7, 8)))  # due later
    assert [h.input_ids for h in _drained(listener, 1)] == [(1, 2, 3, 4)]
    counts = sender.close()  # returns once the last one is posted, at its time
    assert time.perf_counter() - now >= 0.5 and [h.input_ids for h in listener.drain()] == [(5, 6, 7, 8)]
    assert (counts.sent, counts.accepted, counts.refused, counts.unsent) == (4, 2, 2, 0)
    assert counts.first_error.startswith("request r1: prefetch of 2 tokens: HTTP 400: hint 0: 'input_ids': ")
    assert "pin of 48 tokens is over 50% of the 64-token host tier" in counts.refusals[1]
    assert counts.endpoint_error is None


def test_a_dead_hint_api_ends_the_sending_and_is_reported():
    port = free_port()
    with pytest.raises(HintApiError, match=f"the hint API at http://127.0.0.1:{port}/hints does not answer"):
        hint_api_status(f"http://127.0.0.1:{port}")
    sender = HintSender(f"http://127.0.0.1:{port}")
    now = time.perf_counter()
    for i in range(3):
        sender.schedule(now, ResolvedHint(f"r{i}", Hint("prefetch", input_ids=(1, 2, 3, 4)), (1, 2, 3, 4)))
    counts = sender.close()
    assert counts.endpoint_error and "stopped answering" in counts.endpoint_error
    assert (counts.sent, counts.unsent) == (0, 3)


def test_the_hint_api_is_found_in_the_servers_stats():
    stats = {"hints": {"port": 30124, "host": "127.0.0.1"}}
    assert hint_api_url("http://10.0.0.5:30000", stats) == "http://10.0.0.5:30124"
    assert hint_api_url("http://h:1", {"hints": {"port": 7, "host": "10.1.1.1"}}) == "http://10.1.1.1:7"
    assert hint_api_url("http://h:1", {"config": {}}) is None and hint_api_url("http://h:1", None) is None


def test_a_hinted_trace_without_a_hint_api_fails_before_anything_is_sent():
    dead = f"http://127.0.0.1:{free_port()}"
    server = ServerModel(url=dead, vocab_size=1000, vocab_source="test")
    reqs = [_req("a/1", "a", 0.0, [1, 2, 3, 4], hints=(Hint("prefetch", input_ids=(1, 2, 3, 4)),))]
    with pytest.raises(
        ServerError, match=r"the trace carries 1 hints, but the server at .* serves no hint API.*--hint-port"
    ):
        replay_http(reqs, dead, server=server)
    with pytest.raises(ServerError, match=r"does not answer.*the trace's 1 hints cannot be sent"):
        replay_http(reqs, dead, server=server, hint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServerError, match="--hint-url must be http://HOST:PORT"):
        replay_http(reqs, dead, server=server, hint_url="ftp://x")
