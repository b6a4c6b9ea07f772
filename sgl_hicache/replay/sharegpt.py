"""ShareGPT-style conversation traces: real multi-turn text.

The file is a JSON array of conversations (or JSONL, one conversation a line)::

    [{"id": "abc", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}, ...]}]

The OpenAI-style form that vLLM's multi-turn benchmark reads (benchmarks/multi_turn, written by its
convert_sharegpt_to_openai.py) is the same with other keys, and is read the same way::

    [{"id": "abc", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]

Roles: ``human``/``user`` ask; ``gpt``/``assistant``/``chatgpt``/``bard``/``bing``/``model`` answer;
``system`` text is prepended to the history. Any other role is an error.

Each asking turn becomes a request whose prompt is the whole history so far (system text, every earlier
question and answer) plus the new question; the answer that follows it gives `output_length` (its token
count, at least 1) and is appended to the history. A question with no answer after it gets
`missing_output_length` and adds nothing to the history.

Duplicate ids. The canonical ShareGPT_V3_unfiltered_cleaned_split.json repeats some ids (20 in its
first 3,000 conversations); a repeated id becomes ``<id>#2`` (``#3``, ...), noted once with a count.

Tokenisation: every message is encoded on its own, as ``"<role>: <text>\\n"`` (role ``System``, ``User``
or ``Assistant``), and the token lists are concatenated, so turn N's prompt is an exact token prefix of
turn N+1's: the reuse a prefix cache should find. The tokenizer is a `tokenizers` ``tokenizer.json``
from a local folder, or the byte-level fallback when `tokenizer` is None.

Arrivals: conversation k (in file order) starts at ``k * conversation_interval_s``; each later turn
arrives `think_time_s` after the previous one. These are lower bounds: an engine that keeps a session's
turns in order makes a turn wait for the previous answer anyway. Session = conversation id (the ``id``
field, else ``"c<index>"``); request id = ``"<session>#<turn>"``; `line` = the line where the
conversation object starts.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from .trace import (
    ReadNotes,
    Request,
    Tokenizer,
    Trace,
    TraceError,
    _short,
    check_positive_int,
    encode_text,
    get_id,
    load_tokenizer,
    parse_json,
    read_text,
    sort_by_arrival,
    unique_id,
)

ASK_ROLES = {"human", "user"}
ANSWER_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}
SYSTEM_ROLES = {"system"}
MESSAGE_KEYS = (("conversations", "from", "value"), ("messages", "role", "content"))  # ShareGPT, OpenAI/vLLM


def _iter_conversations(path: Path, text: str):
    """Yield ``(line, object)`` for every conversation, from a JSON array or from JSONL."""
    stripped = text.lstrip()
    if not stripped:
        raise TraceError(path, 1, "empty trace: no conversations in the file")
    cursor = [0, 1]  # (position, line at that position): positions mostly grow, so count incrementally

    def line_of(pos: int) -> int:
        at, line = cursor
        if pos < at:
            at, line = 0, 1
        line += text.count("\n", at, pos)
        cursor[:] = [pos, line]
        return line

    if stripped[0] != "[":  # JSONL
        for number, raw in enumerate(text.split("\n"), start=1):
            if raw.strip():
                yield number, parse_json(path, number, raw)
        return
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)

    def skip_ws(p: int) -> int:
        while p < n and text[p] in " \t\r\n":
            p += 1
        return p

    pos = skip_ws(pos)
    if pos < n and text[pos] == "]":
        raise TraceError(path, line_of(pos), "empty trace: the array holds no conversations")
    while True:
        pos = skip_ws(pos)
        if pos >= n:
            raise TraceError(
                path, line_of(len(text.rstrip()) - 1), "not valid JSON: the array is not closed (truncated file?)"
            )
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise TraceError(path, e.lineno, f"not valid JSON: {e.msg} (column {e.colno})") from e
        except (ValueError, RecursionError) as e:
            raise TraceError(path, line_of(pos), f"not valid JSON: {type(e).__name__}: {e}") from e
        yield line_of(pos), obj
        pos = skip_ws(end)
        if pos >= n:
            raise TraceError(
                path, line_of(len(text.rstrip()) - 1), "not valid JSON: the array is not closed (truncated file?)"
            )
        if text[pos] == "]":
            rest = text[pos + 1 :].strip()
            if rest:
                raise TraceError(
                    path,
                    line_of(pos + 1 + text[pos + 1 :].index(rest[0])),
                    "not valid JSON: extra data after the array",
                )
            return
        if text[pos] != ",":
            raise TraceError(
                path, line_of(pos), f"not valid JSON: expected ',' or ']' between conversations, got {text[pos]!r}"
            )
        pos += 1


def read_sharegpt(
    path: str | Path,
    *,
    tokenizer: str | Path | Tokenizer | None = None,
    limit: int | None = None,
    think_time_s: float = 5.0,
    conversation_interval_s: float = 1.0,
    missing_output_length: int = 128,
) -> Trace:
    """Read a ShareGPT-style JSON (or JSONL) file; see the module docstring. `limit` counts requests."""
    p = Path(path)
    tok = load_tokenizer(tokenizer)
    for name, given in (("think_time_s", think_time_s), ("conversation_interval_s", conversation_interval_s)):
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not given >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {given!r}")
    if limit is not None:
        check_positive_int("limit", limit, minimum=0)
    check_positive_int("missing_output_length", missing_output_length, minimum=0)
    text = read_text(p)

    out: list[Request] = []
    notes = ReadNotes()
    if limit == 0:
        return Trace(out, notes)
    prefixes = {"system": tok.encode("System: "), "ask": tok.encode("User: "), "answer": tok.encode("Assistant: ")}
    newline = tok.encode("\n")
    seen_ids: set[str] = set()
    for index, (line, conv) in enumerate(_iter_conversations(p, text)):
        if not isinstance(conv, dict):
            raise TraceError(p, line, f"conversation {index} must be a JSON object, got {type(conv).__name__}")
        written = get_id(p, line, conv.get("id", f"c{index}"), f"conversation {index}: field 'id'")
        session = unique_id(seen_ids, written)
        if session != written:
            notes.add(
                "duplicate-id",
                p,
                line,
                f"duplicate conversation ids made unique with a '#<n>' suffix (first: {written!r} -> {session!r})",
            )
        list_key, role_key, text_key = next((k for k in MESSAGE_KEYS if k[0] in conv), MESSAGE_KEYS[0])
        turns = conv.get(list_key)
        if turns is None:
            raise TraceError(p, line, f"conversation {session!r}: missing field 'conversations' (or 'messages')")
        if not isinstance(turns, list):
            raise TraceError(p, line, f"conversation {session!r}: field {list_key!r} must be an array")
        messages: list[tuple[str, str]] = []
        for t, msg in enumerate(turns):
            if not isinstance(msg, dict):
                raise TraceError(p, line, f"conversation {session!r} message {t}: must be an object, got {_short(msg)}")
            role, value = msg.get(role_key), msg.get(text_key)
            if not isinstance(role, str):
                raise TraceError(
                    p,
                    line,
                    f"conversation {session!r} message {t}: field {role_key!r} must be a string, got {_short(role)}",
                )
            if not isinstance(value, str):
                raise TraceError(
                    p,
                    line,
                    f"conversation {session!r} message {t}: field {text_key!r} must be a string, got {_short(value)}",
                )
            r = role.lower()
            kind = (
                "ask" if r in ASK_ROLES else "answer" if r in ANSWER_ROLES else "system" if r in SYSTEM_ROLES else None
            )
            if kind is None:
                raise TraceError(p, line, f"conversation {session!r} message {t}: unknown role {role!r}")
            messages.append((kind, value))

        def encode(kind: str, value: str, line: int = line, session: str = session) -> list[int]:
            return prefixes[kind] + encode_text(p, line, tok, value, f"conversation {session!r}").tolist() + newline

        history = array("q")
        start = index * float(conversation_interval_s)
        turn = 0
        i = 0
        while i < len(messages):
            kind, value = messages[i]
            if kind != "ask":
                history.extend(encode(kind, value))
                i += 1
                continue
            history.extend(encode("ask", value))
            prompt = array("q", history)
            if i + 1 < len(messages) and messages[i + 1][0] == "answer":
                answer = encode("answer", messages[i + 1][1])
                output_length = max(1, len(answer) - len(prefixes["answer"]) - len(newline))
                history.extend(answer)
                i += 2
            else:
                output_length = missing_output_length
                i += 1
            out.append(
                Request(
                    request_id=f"{session}#{turn}",
                    session=session,
                    arrival_s=start + turn * float(think_time_s),
                    input_ids=prompt,
                    output_length=output_length,
                    line=line,
                )
            )
            turn += 1
            if limit is not None and len(out) >= limit:
                return sort_by_arrival(out, notes)
    if not out:
        raise TraceError(p, 1, "no requests: no conversation has a human turn")
    return sort_by_arrival(out, notes)


__all__ = ["read_sharegpt"]
