"""The server's view of a tool pause: each conversation's past pauses predict its next one."""

from __future__ import annotations

import pytest

from sgl_hicache.policy import return_gaps
from sgl_hicache.policy.return_gaps import MIN_PAUSES, MIN_POPULATION, ReturnGaps


def test_a_conversations_next_pause_is_the_median_of_its_last_ones():
    gaps = ReturnGaps()
    path, now = ["sys", "turn0"], 0.0
    assert gaps.committed(path, now) is None  # nothing seen yet
    predicted = []
    for i, pause in enumerate((3.0, 5.0, 40.0)):
        now += pause
        assert gaps.arrived(path + [f"new{i}"], now) == pause
        path = path + [f"turn{i + 1}"]  # the turn's prompt extends the previous one's
        now += 1.0  # its prefill
        predicted.append(gaps.committed(path, now))
    assert MIN_PAUSES == 2 and predicted == [None, 4.0, 5.0]
    assert len(gaps) == 1  # the conversation moved to its latest end; the older ends are forgotten


def test_a_request_that_continues_no_known_conversation_records_no_pause():
    gaps = ReturnGaps()
    gaps.committed(["sys", "a"], 0.0)
    assert gaps.arrived(["sys", "b"], 5.0) is None
    assert gaps.arrived(["sys", "a", "x"], 6.0) == 6.0
    assert gaps.arrived(["sys", "a", "y"], 7.0) is None  # its pause ended at the first arrival
    assert gaps.pauses_seen == 1


def test_the_conversations_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(return_gaps, "CONVERSATIONS_KEPT", 3)
    gaps = ReturnGaps()
    for i in range(10):
        gaps.committed(["sys", f"c{i}"], float(i))
    assert len(gaps) == 3
    assert gaps.arrived(["sys", "c0", "x"], 20.0) is None  # the least recently active went first
    assert gaps.arrived(["sys", "c9", "x"], 20.0) == 11.0


def test_after_a_tool_call_the_pause_expected_covers_nine_in_ten_of_those_seen():
    # what a call ended in is what the server saw in its output: after a tool call, the conversation
    # comes back after a pause its own pauses after tool calls (or, before it has two, every
    # conversation's) exceeded only one time in ten; after an answer to a person, none is expected
    gaps = ReturnGaps()
    for c in range(MIN_POPULATION):  # other conversations: one pause each after a tool call
        gaps.committed(["sys", f"c{c}"], 0.0, "tool")
        gaps.arrived(["sys", f"c{c}", "next"], float(c + 1))
    assert sorted(gaps.population["tool"]) == [float(c + 1) for c in range(MIN_POPULATION)]
    assert gaps.committed(["sys", "new"], 100.0, "tool") == 8.0  # nearest rank 0.9 of 1..8
    assert gaps.committed(["sys", "new2"], 100.0, "person") is None
    path, now = ["sys", "own"], 200.0
    for i, pause in enumerate((2.0, 30.0, 3.0)):
        gaps.committed(path, now, "tool")
        now += pause
        gaps.arrived(path + [f"n{i}"], now)
        path = path + [f"t{i}"]
    assert gaps.committed(path, now, "tool") == 30.0  # its own three: 0.9 of them is the largest
    gaps.arrived(path + ["x"], now + 50.0)  # a pause after a tool call of its own
    assert gaps.committed(path + ["y"], now + 60.0, "person") is None
    assert gaps.committed(path + ["y", "z"], now + 61.0, None) == pytest.approx(16.5)  # unknown: the median
