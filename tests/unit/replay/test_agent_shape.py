"""The `agent` shape: tool-call pauses of documented, seeded durations, other users'
traffic that spills a paused session, and the hints an agent framework sends; and what the
embedded engine does with it (the hints bring a paused session back before it resumes, the walk
alone stays silent)."""

from __future__ import annotations

import pytest

from sgl_hicache.replay import load_trace
from sgl_hicache.replay.shapes import SHAPES, agent, role_of, write_plain
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig


def _sessions(reqs):
    out: dict[str, list] = {}
    for r in reqs:
        if r.session.startswith("agent"):
            out.setdefault(r.session, []).append(r)
    return out


def test_agent_is_deterministic_from_its_seed():
    key = lambda reqs: [(r.request_id, r.arrival_s, list(r.input_ids), r.hints) for r in reqs]  # noqa: E731
    assert key(agent(sessions=4, seed=3, hints=True)) == key(agent(sessions=4, seed=3, hints=True))
    assert [r.arrival_s for r in agent(sessions=4, seed=3)] != [r.arrival_s for r in agent(sessions=4, seed=4)]
    assert SHAPES["agent"] is agent


def test_agent_steps_pauses_and_other_traffic_follow_the_documented_fields():
    ps, decode, short, long_ = 256, 2.0, (0.5, 4.0), (30.0, 120.0)
    reqs = agent(
        sessions=16, steps=6, decode_s=decode, short_s=short, long_s=long_, long_share=0.3, other_gap_s=0.5, seed=5
    )
    assert [r.line for r in reqs] == list(range(1, len(reqs) + 1))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    sessions = _sessions(reqs)
    assert len(sessions) == 16
    tools = []
    for steps in sessions.values():
        assert [role_of(r) for r in steps] == ["start"] + [f"resume{k}" for k in range(1, 6)]
        assert len(steps[0].input_ids) == 2048 + 1024  # the shared tool specs, then the task
        assert list(steps[0].input_ids[:2048]) == list(sessions["agent0"][0].input_ids[:2048])  # shared by every agent
        for prev, cur in zip(steps, steps[1:]):
            grown = len(cur.input_ids) - len(prev.input_ids)
            assert list(cur.input_ids[: len(prev.input_ids)]) == list(prev.input_ids)  # the session's prefix
            assert 256 + 512 <= grown <= 256 + 2048 and grown % ps == 0  # the call, then a result of 512-2048 tokens
            tool = cur.arrival_s - prev.arrival_s - decode
            assert short[0] - 1e-6 <= tool <= short[1] + 1e-6 or long_[0] - 1e-6 <= tool <= long_[1] + 1e-6
            tools.append(tool)
    longs = sum(t >= long_[0] - 1e-6 for t in tools)
    assert 0.15 * len(tools) <= longs <= 0.45 * len(tools)  # a mix: about long_share of the calls are long
    others = [r for r in reqs if role_of(r) == "other"]
    assert len({tuple(r.input_ids[:4]) for r in others}) == len(others)  # one-shot: nothing shared
    assert all(b.arrival_s - a.arrival_s == pytest.approx(0.5) for a, b in zip(others, others[1:]))
    assert others[-1].arrival_s >= max(r.arrival_s for r in reqs if role_of(r) != "other") - 0.5
    with pytest.raises(ValueError, match="long_share"):
        agent(long_share=1.5)
    with pytest.raises(ValueError, match="short_s"):
        agent(short_s=(3.0, 1.0))


def test_agent_hints_prefetch_the_next_steps_prefix_lead_s_before_the_tool_returns():
    lead = 1.5
    reqs = agent(sessions=6, steps=4, lead_s=lead, hints=True, seed=2)
    for steps in _sessions(reqs).values():
        assert steps[-1].hints == ()  # no tool call after the last step
        for cur, nxt in zip(steps, steps[1:]):
            (hint,) = cur.hints
            assert hint.action == "prefetch" and hint.session is None
            assert list(hint.input_ids) == list(cur.input_ids)  # what the next step finds cached
            assert cur.arrival_s + hint.after_s == pytest.approx(max(cur.arrival_s, nxt.arrival_s - lead), abs=1e-5)
    assert all(r.hints == () for r in reqs if role_of(r) == "other")


def test_agent_hints_survive_the_trace_reader(tmp_path):
    """Valid trace hints: written as plain JSONL, the trace reader gives them back unchanged."""
    reqs = agent(sessions=3, steps=3, hints=True)
    path = tmp_path / "agent.jsonl"
    with path.open("w") as f:
        write_plain(reqs, f)
    back = list(load_trace(path, fmt="plain"))
    assert [(r.request_id, r.hints) for r in back] == [(r.request_id, r.hints) for r in reqs]


def _replay(policy: str, hints: bool) -> tuple[float, dict, dict]:
    reqs = agent(sessions=8, steps=5, other_gap_s=0.5, hints=hints)
    cfg = EngineConfig(
        policy=policy,
        model=get_model("llama3-8b"),
        hardware=get_hardware("h200"),
        device_tokens=32_768,
        host_tokens=65_536,
        disk_tokens=2_000_000,
        concurrency=None,
        byte_mode="metadata",
    )
    eng = EmbeddedEngine(cfg)
    try:
        eng.run(reqs)
        eng.cache.check()
        role = {r.arrival_s: role_of(r) for r in reqs}
        ttft = [t for a, t in zip(eng.records.arrival_s, eng.records.ttft_s) if role[a].startswith("resume")]
        disk = sum(k for a, k in zip(eng.records.arrival_s, eng.records.hit_disk) if role[a].startswith("resume"))
        snap = eng.cache.snapshot()
        return (
            sum(ttft) / len(ttft),
            {"disk_hits": disk, "bytes": sum(snap["bytes_moved"].values())},
            snap["prefetch"]["predict"],
        )
    finally:
        eng.close()


def test_a_paused_session_spills_and_the_hint_brings_it_back_before_it_resumes():
    pf_ttft, pf, _ = _replay("prefetch", hints=False)
    walk_ttft, walk, _walk_pred = _replay("predict", hints=False)
    hint_ttft, _hinted, hint_pred = _replay("predict", hints=True)
    assert pf["disk_hits"] > 0  # the other traffic pushed paused sessions down to disk
    # the walk alone has nothing below the match point to walk to: the next step extends the tip
    assert walk_ttft <= pf_ttft and walk["bytes"] <= 1.01 * pf["bytes"]
    # the framework's hint lands the session on host before it resumes, every promoted page used
    assert hint_ttft < 0.95 * pf_ttft
    assert hint_pred["used_tokens"] >= 0.95 * hint_pred["promoted_tokens"] > 0


def test_synth_writes_the_agent_shape_with_hints(tmp_path, capsys):
    from sgl_hicache.cli import main

    out = tmp_path / "agent.jsonl"
    assert main(["synth", "--shape", "agent", "--sessions", "3", "--hints", "--lead", "1.0", "--out", str(out)]) == 0
    assert "(agent)" in capsys.readouterr().out
    back = list(load_trace(out, fmt="plain"))
    assert [(r.request_id, r.hints) for r in back] == [
        (r.request_id, r.hints) for r in agent(sessions=3, hints=True, lead_s=1.0)
    ]
    assert main(["synth", "--shape", "branch", "--hints", "--out", str(out)]) == 2  # hints go with chain or agent only
    assert "--hints goes with --shape chain or --shape agent" in capsys.readouterr().err
