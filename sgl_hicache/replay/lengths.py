"""Traces that give lengths, not prompts: Azure LLM inference CSV and SGLang benchmark outputs.

Neither says which requests share a prefix, so every prompt is synthesised unique (pseudo-random ids
from `TokenSynth`, key ``unique:<line>[:<index>]``): a prefix cache finds nothing to reuse across
requests. Each read notes this once. The one exception is the per-request debug log of SGLang's
hicache benchmarks, which holds the prompt text (see `read_sglang_bench`).

Azure LLM inference traces (github.com/Azure/AzurePublicDataset, 2023 and 2024)::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44

``TIMESTAMP`` is a wall-clock time ``YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]`` (UTC when no offset
is written; any number of fraction digits), or a number (unit by magnitude, `timestamps_to_seconds`);
arrivals count from the earliest row. ``ContextTokens`` >= 1 is the prompt length, ``GeneratedTokens``
>= 0 the output length. Columns are found by name (case-insensitive); other columns are ignored.
"""

from __future__ import annotations

import csv
import math
import re
from array import array
from datetime import datetime, timedelta, timezone
from pathlib import Path

from .trace import (
    ReadNotes,
    Request,
    Tokenizer,
    TokenSynth,
    Trace,
    TraceError,
    _short,
    check_positive_int,
    check_synth_options,
    encode_text,
    get_id,
    get_int,
    get_timestamp,
    load_tokenizer,
    parse_json_object,
    read_lines,
    sort_by_arrival,
    timestamps_to_seconds,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_WALL_CLOCK = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,12}))?\s*(Z|[+-]\d{2}:?\d{2})?", re.ASCII
)
_COUNT = re.compile(r"\d{1,15}", re.ASCII)
NO_PREFIX = "holds no prompt content or prefix information: every prompt is synthesised unique, so no request shares a prefix with another"


def _wall_clock_seconds(path: str | Path, line: int, text: str) -> float | None:
    """Seconds since the epoch of a ``YYYY-MM-DD HH:MM:SS[.f][tz]`` string; None if it is not one."""
    m = _WALL_CLOCK.fullmatch(text)
    if m is None:
        return None
    y, mo, d, h, mi, s, frac, tz = m.groups()
    offset = timedelta(0)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    try:
        when = datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), tzinfo=timezone(offset))
    except (ValueError, OverflowError) as e:
        raise TraceError(path, line, f"TIMESTAMP {text!r} is not a valid date and time: {e}") from e
    return when.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _count(path: str | Path, line: int, name: str, text: str, minimum: int) -> int:
    if not _COUNT.fullmatch(text):
        raise TraceError(path, line, f"column {name} must be a whole number >= {minimum}, got {_short(text)}")
    value = int(text)
    if value < minimum:
        raise TraceError(path, line, f"column {name} must be >= {minimum}, got {value}")
    return value


def _check_options(limit: int | None, vocab_size: int, token_offset: int, seed: int) -> None:
    if limit is not None:
        check_positive_int("limit", limit, minimum=0)
    check_synth_options(vocab_size, token_offset, seed)


def read_azure(
    path: str | Path,
    *,
    limit: int | None = None,
    vocab_size: int = 32000,
    token_offset: int = 16,
    seed: int = 0,
) -> Trace:
    """Read an Azure LLM inference trace (CSV); see the module docstring. `limit` counts requests."""
    _check_options(limit, vocab_size, token_offset, seed)
    notes = ReadNotes()
    if limit == 0:
        return Trace([], notes)
    synth = TokenSynth(vocab_size, token_offset, seed)
    columns: dict[str, int] | None = None
    rows: list[tuple[int, float | int, int, int]] = []
    wall_clock: bool | None = None
    for line, text in read_lines(path):
        try:
            fields = [f.strip() for f in next(csv.reader([text]))]
        except csv.Error as e:
            raise TraceError(path, line, f"not valid CSV: {e}") from e
        if columns is None:
            names = {f.lower(): i for i, f in enumerate(fields)}
            missing = [c for c in AZURE_COLUMNS if c.lower() not in names]
            if missing:
                raise TraceError(
                    path,
                    line,
                    f"not an Azure LLM inference trace header: no column {', '.join(missing)} "
                    f"(expected {','.join(AZURE_COLUMNS)}, got {_short(text, 60)})",
                )
            columns = {c: names[c.lower()] for c in AZURE_COLUMNS}
            width = len(fields)
            notes.add("no-prefix", path, line, f"an Azure LLM inference trace {NO_PREFIX}")
            continue
        if len(fields) != width:
            raise TraceError(path, line, f"expected {width} CSV fields like the header, got {len(fields)}")
        stamp = fields[columns["TIMESTAMP"]]
        seconds = _wall_clock_seconds(path, line, stamp)
        if wall_clock is None:
            wall_clock = seconds is not None
        if wall_clock:
            if seconds is None:
                raise TraceError(path, line, f"TIMESTAMP {_short(stamp)} is not a date and time like the first row's")
            ts: float | int = seconds
        else:
            ts = get_timestamp(path, line, {"TIMESTAMP": stamp}, "TIMESTAMP")
        context = _count(path, line, "ContextTokens", fields[columns["ContextTokens"]], 1)
        generated = _count(path, line, "GeneratedTokens", fields[columns["GeneratedTokens"]], 0)
        rows.append((line, ts, context, generated))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise TraceError(path, 1, "empty trace: a header but no requests")
    if wall_clock:
        first = min(r[1] for r in rows)
        arrivals = [r[1] - first for r in rows]
    else:
        arrivals = timestamps_to_seconds(path, [(r[0], r[1]) for r in rows], "s", notes)
    out = [
        Request(f"L{line}", None, arrival, synth.tokens(f"unique:{line}", context), generated, line)
        for (line, _, context, generated), arrival in zip(rows, arrivals)
    ]
    return sort_by_arrival(out, notes)


