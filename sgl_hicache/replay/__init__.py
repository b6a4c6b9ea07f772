"""Trace readers: Mooncake-style JSONL, ShareGPT-style conversations (and vLLM's OpenAI-style
ones), plain JSONL of requests, Azure LLM inference CSV, SGLang benchmark outputs, recorded agent
sessions (kv-cache-tester JSON: a file or a folder of them).

`load_trace(path)` picks the reader (see `detect_format`) and returns a `Trace`: the `Request`s
sorted by arrival, with the read's `notes` (each lenient choice once). Formats and validation rules:
docs/trace-formats.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .agent_sessions import looks_like_session, read_agent_sessions
from .lengths import read_azure, read_sglang_bench
from .mooncake import read_mooncake
from .plain import read_plain
from .sharegpt import read_sharegpt
from .trace import ByteTokenizer, HFTokenizer, Note, ReadNotes, Request, Tokenizer, Trace, TraceError, load_tokenizer

READERS: dict[str, Callable[..., Trace]] = {
    "mooncake": read_mooncake,
    "sharegpt": read_sharegpt,
    "plain": read_plain,
    "azure": read_azure,
    "sglang-bench": read_sglang_bench,
    "agent-sessions": read_agent_sessions,
}
BENCH_KEYS = ("input_lens", "details", "user_data", "summary")  # what SGLang's benchmarks write
FORMATS = tuple(READERS)


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its content (then its name).

    A folder, or a file that opens as a JSON object holding ``"requests"`` and ``"block_size"`` or
    ``"hash_id_scope"`` in its first 4 KiB, is agent sessions (kv-cache-tester); a folder with no
    ``.json`` file in it is a TraceError.
    A file whose first non-blank character is ``[`` is ShareGPT (a JSON array of conversations,
    ShareGPT's or the OpenAI/vLLM form). A first line holding ``ContextTokens`` is an Azure CSV header.
    Otherwise the first non-blank line is parsed: an object with ``hash_ids`` is Mooncake, one with
    ``conversations`` or ``messages`` is ShareGPT as JSONL, one with ``input_lens``, ``details``,
    ``user_data`` or ``summary`` is an SGLang benchmark output, anything else is plain. When that
    line is not JSON the extension decides (``.json`` ShareGPT, ``.csv`` Azure, else plain) and the
    reader reports the error.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"trace file {str(p)!r} does not exist")
    if p.is_dir() or looks_like_session(p):
        return "agent-sessions"
    first = b""
    with p.open("rb") as f:
        for raw in f:
            if raw.strip():
                first = raw
                break
    if first.lstrip()[:1] == b"[":
        return "sharegpt"
    if first.lstrip()[:1] != b"{" and b"contexttokens" in first.lower():
        return "azure"
    try:
        obj = json.loads(first.decode("utf-8"))
    except (ValueError, RecursionError):  # includes bad UTF-8; the reader will name the line
        if b'"hash_ids"' in first:
            return "mooncake"
        return {".json": "sharegpt", ".csv": "azure"}.get(p.suffix.lower(), "plain")
    if isinstance(obj, dict):
        if "hash_ids" in obj:
            return "mooncake"
        if "conversations" in obj or "messages" in obj:
            return "sharegpt"
        if any(k in obj for k in BENCH_KEYS):
            return "sglang-bench"
    return "plain"


def load_trace(path: str | Path, fmt: str = "auto", **opts: Any) -> Trace:
    """Read a trace file into requests sorted by arrival.

    `fmt` is ``"auto"`` (see `detect_format`) or a name in `FORMATS`; `opts` go to that reader
    (`READERS`); an option the reader does not take is a ValueError naming it. Malformed content
    raises `TraceError` (``FILE:LINE: reason``). The `Trace` returned carries the read's notes.
    """
    if fmt == "auto":
        fmt = detect_format(path)
    reader = READERS.get(fmt)
    if reader is None:
        raise ValueError(f"unknown trace format {fmt!r}; choose one of auto, {', '.join(FORMATS)}")
    import inspect

    accepted = {n for n, prm in inspect.signature(reader).parameters.items() if prm.kind is prm.KEYWORD_ONLY}
    bad = sorted(set(opts) - accepted)
    if bad:
        raise ValueError(
            f"the {fmt} reader takes no option(s) {', '.join(bad)}; it takes {', '.join(sorted(accepted))}"
        )
    return reader(path, **opts)


__all__ = [
    "ByteTokenizer",
    "FORMATS",
    "HFTokenizer",
    "Note",
    "READERS",
    "ReadNotes",
    "Request",
    "Tokenizer",
    "Trace",
    "TraceError",
    "detect_format",
    "load_tokenizer",
    "load_trace",
    "read_agent_sessions",
    "read_azure",
    "read_mooncake",
    "read_plain",
    "read_sglang_bench",
    "read_sharegpt",
]
