"""Recorded coding-agent sessions in the kv-cache-tester format: one JSON object per session file.

A session is ``{"id", "block_size", "hash_id_scope", "requests": [...]}`` (other fields ignored). An
entry of ``requests`` with ``type`` ``"n"`` or ``"s"`` is a model call: ``t`` (seconds from the
session's start), ``in`` / ``out`` (input and output tokens), ``hash_ids`` (the prompt's
`block_size`-token blocks, in order: ``in // block_size`` ids, or one more for a partial last
block), optional ``input_types``, ``stop`` (``tool_use`` / ``end_turn``) and ``api_time`` (the
call's own seconds). An entry with ``type`` ``"subagent"`` records a sub-agent's run without its
calls. `read_agent_sessions` reads one file or a folder of them (every ``*.json`` in it, by name).

What the reader does, each choice recorded once as a `Note` of the returned `Trace`:

- Tokens. Every hash id becomes `block_scale` token ids (default `block_size`: contexts kept whole)
  drawn as the Mooncake reader draws them (`TokenSynth`): equal ids, equal tokens. With
  ``hash_id_scope: "local"`` an id names a block within its session only, so ids are namespaced per
  session (the same id in two sessions gives different tokens); ``"global"`` shares them. A prompt
  is ``ceil(in * block_scale / block_size)`` tokens: its blocks, then the partial block no id
  covers, drawn from the next call's block at that position when the next call continues the
  prompt (so a prompt is a prefix of its continuation, tail included), else a tail of its own.
  Output lengths are kept as recorded.
- Time. The gap between a call's end (``t + api_time``) and the next call is cut to `gap_cap_s`
  when longer; a call without ``api_time`` counts as ending when it starts. A session starts at its
  first call; the i-th of N sessions (in file-name order) starts at ``i * session_spread_s / N``.
- Sub-agents. Their calls are not in the file, so nothing of them is replayed; the time they ran
  stays in the gap between the calls around them (cut like any gap).
- What preceded each call (`Request.preceded_by`): ``none`` for a session's first call, ``tool``
  after a call that stopped on ``tool_use``, ``person`` after one that stopped on ``end_turn``;
  after a call with no stop reason, ``tool`` when the call's ``input_types`` hold ``tool_result``,
  else ``person``.
- What each call ended in (`Request.ends_in`): ``tool`` for ``tool_use``, ``person`` for
  ``end_turn``, None for another or no stop reason.
- Hints (`hints`, default on): what an agent framework sends, from `tool_hints.call_hints`: a
  tool-call retention on each call that stops on ``tool_use`` (its estimate the time from the
  call's start to the next call's, the recorded answer time included since a replayed answer may end
  sooner while the next call keeps its time, with a relative error of up to `hint_estimate_error`,
  seeded by `hint_seed`), an end on each session's
  last call.

Request ids are ``"<session id>#<k>"`` (k: the call's index among the session's calls), sessions
the file's ``id`` (the file name when there is none; repeated ids made unique), `line` the entry's
1-based position in ``requests``. Malformed content raises `TraceError` naming the file, the entry
and the field (``FILE:1: requests[3]: field 'in' must be an integer ...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .mooncake import _FixedSynth
from .tool_hints import MAX_TTL_S, call_hints, estimate_s
from .trace import (
    ReadNotes,
    Request,
    TokenSynth,
    Trace,
    TraceError,
    _jtype,
    _short,
    check_synth_options,
    get_hash_ids,
    get_id,
    get_int,
    get_number,
    parse_json,
    read_text,
    sort_by_arrival,
    unique_id,
)

CALL_TYPES = ("n", "s")  # kv-cache-tester's model calls (sent whole, streamed)
SUBAGENT = "subagent"
ENDS = {"tool_use": "tool", "end_turn": "person"}  # a call's stop reason as `Request.ends_in`
SCOPES = ("local", "global")
DEFAULT_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 1024  # tokens a hash id may cover: a few ids must not stand for millions of tokens


@dataclass
class _Call:
    """One model call as read: what the replay needs of it."""

    entry: int  # index in the session's ``requests``
    t: float
    api_s: float | None
    tokens_in: int
    tokens_out: int
    hash_ids: list[int]
    input_types: list[str]
    stop: str


@dataclass
class _Session:
    path: Path
    name: str
    block_size: int
    scope: str
    calls: list[_Call]
    subagents: int
    subagent_calls: int


def session_files(path: str | Path) -> list[Path]:
    """The session files `path` names: itself, or a folder's ``*.json`` files sorted by name."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    files = sorted(f for f in p.glob("*.json") if f.is_file())
    if not files:
        raise TraceError(p, 1, "the folder holds no .json session files")
    return files


