"""Grow a Mooncake trace to N requests for scale tests, keeping its statistics.

Method (`synthesise`):

1. **Sessions.** The source's requests are grouped into conversations with the reader's own rule
   (`mooncake._SessionIndex`: a request continues the session whose full-block prefix is the longest
   prefix of its hash ids). Each session keeps its turns as (offset from the session's first
   arrival, input_length, output_length, hash_ids).
2. **Shared and private ids.** A hash id that appears in two or more sessions (the system prompt,
   id 0 in the shipped trace, and any other shared template) is *shared*; every other id is
   *private* to its session.
3. **Epochs.** The output is a sequence of epochs, each as long as the source (first to last
   arrival, plus the mean gap between session starts). Epoch `e` has the source's session *start
   times* (shifted by `e` epochs), but each start is given a session drawn uniformly at random (with
   replacement, seeded) from the source's sessions: session lengths (turns), gaps between turns and
   prompt/answer lengths follow the source's distribution, and session starts keep its arrival
   pattern (bursts included).
4. **Fresh ids.** Every drawn session gets its private ids shifted by `(k + 1) * (max id + 1)`,
   `k` counting the sessions drawn so far: private prefixes are shared only inside their own
   conversation (as in the source), while shared ids stay as they are, so the cross-session
   sharing of the source (a common system prompt) is kept.
5. Turns are written in arrival order (a heap over the sessions in flight) until N requests.

Epoch 0 replays the source's sessions as drawn, not as they were: the output is statistically like
the source, not a copy of it. Deterministic for a given source, N and seed.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .mooncake import _SessionIndex, parse_row
from .trace import ReadNotes, TraceError, read_lines


@dataclass
class _Session:
    start: float  # raw timestamp of its first turn
    turns: list[tuple[float, int, int, list[int]]]  # (offset from start, input_length, output_length, hash_ids)


def _sessions(path: str | Path, block_size: int) -> tuple[list[_Session], list[float], int]:
    """The source's sessions (in order of first arrival), their start times, and the largest id."""
    notes = ReadNotes()
    index = _SessionIndex(system_prefix_blocks=1)
    by_name: dict[str, _Session] = {}
    order: list[_Session] = []
    max_id = 0
    for line, text in read_lines(path):
        ts, input_length, output_length, hash_ids, _fits = parse_row(path, line, text, notes, block_size, "fixed")
        if not isinstance(ts, (int, float)):
            raise TraceError(path, line, "timestamp must be a number")
        name = index.assign(hash_ids, input_length // block_size)
        s = by_name.get(name)
        if s is None:
            s = by_name[name] = _Session(float(ts), [])
            order.append(s)
        s.turns.append((float(ts) - s.start, input_length, output_length, hash_ids))
        if hash_ids:
            max_id = max(max_id, max(hash_ids))
    for s in order:  # a line out of order could start a session late: re-anchor, keep turns in time order
        s.turns.sort(key=lambda t: t[0])
        low = s.turns[0][0]
        s.start += low
        s.turns = [(off - low, *rest) for off, *rest in s.turns]  # type: ignore[misc]
    order.sort(key=lambda s: s.start)
    return order, [s.start for s in order], max_id


def synthesise(source: str | Path, requests: int, seed: int = 0, block_size: int = 512) -> Iterator[dict]:
    """Yield `requests` Mooncake rows (``timestamp``, ``input_length``, ``output_length``,
    ``hash_ids``) grown from `source` by the method in the module docstring, in arrival order."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    sessions, starts, max_id = _sessions(source, block_size)
    owners: dict[int, int] = {}
    shared: set[int] = set()
    for i, s in enumerate(sessions):
        for _, _, _, ids in s.turns:
            for h in ids:
                o = owners.setdefault(h, i)
                if o != i:
                    shared.add(h)
    first = starts[0]
    span = starts[-1] - first
    last_arrival = max(s.start + s.turns[-1][0] for s in sessions)
    gap = span / max(1, len(starts) - 1)
    epoch = max(1.0, (last_arrival - first) + gap)  # at least 1 ms: a one-line source still advances
    rng = random.Random(seed)
    stride = max_id + 1
    heap: list[tuple[float, int, int, int, int]] = []  # (arrival, draw number, session, turn, shift)
    draws = 0
    emitted = 0
    e = 0
    next_start = 0  # index into starts of the next session start to draw
    while emitted < requests:
        next_t = first + e * epoch + (starts[next_start] - first)
        # open every session that starts before the earliest turn waiting
        if not heap or next_t <= heap[0][0]:
            idx = rng.randrange(len(sessions))
            draws += 1
            heapq.heappush(heap, (next_t, draws, idx, 0, draws * stride))
            next_start += 1
            if next_start == len(starts):
                next_start, e = 0, e + 1
            continue
        t, d, idx, turn, shift = heapq.heappop(heap)
        s = sessions[idx]
        _, input_length, output_length, ids = s.turns[turn]
        yield {
            "timestamp": round(t, 3) if isinstance(t, float) and not t.is_integer() else int(t),
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": [h if h in shared else h + shift for h in ids],
        }
        emitted += 1
        if turn + 1 < len(s.turns):
            heapq.heappush(heap, (t - s.turns[turn][0] + s.turns[turn + 1][0], d, idx, turn + 1, shift))


def write_trace(rows: Iterator[dict], out: IO[str]) -> int:
    """Write rows as JSONL; returns how many."""
    n = 0
    for row in rows:
        out.write(json.dumps(row, separators=(", ", ": ")) + "\n")
        n += 1
    return n


__all__ = ["synthesise", "write_trace"]
