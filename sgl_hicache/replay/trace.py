"""What every trace reader produces: `Request`, `TraceError`, and the shared helpers.

A reader turns a file into a list of `Request`s sorted by arrival (stable, so equal arrivals keep
file order). Anything malformed raises `TraceError`, whose message is ``FILE:LINE: what was wrong``;
a reader never raises anything else for bad content (the fuzz tests hold it to that).

Token ids are `array('q')` (int64), the form `hashing.tokens_bytes` hashes without a copy.

Tokenisation of text (ShareGPT and plain prompts) goes through `load_tokenizer`: a `tokenizers`
`tokenizer.json` from a local folder, or, with no folder, the built-in byte-level tokenizer
(`ByteTokenizer`: UTF-8 byte ``b`` becomes id ``b + 3``; ids 0, 1, 2 are left for pad/bos/eos).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class TraceError(ValueError):
    """A trace file is malformed. `str()` is ``FILE:LINE: message``; `path`, `line`, `reason` are kept."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = int(line)
        self.reason = reason
        super().__init__(f"{self.path}:{self.line}: {reason}")


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    - `request_id`: unique within the trace (``"L<line>"`` unless the format carries an id; ShareGPT
      uses ``"<conversation id>#<turn>"``).
    - `session`: the conversation it belongs to, or None when unknown. Turns of one session arrive in order.
    - `arrival_s`: seconds from the start of the trace (virtual clock).
    - `input_ids`: the whole prompt, int64 token ids.
    - `output_length`: tokens to decode (>= 0).
    - `line`: 1-based line of the source file where the request (or its conversation) is written.
    """

    request_id: str
    session: str | None
    arrival_s: float
    input_ids: array = field(repr=False, hash=False)
    output_length: int
    line: int

    @property
    def input_length(self) -> int:
        return len(self.input_ids)

    def __repr__(self) -> str:  # input_ids would flood a log
        return (
            f"Request(request_id={self.request_id!r}, session={self.session!r}, arrival_s={self.arrival_s!r}, "
            f"input_length={len(self.input_ids)}, output_length={self.output_length}, line={self.line})"
        )


# ----------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """Byte-level fallback: every UTF-8 byte ``b`` becomes token id ``b + OFFSET`` (vocabulary 259)."""

    OFFSET = 3
    vocab_size = 256 + OFFSET
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        off = self.OFFSET
        return [b + off for b in text.encode("utf-8", errors="surrogatepass")]


class HFTokenizer:
    """A `tokenizers` tokenizer read from ``<folder>/tokenizer.json`` (no special tokens added)."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {str(file)!r}")
        from tokenizers import Tokenizer as _Tok  # optional dependency, imported only when used

        self._tok = _Tok.from_file(str(file))
        self.name = str(file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(tokenizer: str | Path | Tokenizer | None) -> Tokenizer:
    """None -> `ByteTokenizer`; a folder holding tokenizer.json (or the file) -> `HFTokenizer`;
    anything with an ``encode(str) -> list[int]`` method is used as it is."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, (str, Path)):
        return HFTokenizer(tokenizer)
    if callable(getattr(tokenizer, "encode", None)):
        return tokenizer
    raise TypeError(f"tokenizer must be None, a path or an object with encode(); got {type(tokenizer).__name__}")


# ----------------------------------------------------------------------------------------------
# Helpers shared by the readers

MAX_TIMESTAMP = 1e12  # seconds (or ms, before conversion); beyond this a value is certainly corrupt


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Validate a reader *option* (not file content); raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for every non-blank line of a text file; bad UTF-8 is a TraceError."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError as e:
        raise TraceError(p, 1, "is a directory, not a trace file") from e
    seen = False
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(p, number, f"not valid UTF-8 ({e.reason} at byte {e.start})") from e
        seen = True
        yield number, text
    if not seen:
        raise TraceError(p, 1, "empty trace: no requests in the file")


def parse_json(path: str | Path, line: int, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, line + e.lineno - 1, f"not valid JSON: {e.msg} (column {e.colno})") from e
    except (ValueError, RecursionError) as e:  # nesting too deep, ints too long to convert
        raise TraceError(path, line, f"not valid JSON: {type(e).__name__}: {e}") from e


def parse_json_object(path: str | Path, line: int, text: str) -> dict:
    obj = parse_json(path, line, text)
    if not isinstance(obj, dict):
        raise TraceError(path, line, f"expected a JSON object, got {_jtype(obj)}")
    return obj


def get_id(path: str | Path, line: int, value: Any, what: str) -> str:
    """An identifier field (a string or an integer, booleans refused) as a string; `what` names it
    in the error, e.g. "field 'id'"."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TraceError(path, line, f"{what} must be a string or integer, got {_short(value)}")
    return str(value)


def _jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def get_int(path: str | Path, line: int, obj: dict, key: str, *, minimum: int = 0, required: bool = True, default: int | None = None) -> int | None:
    if key not in obj:
        if required:
            raise TraceError(path, line, f"missing field {key!r}")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise TraceError(path, line, f"field {key!r} must be an integer, got {_jtype(value)} ({_short(value)})")
    if value < minimum:
        what = "negative" if value < 0 else f"less than {minimum}"
        raise TraceError(path, line, f"field {key!r} must be >= {minimum}, got {value} ({what})")
    return value


def get_number(path: str | Path, line: int, obj: dict, key: str, *, required: bool = True, default: float | None = None) -> float | None:
    if key not in obj:
        if required:
            raise TraceError(path, line, f"missing field {key!r}")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(path, line, f"field {key!r} must be a number, got {_jtype(value)} ({_short(value)})")
    if isinstance(value, int) and abs(value) > MAX_TIMESTAMP:
        raise TraceError(path, line, f"field {key!r} is out of range: {_short(value)}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > MAX_TIMESTAMP:
        raise TraceError(path, line, f"field {key!r} must be a finite number below {MAX_TIMESTAMP:g}, got {_short(value)}")
    if value < 0:
        raise TraceError(path, line, f"field {key!r} must be >= 0, got {value} (negative)")
    return value


def get_token_ids(path: str | Path, line: int, obj: dict, key: str, *, vocab_size: int | None = None) -> array:
    value = obj[key]
    if not isinstance(value, list):
        raise TraceError(path, line, f"field {key!r} must be an array of integers, got {_jtype(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TraceError(path, line, f"field {key!r}[{i}] must be an integer, got {_jtype(t)} ({_short(t)})")
        if t < 0 or t >= 2**63:
            raise TraceError(path, line, f"field {key!r}[{i}] = {_short(t)} is not a valid token id (0 <= id < 2**63)")
        if vocab_size is not None and t >= vocab_size:
            raise TraceError(path, line, f"field {key!r}[{i}] = {t} is outside the vocabulary (size {vocab_size})")
    return array("q", value)


def _short(value: Any, limit: int = 40) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sort_by_arrival(requests: Sequence[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_s)  # stable: equal arrivals keep file order


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Request",
    "TraceError",
    "Tokenizer",
    "load_tokenizer",
]