# ---- SGLang benchmark outputs ----------------------------------------------------------------


def _lengths(path: str | Path, line: int, obj: dict, key: str) -> list[int]:
    value = obj.get(key)
    if not isinstance(value, list):
        raise TraceError(path, line, f"field {key!r} must be an array of token counts, got {_short(value)}")
    return [get_int(path, line, {f"{key}[{i}]": v}, f"{key}[{i}]", minimum=0) for i, v in enumerate(value)]


def read_sglang_bench(
    path: str | Path,
    *,
    tokenizer: str | Path | Tokenizer | None = None,
    limit: int | None = None,
    vocab_size: int = 32000,
    token_offset: int = 16,
    seed: int = 0,
) -> Trace:
    """Read what SGLang's benchmarks write, one JSON object a line:

    - ``python -m sglang.bench_serving --output-file F --output-details``: one line per run, with
      ``input_lens`` and ``output_lens`` (at the top level, or under ``details`` in newer versions).
      Lengths only: every prompt is unique (noted); request ``i`` of a run arrives at
      ``i / request_rate`` after the previous run's last request (together when the rate is inf).
      A run written without ``--output-details`` is an error: it holds no per-request lengths.
    - the ``--debug-log-file`` of the hicache benchmarks (benchmark/hicache/bench_mix.py):
      ``{"timestamp": s, "user_data": {"user_id", "current_round", "prompt", "return_tokens"}}`` per
      request, with the whole prompt text (tokenised like plain prompts), so rounds of one user share
      their history; session = ``user_id``, arrivals count from the earliest timestamp.
    - a ``summary`` line (bench_multiturn's --log-file, bench_mix's summary) holds aggregate metrics
      only: an error naming the line.
    """
    _check_options(limit, vocab_size, token_offset, seed)
    notes = ReadNotes()
    if limit == 0:
        return Trace([], notes)
    tok = load_tokenizer(tokenizer)
    synth = TokenSynth(vocab_size, token_offset, seed)
    out: list[Request] = []
    logged: list[tuple[int, str, str, float | int, array, int]] = []  # debug-log requests, timed after the read
    seen: set[str] = set()
    run_start = 0.0
    for line, text in read_lines(path):
        obj = parse_json_object(path, line, text)
        if "user_data" in obj:
            user = obj["user_data"]
            if not isinstance(user, dict):
                raise TraceError(path, line, f"field 'user_data' must be an object, got {_short(user)}")
            prompt = user.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise TraceError(
                    path, line, f"field 'user_data.prompt' must be a non-empty string, got {_short(prompt)}"
                )
            session = get_id(path, line, user.get("user_id"), "field 'user_data.user_id'")
            turn = get_int(path, line, user, "current_round", minimum=0)
            output_length = get_int(path, line, user, "return_tokens", minimum=0)
            ts = get_timestamp(path, line, obj, "timestamp", notes)
            rid = f"{session}#{turn}"
            if rid in seen:
                raise TraceError(path, line, f"duplicate request: user {session} round {turn} is logged twice")
            seen.add(rid)
            ids = encode_text(path, line, tok, prompt, "'user_data.prompt'")
            logged.append((line, rid, session, ts, ids, output_length))
            if limit is not None and len(out) + len(logged) >= limit:
                break
            continue
        details = obj.get("details")
        details = details if isinstance(details, dict) else obj
        if "input_lens" not in details or "output_lens" not in details:
            if "summary" in obj:
                raise TraceError(
                    path, line, "a benchmark summary line (aggregate metrics only): nothing per request to replay"
                )
            raise TraceError(
                path,
                line,
                "no per-request lengths: expected 'input_lens' and 'output_lens' "
                "(bench_serving --output-details) or 'user_data' (a hicache benchmark debug log)",
            )
        inputs, outputs = _lengths(path, line, details, "input_lens"), _lengths(path, line, details, "output_lens")
        if len(inputs) != len(outputs):
            raise TraceError(path, line, f"'input_lens' has {len(inputs)} entries but 'output_lens' {len(outputs)}")
        if not inputs:
            raise TraceError(path, line, "empty run: 'input_lens' holds no request")
        rate = obj.get("request_rate")
        gap = (
            1.0 / rate
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0
            else 0.0
        )
        notes.add(
            "no-prefix", path, line, f"an SGLang bench_serving result {NO_PREFIX}; arrivals are spaced 1/request_rate"
        )
        for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
            if n_in < 1:
                raise TraceError(path, line, f"'input_lens'[{i}] is 0: a request needs at least one prompt token")
            out.append(
                Request(
                    f"L{line}#{i}", None, run_start + i * gap, synth.tokens(f"unique:{line}:{i}", n_in), n_out, line
                )
            )
            if limit is not None and len(out) + len(logged) >= limit:
                break
        run_start = out[-1].arrival_s + gap
        if limit is not None and len(out) + len(logged) >= limit:
            break
    if logged:
        first = min(r[3] for r in logged)
        out.extend(
            Request(rid, session, float(ts - first), ids, n_out, line) for line, rid, session, ts, ids, n_out in logged
        )
    return sort_by_arrival(out, notes)


__all__ = ["read_azure", "read_sglang_bench"]
