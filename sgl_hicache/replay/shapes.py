"""Generated workloads where a prediction below the match point can pay (issue 24).

Each shape is deterministic for its arguments (token ids are built, not drawn; the only randomness
is a seeded jitter of arrivals) and tags every request in `request_id`, ``"<session>/<role>"``, so
a benchmark can score the requests a prediction is for (`role_of`):

- `chain` (cold restore with a probe): `sessions` conversations of `turns` turns each grow a long
  private history (a shared system prompt, then `turn_tokens` per turn), interleaved so that the
  tiers spill them to disk. After `pause_s`, each session comes back: a short *probe* (a title or
  router call: the system prompt, the head of the history, its own question) arrives `lead_s`
  before the *continuation*, which needs the whole history plus a new question. Roles: ``turn<k>``,
  ``probe``, ``cont``.
- `branch` (sibling branches revisited): each session writes a shared document (`doc_tokens`),
  then `siblings` branches on it (regenerate, parallel samples, tree search), each
  `branch_tokens` long. After `pause_s`, a probe on the document arrives `lead_s` before the
  branches are revisited (each branch plus a follow-up question, within `spread_s`). Roles:
  ``doc``, ``branch<i>``, ``probe``, ``revisit<i>``.

Sizes are in tokens and rounded down to whole pages of `page_size`.
"""

from __future__ import annotations

import json
import random
from array import array
from typing import IO

from ..policy.hints import Hint
from .trace import Request

SYSTEM_ID = 1  # the shared system prompt's ids start here
_SESSION_SPAN = 10_000_000  # each session's private ids: a block of this many


def role_of(request: Request) -> str:
    """The role a shape gave `request` (the part of its id after the slash)."""
    return request.request_id.rsplit("/", 1)[-1]


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class _Ids:
    """Fresh private token ids of one session."""

    def __init__(self, session: int) -> None:
        self.next = (session + 1) * _SESSION_SPAN

    def take(self, n: int) -> list[int]:
        out = _ids(self.next, n)
        self.next += n
        return out


def _request(rid: str, session: str, t: float, ids: list[int], output: int, line: int) -> Request:
    return Request(rid, session, round(t, 6), array("q", ids), output, line)


def _pages(n: int, page_size: int) -> int:
    if n < page_size:
        raise ValueError(f"a shape's part of {n} tokens is shorter than one page ({page_size})")
    return n // page_size * page_size


def chain(sessions: int = 24, turns: int = 4, turn_tokens: int = 4096, system_tokens: int = 1024, probe_tokens: int = 256,
          question_tokens: int = 256, output_tokens: int = 64, turn_gap_s: float = 4.0, session_gap_s: float = 6.0,
          pause_s: float = 120.0, lead_s: float = 2.0, page_size: int = 256, seed: int = 0, hints: bool = False) -> list[Request]:
    """The `chain` shape (module docstring), in arrival order. With `hints`, each probe carries the
    client's hint that its session comes back (``prefetch`` of the session's latest prompt)."""
    rng = random.Random(seed)
    turn_tokens, system_tokens = _pages(turn_tokens, page_size), _pages(system_tokens, page_size)
    probe_tokens, question_tokens = _pages(probe_tokens, page_size), _pages(question_tokens, page_size)
    system = _ids(SYSTEM_ID, system_tokens)
    out: list[Request] = []
    for s in range(sessions):
        ids = _Ids(s)
        name = f"chain{s}"
        start = s * session_gap_s + rng.uniform(0, 0.5)
        history = list(system)
        for k in range(turns):
            history += ids.take(turn_tokens)
            out.append(_request(f"{name}/turn{k}", name, start + k * turn_gap_s, list(history), output_tokens, len(out) + 1))
        back = start + (turns - 1) * turn_gap_s + pause_s
        head = system + history[system_tokens : system_tokens + page_size]
        probe = _request(f"{name}/probe", name, back, head + ids.take(probe_tokens), 16, len(out) + 1)
        if hints:
            probe = Request(probe.request_id, probe.session, probe.arrival_s, probe.input_ids, probe.output_length, probe.line,
                            hints=(Hint("prefetch", session=name),))
        out.append(probe)
        out.append(_request(f"{name}/cont", name, back + lead_s, history + ids.take(question_tokens), output_tokens, len(out) + 1))
    return sorted(out, key=lambda r: (r.arrival_s, r.line))


def branch(sessions: int = 16, siblings: int = 4, doc_tokens: int = 4096, branch_tokens: int = 2048, system_tokens: int = 1024,
           question_tokens: int = 256, output_tokens: int = 64, branch_gap_s: float = 1.0, session_gap_s: float = 6.0,
           pause_s: float = 120.0, lead_s: float = 2.0, spread_s: float = 0.4, page_size: int = 256, seed: int = 0) -> list[Request]:
    """The `branch` shape (module docstring), in arrival order."""
    rng = random.Random(seed)
    doc_tokens, branch_tokens = _pages(doc_tokens, page_size), _pages(branch_tokens, page_size)
    system_tokens, question_tokens = _pages(system_tokens, page_size), _pages(question_tokens, page_size)
    system = _ids(SYSTEM_ID, system_tokens)
    out: list[Request] = []
    for s in range(sessions):
        ids = _Ids(s)
        name = f"branch{s}"
        start = s * session_gap_s + rng.uniform(0, 0.5)
        doc = system + ids.take(doc_tokens)
        out.append(_request(f"{name}/doc", name, start, list(doc), output_tokens, len(out) + 1))
        branches = [doc + ids.take(branch_tokens) for _ in range(siblings)]
        for i, b in enumerate(branches):
            out.append(_request(f"{name}/branch{i}", name, start + (i + 1) * branch_gap_s, b, output_tokens, len(out) + 1))
        back = start + siblings * branch_gap_s + pause_s
        out.append(_request(f"{name}/probe", name, back, doc + ids.take(question_tokens), 16, len(out) + 1))
        for i, b in enumerate(branches):
            t = back + lead_s + spread_s * i / max(1, siblings - 1)
            out.append(_request(f"{name}/revisit{i}", name, t, b + ids.take(question_tokens), output_tokens, len(out) + 1))
    return sorted(out, key=lambda r: (r.arrival_s, r.line))


SHAPES = {"chain": chain, "branch": branch}


def write_plain(requests: list[Request], f: IO[str]) -> int:
    """Write `requests` as plain JSONL (`replay/plain.py`, hints included). Returns the count."""
    for r in requests:
        row: dict = {"id": r.request_id, "session": r.session, "input_ids": list(r.input_ids), "output_length": r.output_length,
                     "timestamp": r.arrival_s}
        if r.hints:
            row["hints"] = [{k: v for k, v in (("action", h.action), ("input_ids", list(h.input_ids) if h.input_ids else None),
                                               ("session", h.session), ("ttl_s", h.ttl_s), ("after_s", h.after_s or None))
                             if v is not None} for h in r.hints]
        f.write(json.dumps(row) + "\n")
    return len(requests)