def looks_like_session(path: Path) -> bool:
    """Whether the start of `path` reads as a kv-cache-tester session (an object with ``"requests"``
    and ``"block_size"`` or ``"hash_id_scope"`` near its start)."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return (
        head.lstrip()[:1] == b"{" and b'"requests"' in head and (b'"hash_id_scope"' in head or b'"block_size"' in head)
    )


def _fail(path: Path, entry: int, reason: str) -> TraceError:
    return TraceError(path, 1, f"requests[{entry}]: {reason}")


def _read_call(path: Path, i: int, obj: dict, block_size: int) -> _Call:
    try:
        t = get_number(path, 1, obj, "t")
        tokens_in = get_int(path, 1, obj, "in", minimum=1)
        tokens_out = get_int(path, 1, obj, "out", minimum=0)
        api_s = get_number(path, 1, obj, "api_time", required=False)
        ids = get_hash_ids(path, 1, obj)
    except TraceError as e:
        raise _fail(path, i, e.reason) from None
    full, blocks = tokens_in // block_size, -(-tokens_in // block_size)
    if len(ids) not in (full, blocks):
        raise _fail(
            path,
            i,
            f"field 'hash_ids' has {len(ids)} ids but 'in' {tokens_in} is {full} whole blocks of {block_size} tokens"
            + (f" (or {blocks} with the partial one)" if blocks != full else ""),
        )
    types = obj.get("input_types", [])
    if not isinstance(types, list) or not all(isinstance(x, str) for x in types):
        raise _fail(path, i, f"field 'input_types' must be an array of strings, got {_short(types)}")
    stop = obj.get("stop", "")
    if stop is None:
        stop = ""
    if not isinstance(stop, str):
        raise _fail(path, i, f"field 'stop' must be a string, got {_short(stop)}")
    return _Call(i, t, api_s, tokens_in, tokens_out, ids, types, stop)


def _read_session(path: Path, notes: ReadNotes) -> _Session:
    text = read_text(path)
    if not text.strip():
        raise TraceError(path, 1, "empty file: no session in it")
    obj = parse_json(path, 1, text)
    if not isinstance(obj, dict):
        raise TraceError(path, 1, f"expected a JSON object (one session), got {_jtype(obj)}")
    if "requests" not in obj:
        raise TraceError(path, 1, "missing field 'requests'")
    entries = obj["requests"]
    if not isinstance(entries, list):
        raise TraceError(path, 1, f"field 'requests' must be an array, got {_jtype(entries)}")
    if "block_size" in obj:
        block_size = get_int(path, 1, obj, "block_size", minimum=1)
        if block_size > MAX_BLOCK_SIZE:
            raise TraceError(path, 1, f"field 'block_size' must be <= {MAX_BLOCK_SIZE}, got {block_size}")
    else:
        block_size = DEFAULT_BLOCK_SIZE
        notes.add("no-block-size", path, 1, f"no 'block_size': read as {DEFAULT_BLOCK_SIZE} tokens a hash id")
    scope = obj.get("hash_id_scope", "local")
    if scope not in SCOPES:
        raise TraceError(path, 1, f"field 'hash_id_scope' must be one of {', '.join(SCOPES)}, got {_short(scope)}")
    if "id" in obj:
        name = get_id(path, 1, obj["id"], "field 'id'")
    else:
        name = path.stem
        notes.add("no-id", path, 1, "no 'id': the session is named after its file")
    calls: list[_Call] = []
    subagents = subagent_calls = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise _fail(path, i, f"must be an object, got {_jtype(entry)}")
        kind = entry.get("type")
        if kind == SUBAGENT:
            subagents += 1
            inner = entry.get("requests")
            subagent_calls += len(inner) if isinstance(inner, list) else 0
            continue
        if kind not in CALL_TYPES:
            raise _fail(
                path,
                i,
                f"field 'type' must be one of {', '.join(map(repr, (*CALL_TYPES, SUBAGENT)))}, got {_short(kind)}",
            )
        call = _read_call(path, i, entry, block_size)
        if calls and call.t < calls[-1].t:
            raise _fail(
                path, i, f"field 't' {call.t:g} is before the previous call's {calls[-1].t:g} (calls are in time order)"
            )
        calls.append(call)
    return _Session(path, name, block_size, scope, calls, subagents, subagent_calls)


def _preceded_by(prev: _Call | None, call: _Call) -> tuple[str, bool]:
    """What came before `call` (`records.PRECEDED_BY`), and whether it was read from its input types."""
    if prev is None:
        return "none", False
    if prev.stop == "tool_use":
        return "tool", False
    if prev.stop == "end_turn":
        return "person", False
    return ("tool" if "tool_result" in call.input_types else "person"), True


class _Ids:
    """Hash ids renumbered into one id space: per session with a local scope, shared with a global one."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, int], int] = {}

    def map(self, space: str, ids: list[int]) -> list[int]:
        table = self.ids
        return [table.setdefault((space, h), len(table)) for h in ids]

    def fresh(self) -> int:
        """A new id no hash id maps to (a call's own partial block)."""
        key = len(self.ids)
        self.ids[("#own", key)] = key
        return key


