"""Plain JSONL of requests: the project's own, simplest format (documented in docs/trace-formats.md).

One JSON object a line::

    {"session": "chat-1", "prompt": "Hello", "output_length": 32, "timestamp": 0.5}
    {"session": "chat-1", "input_ids": [101, 7592, 102], "output_length": 16}

Fields: exactly one of ``prompt`` (text, tokenised like ShareGPT text) or ``input_ids`` (non-empty
array of non-negative integers); ``output_length`` (integer >= 0, required); ``session`` (string or
integer, optional: null/absent = no session); ``timestamp`` (seconds from trace start, number >= 0,
optional: absent = the previous line's arrival, 0 for the first); ``id`` (string or integer, optional,
unique; default ``"L<line>"``); ``hints`` (array of hint objects, optional: `replay/hints.py`). Any other field is an error (a typo such as ``output_len`` must not pass
silently).
"""

from __future__ import annotations

from pathlib import Path

from .trace import (
    Request,
    Tokenizer,
    Trace,
    TraceError,
    _short,
    check_positive_int,
    encode_text,
    get_id,
    get_int,
    get_number,
    get_token_ids,
    load_tokenizer,
    parse_json_object,
    read_lines,
    sort_by_arrival,
)
from .trace_hints import parse_hints

FIELDS = {"session", "prompt", "input_ids", "output_length", "timestamp", "id", "hints"}


def read_plain(
    path: str | Path,
    *,
    tokenizer: str | Path | Tokenizer | None = None,
    limit: int | None = None,
    vocab_size: int | None = None,
) -> Trace:
    """Read a plain JSONL request file. `vocab_size`, when given, bounds every ``input_ids`` entry."""
    tok = load_tokenizer(tokenizer)
    if limit is not None:
        check_positive_int("limit", limit, minimum=0)
    if vocab_size is not None:
        check_positive_int("vocab_size", vocab_size)
    out: list[Request] = []
    if limit == 0:
        return Trace(out)
    seen_ids: set[str] = set()
    last_ts = 0.0
    for line, text in read_lines(path):
        obj = parse_json_object(path, line, text)
        unknown = sorted(set(obj) - FIELDS)
        if unknown:
            raise TraceError(
                path, line, f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(FIELDS))}"
            )
        has_prompt, has_ids = "prompt" in obj, "input_ids" in obj
        if has_prompt == has_ids:
            raise TraceError(path, line, "needs exactly one of 'prompt' (text) or 'input_ids' (token ids)")
        if has_prompt:
            prompt = obj["prompt"]
            if not isinstance(prompt, str):
                raise TraceError(path, line, f"field 'prompt' must be a string, got {_short(prompt)}")
            ids = encode_text(path, line, tok, prompt, "'prompt'")
        else:
            ids = get_token_ids(path, line, obj, "input_ids", vocab_size=vocab_size)
        if len(ids) == 0:
            raise TraceError(path, line, "empty prompt: the request has no input tokens")
        output_length = get_int(path, line, obj, "output_length", minimum=0)
        session = obj.get("session")
        if session is not None:
            session = get_id(path, line, session, "field 'session'")
        rid = get_id(path, line, obj.get("id", f"L{line}"), "field 'id'")
        if rid in seen_ids:
            raise TraceError(path, line, f"duplicate request id {rid!r}")
        seen_ids.add(rid)
        ts = get_number(path, line, obj, "timestamp", required=False, default=last_ts)
        last_ts = ts
        hints = parse_hints(path, line, obj["hints"]) if "hints" in obj else ()
        out.append(
            Request(
                request_id=rid,
                session=session,
                arrival_s=ts,
                input_ids=ids,
                output_length=output_length,
                line=line,
                hints=hints,
            )
        )
        if limit is not None and len(out) >= limit:
            break
    return sort_by_arrival(out)


__all__ = ["read_plain"]
