"""Recorded agent sessions (kv-cache-tester JSON): reading, the flags, derived hints, the TTFT split."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sgl_hicache.cli import main
from sgl_hicache.records import RecordColumns
from sgl_hicache.replay import TraceError, detect_format, load_trace, read_agent_sessions
from sgl_hicache.report import ttft_by_preceding

EXCERPT = Path(__file__).resolve().parents[2] / "data" / "agent_sessions_excerpt"
A, B = EXCERPT / "trace_0403.json", EXCERPT / "trace_0455.json"


def by_id(trace):
    return {r.request_id: r for r in trace}


def session_copy(tmp_path: Path, src: Path = B, edit=None, name: str | None = None) -> Path:
    obj = json.loads(src.read_text())
    if edit is not None:
        edit(obj)
    out = tmp_path / (name or src.name)
    out.write_text(json.dumps(obj))
    return out


def test_detects_a_session_file_and_a_folder():
    assert detect_format(EXCERPT) == "agent-sessions"
    assert detect_format(A) == "agent-sessions"


def test_reads_the_excerpt_sessions_and_calls():
    trace = load_trace(EXCERPT)
    assert len(trace) == 10
    assert Counter(r.session for r in trace) == {"trace_0403": 5, "trace_0455": 5}
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    reqs = by_id(trace)
    first = reqs["trace_0403#0"]
    assert len(first.input_ids) == 14487 and first.output_length == 264  # contexts kept whole by default
    assert reqs["trace_0455#0"].line == 1 and reqs["trace_0403#4"].line == 5


def test_hash_ids_are_namespaced_per_session():
    reqs = by_id(load_trace(EXCERPT))
    a0, a1, b0 = reqs["trace_0403#0"], reqs["trace_0403#1"], reqs["trace_0455#0"]
    # both sessions open with hash ids 1, 2, 3, ...: different blocks, since the scope is local
    assert a0.input_ids[:64] != b0.input_ids[:64]
    # within a session, a call that continues the previous one (its 232 ids start with the first's
    # 226) holds the first's whole prompt, its partial last block included, as a prefix
    assert a1.input_ids[:14487] == a0.input_ids


def test_a_prompt_not_continued_keeps_a_partial_block_of_its_own(tmp_path):
    def rewrite(o):  # the second call's context was rewritten from block 100 on
        ids = o["requests"][1]["hash_ids"]
        o["requests"][1]["hash_ids"] = ids[:100] + [10_000 + i for i in range(len(ids) - 100)]

    session_copy(tmp_path, A, rewrite)
    reqs = by_id(load_trace(tmp_path))
    a0, a1 = reqs["trace_0403#0"], reqs["trace_0403#1"]
    assert a1.input_ids[: 100 * 64] == a0.input_ids[: 100 * 64]
    assert a1.input_ids[226 * 64 : 14487] != a0.input_ids[226 * 64 :]


def test_global_scope_shares_ids_across_sessions(tmp_path):
    for src in (A, B):
        session_copy(tmp_path, src, lambda o: o.update(hash_id_scope="global"))
    reqs = by_id(load_trace(tmp_path))
    assert reqs["trace_0403#0"].input_ids[:64] == reqs["trace_0455#0"].input_ids[:64]


def test_block_scale_shrinks_prompts_and_says_so():
    trace = read_agent_sessions(EXCERPT, block_scale=8)
    first = by_id(trace)["trace_0403#0"]
    assert len(first.input_ids) == -(-14487 * 8 // 64)  # 1811
    assert first.output_length == 264  # output lengths kept
    assert "block-scale" in trace.notes and "replays as 8 tokens" in trace.notes["block-scale"].message


def test_gap_cap_cuts_long_gaps_only():
    whole, capped = by_id(read_agent_sessions(B)), by_id(read_agent_sessions(B, gap_cap_s=60))
    # call 0 ends at 3.46 s; call 1 comes at 2836 s: a 2832.54 s gap, cut to 60 s
    assert whole["trace_0455#1"].arrival_s == 2836.0
    assert capped["trace_0455#1"].arrival_s == pytest.approx(3.46 + 60)
    # the gaps after it are short: the calls keep their spacing
    assert capped["trace_0455#2"].arrival_s - capped["trace_0455#1"].arrival_s == pytest.approx(13.0)
    notes = read_agent_sessions(B, gap_cap_s=60).notes
    assert "1 cut" in notes["gap-cap"].message and "2832.54" in notes["gap-cap"].message


def test_session_spread_is_even_and_deterministic():
    together = read_agent_sessions(EXCERPT)
    spread = read_agent_sessions(EXCERPT, session_spread_s=100)
    starts = {r.session: r.arrival_s for r in spread if r.request_id.endswith("#0")}
    assert starts == {"trace_0403": 0.0, "trace_0455": 50.0}
    assert {r.arrival_s for r in together if r.request_id.endswith("#0")} == {0.0}
    assert [r.arrival_s for r in spread] == [r.arrival_s for r in read_agent_sessions(EXCERPT, session_spread_s=100)]


def test_subagent_records_are_counted_and_their_time_kept(tmp_path):
    def add(o):
        o["requests"].insert(1, {"t": 5.0, "type": "subagent", "duration_ms": 2000, "requests": [{"t": 5.0}, {}]})

    path = session_copy(tmp_path, A, add)
    trace = read_agent_sessions(path)
    assert len(trace) == 5
    assert by_id(trace)["trace_0403#1"].arrival_s == 11.0
    assert "1 sub-agent records (2 calls inside them) not replayed" in trace.notes["subagents"].message


def test_derived_hints_on_tool_use_calls_and_the_last_call():
    reqs = by_id(read_agent_sessions(EXCERPT))
    stops = {}
    for path in (A, B):
        obj = json.loads(path.read_text())
        for k, call in enumerate(obj["requests"]):
            stops[f"{obj['id']}#{k}"] = call["stop"]
    last = {"trace_0403#4", "trace_0455#4"}
    for rid, req in reqs.items():
        actions = [h.action for h in req.hints]
        if rid in last:
            assert actions == ["demote"] and req.hints[0].at_finish, rid
        elif stops[rid] == "tool_use":
            (hint,) = req.hints
            assert hint.action == "pin" and hint.at_finish and list(hint.input_ids) == list(req.input_ids), rid
        else:
            assert actions == [], rid
    # trace_0403 call 0 starts at 0 and the next call comes at 11 s: retained 1.25x that from the
    # call's end (a replayed answer may end sooner than the recorded 4.8 s; the next call does not)
    assert reqs["trace_0403#0"].hints[0].ttl_s == pytest.approx(11.0 * 1.25)


def test_estimate_error_is_seeded_and_bounded():
    def ttls(**kw):
        return {r.request_id: r.hints[0].ttl_s for r in read_agent_sessions(A, **kw) if r.hints and r.hints[0].ttl_s}

    exact = ttls()
    noisy = ttls(hint_estimate_error=0.5, hint_seed=1)
    assert noisy == ttls(hint_estimate_error=0.5, hint_seed=1)
    assert noisy != exact and noisy != ttls(hint_estimate_error=0.5, hint_seed=2)
    for rid, ttl in noisy.items():
        assert 0.5 * exact[rid] - 1e-6 <= ttl <= 1.5 * exact[rid] + 1e-6 or ttl == 1.0, rid


def test_no_hints():
    assert not any(r.hints for r in read_agent_sessions(EXCERPT, hints=False))


def test_preceded_by_categories():
    reqs = by_id(read_agent_sessions(EXCERPT))
    got = {rid: r.preceded_by for rid, r in reqs.items()}
    assert got["trace_0403#0"] == got["trace_0455#0"] == "none"
    assert got["trace_0403#1"] == "tool"  # the call before stopped on tool_use
    # trace_0455 call 2 has no stop reason; call 3's input is a person's text
    assert got["trace_0455#3"] == "person"
    assert Counter(got.values()) == {"none": 2, "tool": 7, "person": 1}


def test_end_turn_is_followed_by_a_person(tmp_path):
    def end(o):
        o["requests"][0]["stop"] = "end_turn"

    reqs = by_id(read_agent_sessions(session_copy(tmp_path, A, end)))
    assert reqs["trace_0403#1"].preceded_by == "person"
    assert reqs["trace_0403#0"].hints == ()  # no tool call after it


def test_ttft_split_in_the_report_counts_each_kind():
    cols = RecordColumns()
    for ttft, kind in ((1.0, "none"), (0.2, "tool"), (0.4, "tool"), (0.5, "person")):
        cols.add(0.0, ttft, 2.0, 10, 1, 0, 0, 0, kind)
    cols.add(0.0, 9.0, 10.0, 10, 1, 0, 0, 0)  # a request whose trace does not tell
    split = ttft_by_preceding(cols)["ttft_by_preceding"]
    assert {k: v["requests"] for k, v in split.items()} == {"none": 1, "person": 1, "tool": 2}
    assert split["tool"]["mean"] == pytest.approx(0.3) and split["none"]["max"] == 1.0
    assert cols[0].preceded_by == "none" and cols[4].preceded_by is None
    plain = RecordColumns()
    plain.add(0.0, 1.0, 2.0, 10, 1, 0, 0, 0)
    assert ttft_by_preceding(plain) == {}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: o["requests"][1].update({"in": "many"}), "requests[1]: field 'in' must be an integer"),
        (lambda o: o["requests"][2].update({"t": -1}), "requests[2]: field 't' must be >= 0"),
        (lambda o: o["requests"][0].pop("hash_ids"), "requests[0]: missing field 'hash_ids'"),
        (lambda o: o["requests"][0]["hash_ids"].pop(), "requests[0]: field 'hash_ids' has 201 ids"),
        (lambda o: o["requests"][0]["hash_ids"].__setitem__(3, "x"), "requests[0]: field 'hash_ids'[3] must be"),
        (lambda o: o["requests"][3].update({"type": "q"}), "requests[3]: field 'type' must be one of"),
        (lambda o: o["requests"][3].update({"stop": 5}), "requests[3]: field 'stop' must be a string"),
        (lambda o: o["requests"][3].update({"input_types": "text"}), "requests[3]: field 'input_types' must be"),
        (lambda o: o["requests"][4].update({"t": 1.0}), "requests[4]: field 't' 1 is before the previous call's"),
        (lambda o: o["requests"][1].update({"api_time": "slow"}), "requests[1]: field 'api_time' must be a number"),
        (lambda o: o.update(requests={}), "field 'requests' must be an array"),
        (lambda o: o.pop("requests"), "missing field 'requests'"),
        (lambda o: o.update(block_size=0), "field 'block_size' must be >= 1"),
        (lambda o: o.update(hash_id_scope="galaxy"), "field 'hash_id_scope' must be one of local, global"),
    ],
)
def test_malformed_fields_are_named(tmp_path, edit, message):
    path = session_copy(tmp_path, B, edit)
    with pytest.raises(TraceError) as err:
        read_agent_sessions(path)
    assert str(err.value).startswith(f"{path}:1: ") and message in str(err.value)


def test_bad_files_in_a_folder_are_named(tmp_path):
    (tmp_path / "a.json").write_text("[1, 2]")
    with pytest.raises(TraceError, match=r"a\.json:1: expected a JSON object"):
        read_agent_sessions(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=r"no \.json session files"):
        read_agent_sessions(empty)


def test_repeated_session_ids_are_made_unique(tmp_path):
    session_copy(tmp_path, A, name="a.json")
    session_copy(tmp_path, A, name="b.json")
    trace = read_agent_sessions(tmp_path)
    assert {r.session for r in trace} == {"trace_0403", "trace_0403#2"}
    assert "same-id" in trace.notes


def test_replay_end_to_end_prints_the_split(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["replay", str(EXCERPT), "--block-scale", "8", "--gap-cap", "600", "--session-spread", "10"]
    argv += ["--page-size", "16", "--device-tokens", "8192", "--host-tokens", "16384", "--disk-tokens", "65536"]
    assert main([*argv, "--policy", "demote", "--quiet", "--report", str(report)]) == 0
    out, err = capsys.readouterr()
    assert "demote: ttft by what preceded the call: none 2:" in out and "person 1:" in out and "tool 7:" in out
    assert "--trace-clock" in err and "cut to 600 s" in err
    rep = json.loads(report.read_text())["policies"]["demote"]
    assert {k: v["requests"] for k, v in rep["ttft_by_preceding"].items()} == {"none": 2, "person": 1, "tool": 7}
    assert rep["engine"]["hints"]["pin"] == 7 and rep["settings"]["concurrency"] is None


def test_agent_flags_are_refused_for_other_formats(capsys):
    from conftest import mooncake_trace

    assert main(["replay", str(mooncake_trace()), "--gap-cap", "5", "--quiet"]) == 2
    assert "--gap-cap: only for agent-session traces" in capsys.readouterr().err


def test_a_block_size_past_the_limit_is_refused(tmp_path):
    path = session_copy(tmp_path, B, lambda o: o.update(block_size=10**6))
    with pytest.raises(TraceError, match="field 'block_size' must be <= 1024"):
        read_agent_sessions(path)


def test_the_hints_travel_in_the_requests_to_a_server():
    from sgl_hicache.replay.in_request import plan_in_request_hints

    trace = read_agent_sessions(EXCERPT, gap_cap_s=600)
    plan = plan_in_request_hints(trace)
    first, last, quiet = plan.agent_hints["trace_0403#0"], plan.agent_hints["trace_0403#4"], "trace_0455#2"
    assert first["workflow_id"] == "trace_0403" and first["cache_ttl_ms"] == pytest.approx(11.0 * 1.25 * 1000)
    assert last["reuse_hint"] == "end" and "cache_ttl_ms" not in last
    assert set(plan.agent_hints[quiet]) == {"workflow_id", "agent_id", "step_id"}  # no stop reason: no hint
    assert not plan.prefetches