def _check_options(
    block_scale: int | None, gap_cap_s: float | None, session_spread_s: float, hint_estimate_error: float
) -> None:
    if block_scale is not None and (
        isinstance(block_scale, bool) or not isinstance(block_scale, int) or block_scale < 1
    ):
        raise ValueError(f"block_scale must be an integer >= 1, got {block_scale!r}")
    if gap_cap_s is not None and not gap_cap_s >= 0:
        raise ValueError(f"gap_cap_s must be >= 0, got {gap_cap_s!r}")
    if not session_spread_s >= 0:
        raise ValueError(f"session_spread_s must be >= 0, got {session_spread_s!r}")
    if not hint_estimate_error >= 0:
        raise ValueError(f"hint_estimate_error must be >= 0, got {hint_estimate_error!r}")


def read_agent_sessions(
    path: str | Path,
    *,
    block_scale: int | None = None,
    gap_cap_s: float | None = None,
    session_spread_s: float = 0.0,
    hints: bool = True,
    hint_estimate_error: float = 0.0,
    hint_seed: int = 0,
    limit: int | None = None,
    vocab_size: int = 32000,
    token_offset: int = 16,
    seed: int = 0,
) -> Trace:
    """Read a kv-cache-tester session file, or a folder of them, into requests sorted by arrival
    (module docstring). `limit` keeps the first N requests by arrival. TraceError for malformed
    content, ValueError for a bad option; the returned `Trace` carries the read's notes."""
    _check_options(block_scale, gap_cap_s, session_spread_s, hint_estimate_error)
    check_synth_options(vocab_size, token_offset, seed)
    notes = ReadNotes()
    files = session_files(path)
    sessions = [_read_session(f, notes) for f in files]
    names: set[str] = set()
    for s in sessions:
        name = unique_id(names, s.name)
        if name != s.name:
            notes.add("same-id", s.path, 1, f"session id {s.name!r} repeats an earlier file's: named {name!r}")
            s.name = name
    options = _Options(block_scale, gap_cap_s, session_spread_s, hints, hint_estimate_error, hint_seed)
    tally = _Tally()
    out = _requests(sessions, options, TokenSynth(vocab_size, token_offset, seed), tally)
    _note_choices(notes, Path(path), sessions, options, tally)
    trace = sort_by_arrival(out, notes)
    if limit is not None:
        del trace[limit:]
    return trace


@dataclass(frozen=True)
class _Options:
    block_scale: int | None
    gap_cap_s: float | None
    spread_s: float
    hints: bool
    error: float
    hint_seed: int


@dataclass
class _Tally:
    """What the notes count."""

    cuts: int = 0
    longest_cut_s: float = 0.0
    no_api: int = 0
    inferred: int = 0
    pins: int = 0
    ends: int = 0
    capped_ttl: int = 0


def _gaps(calls: list[_Call], cap_s: float | None, tally: _Tally) -> list[float | None]:
    """The gap the replay keeps after each call (to the next call's start; None after the last)."""
    out: list[float | None] = []
    for call, nxt in zip(calls, calls[1:]):
        gap = max(0.0, nxt.t - call.t - (call.api_s or 0.0))
        tally.no_api += call.api_s is None
        if cap_s is not None and gap > cap_s:
            tally.cuts, tally.longest_cut_s = tally.cuts + 1, max(tally.longest_cut_s, gap)
            gap = cap_s
        out.append(gap)
    return [*out, None] if calls else []


