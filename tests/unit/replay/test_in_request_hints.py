"""A trace's hints sent in the requests, as an agent framework sends them (`replay/in_request.py`),
and the HTTP replayer that sends them (`replay_http(hints_in_request=True)`), against a fake
`/generate` that records what it was sent (no SGLang). The same `agent` trace drives the embedded
engine (tests/unit/replay/test_agent_shape.py); the real server's side is tests/server/test_sglang_agent_hints.py."""

from __future__ import annotations

import json
import threading
from array import array
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_hicache.policy.agent_hints import parse_agent_hints
from sgl_hicache.policy.hint_rules import Hint
from sgl_hicache.replay.http import ServerModel, replay_http
from sgl_hicache.replay.in_request import PREFETCH_PROMPT, plan_in_request_hints
from sgl_hicache.replay.shapes import agent, role_of
from sgl_hicache.replay.trace import Request

SHAPE = dict(
    sessions=3,
    steps=4,
    system_tokens=32,
    task_tokens=32,
    result_tokens=(16, 32),
    output_tokens=16,
    decode_s=0.5,
    short_s=(0.1, 0.3),
    long_s=(2.0, 4.0),
    long_share=0.5,
    session_gap_s=0.2,
    other_tokens=32,
    other_gap_s=1.0,
    lead_s=0.5,
    page_size=16,
)


def _req(rid: str, session: str | None, t: float, ids: list[int], hints: tuple = ()) -> Request:
    return Request(rid, session, t, array("q", ids), 4, 1, hints=hints)


def test_each_turn_of_a_hinted_session_names_it_and_announces_its_tool_call():
    reqs = agent(**SHAPE, pins=True, estimate_sigma=0.5)
    plan = plan_in_request_hints(reqs, time_scale=0.5)
    turns = [r for r in reqs if r.session.startswith("agent")]
    assert turns and all(r.request_id in plan.agent_hints for r in turns)
    assert not any(r.request_id in plan.agent_hints for r in reqs if role_of(r) == "other")
    for r in turns:
        obj = plan.agent_hints[r.request_id]
        parsed = parse_agent_hints({"agent_hints": obj})  # what the server accepts
        assert parsed is not None and parsed.session == f"{r.session}/main"
        pins = [h for h in r.hints if h.action == "pin"]
        if pins:  # a tool call follows: retained from the turn's end (trace seconds x the time scale), in ms
            assert pins[0].at_finish and obj["cache_ttl_ms"] == pytest.approx(pins[0].ttl_s * 0.5 * 1000, abs=1e-3)
            assert "reuse_hint" not in obj
        else:  # the session's last turn starts no tool: the conversation ends there
            assert r.request_id.endswith(f"resume{SHAPE['steps'] - 1}") and obj["reuse_hint"] == "end"
            assert parsed.end and parsed.retain_s is None
    assert [plan.agent_hints[r.request_id]["step_id"] for r in turns if r.session == "agent0"] == [0, 1, 2, 3]


def test_each_prefetch_hint_becomes_a_one_token_call_at_its_time():
    reqs = agent(**SHAPE, pins=True, estimate_sigma=0.5)
    plan = plan_in_request_hints(reqs, time_scale=0.5)
    # the agent shape's prefetches go a while after their turn's reply ends (the tool's estimate - lead)
    want = sorted((r.request_id, h.after_s) for r in reqs for h in r.hints if h.action == "prefetch")
    got = sorted((rid, delay) for rid, pairs in plan.after_finish.items() for delay, _ in pairs)
    calls = [c for pairs in plan.after_finish.values() for _, c in pairs]
    assert got == want and plan.prefetches == [] and len({c.request_id for c in calls}) == len(calls)
    for p in calls:
        assert tuple(p.input_ids) == PREFETCH_PROMPT and p.output_length == 1 and role_of(p).startswith("prefetch")
        assert plan.sampling(p.request_id) == {"custom_params": {"agent_hints": {"prefetch": f"{p.session}/main"}}}
    # an arrival-relative prefetch goes at its trace time (the replayer scales it like every arrival)
    a1 = _req("a/1", "a", 1.0, [1, 2, 3, 4], hints=(Hint("prefetch", session="a", after_s=2.0),))
    b1 = _req("b/1", "b", 0.0, [5, 6, 7, 8], hints=(Hint("prefetch", session="b", after_s=5.0),))
    plan = plan_in_request_hints([a1, b1])
    assert [(p.session, p.arrival_s) for p in plan.prefetches] == [("a", 3.0), ("b", 5.0)]
    for p in plan.prefetches:
        assert tuple(p.input_ids) == PREFETCH_PROMPT and p.output_length == 1 and role_of(p).startswith("prefetch")
        assert plan.sampling(p.request_id) == {"custom_params": {"agent_hints": {"prefetch": f"{p.session}/main"}}}
    assert [p.arrival_s for p in plan.prefetches] == sorted(p.arrival_s for p in plan.prefetches)


def test_a_trace_without_hints_carries_nothing():
    plan = plan_in_request_hints(agent(**SHAPE))
    assert plan.agent_hints == {} and plan.prefetches == [] and plan.sampling("agent0/start") is None


