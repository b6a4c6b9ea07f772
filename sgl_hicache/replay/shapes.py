"""Generated workloads where a prediction below the match point can pay.

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
- `agent` (tool-call pauses): `sessions` agents, started `session_gap_s` apart, each run `steps`
  steps over a shared tool-spec prompt (`system_tokens`) and a private task (`task_tokens`). A step
  is a request; its answer is a tool call, and the next step arrives `decode_s` (the answer being
  written) plus the tool's duration later, its prompt extended by the call (`output_tokens`) and
  the tool's result (drawn uniformly from `result_tokens`, whole pages). Tool durations are a mix:
  with probability `long_share` a long tool (a build, a test run, a browse), uniform in `long_s`;
  otherwise a short one (a search, a file read), uniform in `short_s`. Beside the agents, one-shot
  requests of `other_tokens` private tokens arrive every `other_gap_s` from the first agent's start
  to the last step (other users' traffic), so that a paused session's KV spills to host and disk
  during a long pause. Roles: ``start`` (step 0), ``resume<k>`` (step k, after tool call k),
  ``other``. With `hints`, each step followed by a tool call carries what an agent framework that
  sees its tool finishing would send: ``prefetch`` of the step's prompt (the next step's cached
  prefix, by token ids), running `lead_s` before the tool returns (``after_s``). With `pins`, a
  framework that only estimates its tools' durations: when the tool call starts (the step's request
  finished: ``at_finish``) it asks the cache to keep the step's prompt for its estimate, with the
  margin the server gives an ``expected_tool_duration_ms`` (``pin``, `ttl_s`), and it sends the
  ``prefetch`` `lead_s` before the estimate runs out; the estimate is the true duration times a
  lognormal error of spread `estimate_sigma` (0: exact).

Sizes are in tokens and rounded down to whole pages of `page_size`.
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Callable
from typing import IO

from ..policy.agent_hints import TTL_MARGIN
from ..policy.hint_rules import Hint
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


def chain(
    sessions: int = 24,
    turns: int = 4,
    turn_tokens: int = 4096,
    system_tokens: int = 1024,
    probe_tokens: int = 256,
    question_tokens: int = 256,
    output_tokens: int = 64,
    turn_gap_s: float = 4.0,
    session_gap_s: float = 6.0,
    pause_s: float = 120.0,
    lead_s: float = 2.0,
    page_size: int = 256,
    seed: int = 0,
    hints: bool = False,
) -> list[Request]:
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
            out.append(
                _request(f"{name}/turn{k}", name, start + k * turn_gap_s, list(history), output_tokens, len(out) + 1)
            )
        back = start + (turns - 1) * turn_gap_s + pause_s
        head = system + history[system_tokens : system_tokens + page_size]
        probe = _request(f"{name}/probe", name, back, head + ids.take(probe_tokens), 16, len(out) + 1)
        if hints:
            probe = Request(
                probe.request_id,
                probe.session,
                probe.arrival_s,
                probe.input_ids,
                probe.output_length,
                probe.line,
                hints=(Hint("prefetch", session=name),),
            )
        out.append(probe)
        out.append(
            _request(
                f"{name}/cont", name, back + lead_s, history + ids.take(question_tokens), output_tokens, len(out) + 1
            )
        )
    return sorted(out, key=lambda r: (r.arrival_s, r.line))


def branch(
    sessions: int = 16,
    siblings: int = 4,
    doc_tokens: int = 4096,
    branch_tokens: int = 2048,
    system_tokens: int = 1024,
    question_tokens: int = 256,
    output_tokens: int = 64,
    branch_gap_s: float = 1.0,
    session_gap_s: float = 6.0,
    pause_s: float = 120.0,
    lead_s: float = 2.0,
    spread_s: float = 0.4,
    page_size: int = 256,
    seed: int = 0,
) -> list[Request]:
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
            out.append(
                _request(f"{name}/branch{i}", name, start + (i + 1) * branch_gap_s, b, output_tokens, len(out) + 1)
            )
        back = start + siblings * branch_gap_s + pause_s
        out.append(_request(f"{name}/probe", name, back, doc + ids.take(question_tokens), 16, len(out) + 1))
        for i, b in enumerate(branches):
            t = back + lead_s + spread_s * i / max(1, siblings - 1)
            out.append(
                _request(f"{name}/revisit{i}", name, t, b + ids.take(question_tokens), output_tokens, len(out) + 1)
            )
    return sorted(out, key=lambda r: (r.arrival_s, r.line))


def agent(
    sessions: int = 24,
    steps: int = 8,
    system_tokens: int = 2048,
    task_tokens: int = 1024,
    result_tokens: tuple[int, int] = (512, 2048),
    output_tokens: int = 256,
    decode_s: float = 2.0,
    short_s: tuple[float, float] = (0.5, 4.0),
    long_s: tuple[float, float] = (30.0, 120.0),
    long_share: float = 0.3,
    session_gap_s: float = 3.0,
    other_tokens: int = 4096,
    other_gap_s: float = 0.5,
    lead_s: float = 2.0,
    page_size: int = 256,
    seed: int = 0,
    hints: bool = False,
    pins: bool = False,
    estimate_sigma: float = 0.0,
) -> list[Request]:
    """The `agent` shape (module docstring), in arrival order. Session ``agent<s>``'s step k is
    ``agent<s>/start`` (k = 0) or ``agent<s>/resume<k>``; the others are ``other<i>/other``. The
    requests are the same with and without `hints` / `pins` (the hints draw from their own seed)."""
    if not 0 <= long_share <= 1 or steps < 1:
        raise ValueError(f"agent: long_share must be in [0, 1] and steps >= 1, got {long_share}, {steps}")
    for name, (lo, hi) in (("result_tokens", result_tokens), ("short_s", short_s), ("long_s", long_s)):
        if not 0 <= lo <= hi:
            raise ValueError(f"agent: {name} must be a range (low, high) with 0 <= low <= high, got {(lo, hi)}")
    rng = random.Random(seed)
    noise = random.Random(seed + 7919)  # the framework's estimates: the requests stay the same
    system_tokens, task_tokens, output_tokens = (
        _pages(n, page_size) for n in (system_tokens, task_tokens, output_tokens)
    )
    lo_pages, hi_pages = (
        _pages(result_tokens[0], page_size) // page_size,
        _pages(result_tokens[1], page_size) // page_size,
    )
    system = _ids(SYSTEM_ID, system_tokens)
    out: list[Request] = []
    end = 0.0
    for s in range(sessions):
        ids = _Ids(s)
        name = f"agent{s}"
        t = s * session_gap_s + rng.uniform(0, 0.5)
        prompt = system + ids.take(task_tokens)
        for k in range(steps):
            req = _request(f"{name}/{'start' if k == 0 else f'resume{k}'}", name, t, list(prompt), output_tokens, 0)
            end = max(end, t)
            if k == steps - 1:
                out.append(req)
                break
            tool_s = rng.uniform(*long_s) if rng.random() < long_share else rng.uniform(*short_s)
            nxt = round(t + decode_s + tool_s, 6)
            if pins:  # when the answer is complete the tool starts: retain the conversation for the estimate
                # (with the margin the server gives `expected_tool_duration_ms`), prefetch `lead_s` before it ends
                est = max(0.1, tool_s * noise.lognormvariate(0.0, estimate_sigma)) if estimate_sigma > 0 else tool_s
                mine = tuple(prompt)
                req = Request(
                    req.request_id,
                    req.session,
                    req.arrival_s,
                    req.input_ids,
                    req.output_length,
                    0,
                    hints=(
                        Hint("pin", mine, ttl_s=round(max(1.0, est * TTL_MARGIN), 6), at_finish=True),
                        Hint("prefetch", mine, after_s=round(max(0.0, est - lead_s), 6), at_finish=True),
                    ),
                )
            elif hints:  # the framework sees its tool finishing `lead_s` ahead: the next step's prefix comes up
                after = max(0.0, nxt - lead_s - req.arrival_s)
                req = Request(
                    req.request_id,
                    req.session,
                    req.arrival_s,
                    req.input_ids,
                    req.output_length,
                    0,
                    hints=(Hint("prefetch", tuple(prompt), after_s=round(after, 6)),),
                )
            out.append(req)
            prompt = prompt + ids.take(output_tokens) + ids.take(rng.randint(lo_pages, hi_pages) * page_size)
            t = nxt
    other_ids = _Ids(sessions)
    t, i = 0.0, 0
    while t <= end:
        out.append(
            _request(
                f"other{i}/other", f"other{i}", t, other_ids.take(_pages(other_tokens, page_size)), output_tokens, 0
            )
        )
        t, i = round(t + other_gap_s, 6), i + 1
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return [
        Request(r.request_id, r.session, r.arrival_s, r.input_ids, r.output_length, n + 1, r.hints)
        for n, r in enumerate(out)
    ]


SHAPES: dict[str, Callable[..., list[Request]]] = {"chain": chain, "branch": branch, "agent": agent}


def write_plain(requests: list[Request], f: IO[str]) -> int:
    """Write `requests` as plain JSONL (`replay/plain.py`, hints included). Returns the count."""
    for r in requests:
        row: dict = {
            "id": r.request_id,
            "session": r.session,
            "input_ids": list(r.input_ids),
            "output_length": r.output_length,
            "timestamp": r.arrival_s,
        }
        if r.hints:
            row["hints"] = [
                {
                    k: v
                    for k, v in (
                        ("action", h.action),
                        ("input_ids", list(h.input_ids) if h.input_ids else None),
                        ("session", h.session),
                        ("ttl_s", h.ttl_s),
                        ("after_s", h.after_s or None),
                        ("at_finish", h.at_finish or None),
                    )
                    if v is not None
                }
                for h in r.hints
            ]
        f.write(json.dumps(row) + "\n")
    return len(requests)