def _requests(sessions: list[_Session], options: _Options, synth: TokenSynth, tally: _Tally) -> list[Request]:
    blocks: dict[int, _FixedSynth] = {}  # one per block size in the replay
    ids = _Ids()
    out: list[Request] = []
    for index, s in enumerate(sessions):
        scale = s.block_size if options.block_scale is None else options.block_scale
        fixed = blocks.setdefault(scale, _FixedSynth(synth, scale))
        space = s.name if s.scope == "local" else ""
        arrival = index * options.spread_s / len(sessions)
        gaps = _gaps(s.calls, options.gap_cap_s, tally)
        for k, call in enumerate(s.calls):
            if k:  # the previous call's start + its own time + the gap kept (the whole interval when shorter)
                prev = s.calls[k - 1]
                arrival += min(call.t - prev.t, (prev.api_s or 0.0) + (gaps[k - 1] or 0.0))
            length = -(-call.tokens_in * scale // s.block_size)
            keys = ids.map(space, call.hash_ids)
            if len(keys) * scale < length:
                keys.append(_tail_key(call, s.calls[k + 1] if k + 1 < len(s.calls) else None, ids, space))
            prompt = fixed.tokens(keys, length)
            after, read_types = _preceded_by(s.calls[k - 1] if k else None, call)
            tally.inferred += read_types
            gap = gaps[k]
            until_next = None if gap is None else (call.api_s or 0.0) + gap
            hinted = _hints(prompt, call, until_next, options, s.name, k, tally) if options.hints else ()
            out.append(
                Request(
                    f"{s.name}#{k}",
                    s.name,
                    round(arrival, 6),
                    prompt,
                    call.tokens_out,
                    call.entry + 1,
                    hinted,
                    after,
                    ENDS.get(call.stop),
                )
            )
    return out


def _tail_key(call: _Call, nxt: _Call | None, ids: _Ids, space: str) -> int:
    """The id of a call's partial last block (no hash id covers it). When the session's next call
    continues this prompt (its hash ids start with all of this call's), those tokens are the start
    of the next call's block at that position, so the tail is drawn from that block's id: the whole
    prompt, tail included, is a prefix of the next one, as the real conversation's was. Otherwise
    (the last call, or a context that was rewritten) the tail is the call's own."""
    n = len(call.hash_ids)
    if nxt is not None and len(nxt.hash_ids) > n and nxt.hash_ids[:n] == call.hash_ids:
        return ids.map(space, [nxt.hash_ids[n]])[0]
    return ids.fresh()


def _hints(
    prompt: Sequence[int], call: _Call, gap_s: float | None, options: _Options, session: str, k: int, tally: _Tally
) -> tuple:
    est = None if gap_s is None else estimate_s(gap_s, options.error, options.hint_seed, session, k)
    hinted = call_hints(prompt, stop=call.stop, gap_s=gap_s, estimate=est)
    for h in hinted:
        tally.pins += h.action == "pin"
        tally.ends += h.action == "demote"
        tally.capped_ttl += h.ttl_s == MAX_TTL_S
    return hinted


def _note_choices(notes: ReadNotes, where: Path, sessions: list[_Session], options: _Options, tally: _Tally) -> None:
    """Every choice of the read, once, with its counts."""
    sizes = "/".join(map(str, sorted({s.block_size for s in sessions})))
    if options.block_scale is None:
        notes.add("block-scale", where, 1, f"contexts kept whole: each hash id is {sizes} tokens")
    else:
        notes.add(
            "block-scale",
            where,
            1,
            f"contexts scaled down: each {sizes}-token hash id replays as {options.block_scale} tokens "
            f"(prompts x {options.block_scale}/{sizes}); output lengths kept",
        )
    local = sum(s.scope == "local" for s in sessions)
    if local:
        notes.add("scope", where, 1, f"hash ids namespaced per session ({local} sessions with hash_id_scope local)")
    if options.gap_cap_s is not None:
        notes.add(
            "gap-cap",
            where,
            1,
            f"gaps between a call's end and the next call cut to {options.gap_cap_s:g} s: {tally.cuts} cut"
            + (f", the longest {tally.longest_cut_s:g} s" if tally.cuts else ""),
        )
    n, spread = len(sessions), options.spread_s
    if n > 1:
        notes.add(
            "spread",
            where,
            1,
            f"{n} sessions start together at 0 s"
            if spread == 0
            else f"{n} sessions start {spread / n:g} s apart over {spread:g} s (in file-name order)",
        )
    subagents = sum(s.subagents for s in sessions)
    if subagents:
        notes.add(
            "subagents",
            where,
            1,
            f"{subagents} sub-agent records ({sum(s.subagent_calls for s in sessions)} calls inside them) not "
            f"replayed: their calls are not in the file; the time they ran stays in the gap between the calls around them",
        )
    if tally.no_api:
        notes.add(
            "no-api-time", where, 1, f"{tally.no_api} call(s) without 'api_time': the time to the next call is all gap"
        )
    if tally.inferred:
        notes.add(
            "preceded-by-types",
            where,
            1,
            f"{tally.inferred} call(s) follow a call with no stop reason: what preceded them is read from their input_types",
        )
    if options.hints:
        notes.add(
            "hints",
            where,
            1,
            f"hints derived as an agent framework sends them: {tally.pins} tool-call retentions (the calls that "
            f"stop on tool_use and have a next call; estimate: the time from the call's start to the next call's x (1 + u), |u| <= {options.error:g}, "
            f"seed {options.hint_seed}) and {tally.ends} session ends (each session's last call)",
        )
    if tally.capped_ttl:
        notes.add(
            "hint-ttl-cap",
            where,
            1,
            f"{tally.capped_ttl} tool-call retentions capped at {MAX_TTL_S:g} s, the longest the cache takes",
        )


__all__ = ["read_agent_sessions", "looks_like_session", "session_files"]