def test_a_demote_ends_the_conversation_and_a_session_hint_names_its_own():
    a1 = _req("a/1", "a", 0.0, [1, 2, 3, 4], hints=(Hint("retain", session="a", ttl_s=3.0),))
    a2 = _req("a/2", "a", 5.0, [1, 2, 3, 4, 5], hints=(Hint("demote", input_ids=(1, 2)),))
    plan = plan_in_request_hints([a2, a1], agent_id="coder")
    assert plan.agent_hints["a/1"] == {
        "workflow_id": "a",
        "agent_id": "coder",
        "step_id": 0,
        "expected_tool_duration_ms": 3000.0,
    }
    assert plan.agent_hints["a/2"]["reuse_hint"] == "end" and plan.agent_hints["a/2"]["step_id"] == 1
    kept = plan_in_request_hints([a1, _req("a/2", "a", 5.0, [1, 2, 3, 4, 5])], end_last_turn=False)
    assert "reuse_hint" not in kept.agent_hints["a/2"]


@pytest.mark.parametrize(
    "reqs, match",
    [
        ([_req("a/1", "a", 0.0, [1, 2, 3], hints=(Hint("pin", input_ids=(9, 9), ttl_s=1.0),))], "not its own prompt"),
        ([_req("a/1", "a", 0.0, [1, 2, 3], hints=(Hint("prefetch", session="b"),))], "names session 'b'"),
        ([_req("a/1", None, 0.0, [1, 2, 3], hints=(Hint("prefetch", input_ids=(1,)),))], "no session"),
        ([_req("a/1", "a", 0.0, [1, 2, 3], hints=(Hint("retain", session="a"),))], "has no ttl_s"),
        (
            [
                _req(
                    "a/1",
                    "a",
                    0.0,
                    [1, 2, 3],
                    hints=(Hint("pin", session="a", ttl_s=1.0), Hint("retain", session="a", ttl_s=2.0)),
                )
            ],
            "second retention",
        ),
        (
            [
                _req(
                    "a/1",
                    "a",
                    0.0,
                    [1, 2, 3],
                    hints=(Hint("pin", session="a", ttl_s=1.0), Hint("demote", session="a")),
                )
            ],
            "both ends its session and retains it",
        ),
    ],
)
def test_a_hint_that_cannot_travel_in_its_request_is_refused_by_name(reqs, match):
    with pytest.raises(ValueError, match=match):
        plan_in_request_hints(reqs)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="time_scale"):
        plan_in_request_hints([], time_scale=0)
    with pytest.raises(ValueError, match="agent_id"):
        plan_in_request_hints([], agent_id="")
    with pytest.raises(ValueError, match="prefetch_prompt"):
        plan_in_request_hints([], prefetch_prompt=())


class _FakeGenerate:
    """A `/generate` that streams one output token per request and records each request's body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        lock = threading.Lock()
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # no stats, no hint API: a plain server
                self.send_response(404)
                self.end_headers()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    bodies.append(body)
                n = body["sampling_params"]["max_new_tokens"]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                meta = {"completion_tokens": n, "cached_tokens_details": {"device": 0, "host": 0, "storage": 0}}
                chunk = {"output_ids": [5] * n, "meta_info": meta}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_replayer_sends_the_hints_in_the_requests_and_measures_only_the_turns():
    reqs = agent(**{**SHAPE, "sessions": 2, "steps": 3, "long_s": (0.6, 0.8)}, pins=True, estimate_sigma=0.5)
    plan = plan_in_request_hints(reqs, time_scale=0.2)
    fake = _FakeGenerate()
    try:
        server = ServerModel(url=fake.url, vocab_size=1 << 40, vocab_source="test")
        rep = replay_http(
            reqs,
            fake.url,
            concurrency=8,
            max_new_tokens=2,
            trace_clock=True,
            time_scale=0.2,
            server=server,
            hints_in_request=True,
            keep_outputs=True,
        )
    finally:
        fake.close()
    assert rep["requests"] == len(reqs) and rep["requests_failed"] == 0
    assert {r["request_id"] for r in rep["records"]} == {r.request_id for r in reqs}  # prefetch calls not measured
    ih = rep["in_request_hints"]
    calls = len(plan.prefetches) + sum(map(len, plan.after_finish.values()))
    assert ih["prefetches_sent"] == calls > 0 and ih["prefetches_failed"] == 0
    assert ih["requests_with_hints"] == sum(1 for r in reqs if r.session.startswith("agent"))
    sent = [b["sampling_params"].get("custom_params", {}).get("agent_hints") for b in fake.bodies]
    prefetches = [h for h in sent if h and "prefetch" in h]
    assert len(prefetches) == calls
    assert all(b["sampling_params"]["max_new_tokens"] == 1 for b in fake.bodies if "prefetch" in str(b))
    turns = [h for h in sent if h and "workflow_id" in h]
    assert sorted(json.dumps(h, sort_keys=True) for h in turns) == sorted(
        json.dumps(plan.agent_hints[r.request_id], sort_keys=True) for r in reqs if r.session.startswith("agent")
    )
    assert sent.count(None) == sum(1 for r in reqs if role_of(r) == "other")


def test_hints_in_request_need_the_trace_clock():
    with pytest.raises(ValueError, match="needs trace_clock"):
        replay_http([], "http://127.0.0.1:1", hints_in_request=True)
