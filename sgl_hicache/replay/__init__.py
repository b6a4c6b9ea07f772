"""Trace readers: Mooncake-style JSONL, ShareGPT-style conversations, plain JSONL of requests.

`load_trace(path)` picks the reader (see `detect_format`) and returns `Request`s sorted by arrival.
Formats and validation rules: docs/trace-formats.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .mooncake import read_mooncake
from .plain import read_plain
from .sharegpt import read_sharegpt
from .trace import ByteTokenizer, HFTokenizer, Request, Tokenizer, TraceError, load_tokenizer

READERS = {"mooncake": read_mooncake, "sharegpt": read_sharegpt, "plain": read_plain}
FORMATS = tuple(READERS)


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its content (then its name).

    A file whose first non-blank character is ``[`` is ShareGPT (a JSON array of conversations).
    Otherwise the first non-blank line is parsed: an object with ``hash_ids`` is Mooncake, one with
    ``conversations`` is ShareGPT as JSONL, anything else is plain. When that line is not JSON the
    extension decides (``.json`` ShareGPT, else plain) and the reader reports the error.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"trace file {str(p)!r} does not exist")
    if p.is_dir():
        raise TraceError(p, 1, "is a directory, not a trace file")
    first = b""
    with p.open("rb") as f:
        for raw in f:
            if raw.strip():
                first = raw
                break
    if first.lstrip()[:1] == b"[":
        return "sharegpt"
    try:
        obj = json.loads(first.decode("utf-8"))
    except (ValueError, RecursionError):  # includes bad UTF-8; the reader will name the line
        if b'"hash_ids"' in first:
            return "mooncake"
        return "sharegpt" if p.suffix.lower() == ".json" else "plain"
    if isinstance(obj, dict):
        if "hash_ids" in obj:
            return "mooncake"
        if "conversations" in obj:
            return "sharegpt"
    return "plain"


def load_trace(path: str | Path, fmt: str = "auto", **opts: Any) -> list[Request]:
    """Read a trace file into requests sorted by arrival.

    `fmt` is ``"auto"`` (see `detect_format`), ``"mooncake"``, ``"sharegpt"`` or ``"plain"``; `opts`
    go to that reader (`read_mooncake`, `read_sharegpt`, `read_plain`); an option the reader does not
    take is a ValueError naming it. Malformed content raises `TraceError` (``FILE:LINE: reason``).
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
        raise ValueError(f"the {fmt} reader takes no option(s) {', '.join(bad)}; it takes {', '.join(sorted(accepted))}")
    return reader(path, **opts)


__all__ = [
    "ByteTokenizer",
    "FORMATS",
    "HFTokenizer",
    "Request",
    "Tokenizer",
    "TraceError",
    "detect_format",
    "load_tokenizer",
    "load_trace",
    "read_mooncake",
    "read_plain",
    "read_sharegpt",
]
