"""What every trace reader produces: `Request`, `TraceError`, and the shared helpers.

A reader turns a file into a list of `Request`s sorted by arrival (stable, so equal arrivals keep
file order). Anything malformed raises `TraceError`, whose message is ``FILE:LINE: what was wrong``;
a reader never raises anything else for bad content (the fuzz tests hold it to that).

Token ids are `array('q')` (int64), the form `hashing.tokens_bytes` hashes without a copy.

Tokenisation of text (ShareGPT and plain prompts) goes through `load_tokenizer`: a `tokenizers`
`tokenizer.json` from a local folder, or, with no folder, the built-in byte-level tokenizer
(`ByteTokenizer`: UTF-8 byte ``b`` becomes id ``b + 3``; ids 0, 1, 2 are left for pad/bos/eos).

Lenient reading. Where a reader accepts something the strict format would refuse (a duplicate id, a
timestamp written as a string, hash ids covering a varying number of tokens, a trace without prefix
information), it records a `Note` in the `ReadNotes` of the `Trace` it returns, once per kind of
choice with a count, so the command line can print each choice once and the report can carry it.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, overload

import xxhash

try:  # optional: vectorises token synthesis; the pure-Python path gives the same ids
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch in every supported environment
    _np = None  # type: ignore[assignment]  # (then the pure-Python path)


class TraceError(ValueError):
    """A trace file is malformed. `str()` is ``FILE:LINE: message``; `path`, `line`, `reason` are kept."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = int(line)
        self.reason = reason
        super().__init__(f"{self.path}:{self.line}: {reason}")


@dataclass
class Note:
    """One lenient choice a reader made: where it first applied, what it did, how often."""

    path: str
    line: int
    message: str
    count: int = 1

    def __str__(self) -> str:
        times = f" [{self.count} times]" if self.count > 1 else ""
        return f"{self.path}:{self.line}: {self.message}{times}"


class ReadNotes:
    """The notes of one read, one per kind of choice (`key`): a repeat only bumps the count."""

    def __init__(self) -> None:
        self._notes: dict[str, Note] = {}

    def add(self, key: str, path: str | Path, line: int, message: str) -> Note:
        note = self._notes.get(key)
        if note is None:
            note = self._notes[key] = Note(str(path), int(line), message)
        else:
            note.count += 1
        return note

    def __iter__(self) -> Iterator[Note]:
        return iter(self._notes.values())

    def __len__(self) -> int:
        return len(self._notes)

    def __contains__(self, key: object) -> bool:
        return key in self._notes

    def __getitem__(self, key: str) -> Note:
        return self._notes[key]

    def lines(self) -> list[str]:
        return [str(n) for n in self]


class Trace(list):
    """What a reader returns: a plain list of `Request`s (sorted by arrival) plus the read's `notes`."""

    def __init__(self, requests: Sequence[Request] = (), notes: ReadNotes | None = None) -> None:
        super().__init__(requests)
        self.notes = notes if notes is not None else ReadNotes()


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
    - `hints`: what the client said about the cache with it (`replay.hints.Hint`: prefetch, pin,
      retain, demote of a prefix), applied by the engine from the request's arrival on.
    - `preceded_by`: what came before this call in its session, when the trace tells
      (`records.PRECEDED_BY`: ``"none"`` a session's first call, ``"person"`` a person's message,
      ``"tool"`` a tool's result); None when it does not. Reports split TTFT by it.
    - `ends_in`: what the call's own output ended in, when the trace tells (`records.ENDS_IN`:
      ``"tool"`` a tool call, ``"person"`` an answer that waits for a person); None when it does not.
      A server sees it in its own output at the request's end (`policy/return_gaps.py`).
    """

    request_id: str
    session: str | None
    arrival_s: float
    input_ids: array = field(repr=False, hash=False)
    output_length: int
    line: int
    hints: tuple = ()  # `replay.hints.Hint`s the client sent with the request (plain JSONL's ``hints``)
    preceded_by: str | None = None
    ends_in: str | None = None

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


def encode_text(path: str | Path, line: int, tok: Tokenizer, text: str, what: str) -> array:
    """`text` as int64 token ids; a tokenizer failing on odd text is bad input, a TraceError naming `what`."""
    try:
        return array("q", tok.encode(text))
    except Exception as e:  # whatever the tokenizer raises must not escape as another exception
        raise TraceError(path, line, f"tokenizer failed on {what}: {e}") from e


MAX_TIMESTAMP = 1e12  # seconds (or ms, before conversion); beyond this a value is certainly corrupt


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Validate a reader *option* (not file content); raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for every non-blank line of a text file (lines end at ``\\n``);
    bad UTF-8 is a TraceError."""
    p = Path(path)
    try:
        f = p.open("rb")  # read line by line: a million-line trace is never held whole
    except IsADirectoryError as e:
        raise TraceError(p, 1, "is a directory, not a trace file") from e
    seen = False
    with f:
        for number, raw in enumerate(f, start=1):
            if raw.endswith(b"\n"):  # exactly what split(b"\n") gave: the text without its newline
                raw = raw[:-1]
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


def read_text(path: str | Path) -> str:
    """A whole file as text: a directory or bad UTF-8 is a TraceError (naming the line of the bad byte)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError as e:
        raise TraceError(p, 1, "is a directory, not a trace file") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(p, data.count(b"\n", 0, e.start) + 1, f"not valid UTF-8 ({e.reason})") from e


def get_hash_ids(path: str | Path, line: int, obj: dict) -> list[int]:
    """The ``hash_ids`` field: an array of non-negative integers (block ids)."""
    if "hash_ids" not in obj:
        raise TraceError(path, line, "missing field 'hash_ids'")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(path, line, f"field 'hash_ids' must be an array of integers, got {type(hash_ids).__name__}")
    for i, h in enumerate(hash_ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceError(path, line, f"field 'hash_ids'[{i}] must be a non-negative integer, got {_short(h)}")
    return hash_ids


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


# Every integer field of a trace is a token count or a turn number: beyond this it is certainly corrupt
# (and a replay would try to synthesise that many token ids)
MAX_COUNT = 100_000_000


@overload
def get_int(
    path: str | Path,
    line: int,
    obj: dict,
    key: str,
    *,
    minimum: int = 0,
    required: Literal[True] = True,
    default: int | None = None,
) -> int: ...
@overload
def get_int(
    path: str | Path,
    line: int,
    obj: dict,
    key: str,
    *,
    minimum: int = 0,
    required: bool = True,
    default: int | None = None,
) -> int | None: ...
def get_int(
    path: str | Path,
    line: int,
    obj: dict,
    key: str,
    *,
    minimum: int = 0,
    required: bool = True,
    default: int | None = None,
) -> int | None:
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
    if value > MAX_COUNT:
        raise TraceError(path, line, f"field {key!r} must be <= {MAX_COUNT:,} (a token count), got {_short(value)}")
    return value


@overload
def get_number(
    path: str | Path, line: int, obj: dict, key: str, *, required: Literal[True] = True, default: float | None = None
) -> float: ...
@overload
def get_number(path: str | Path, line: int, obj: dict, key: str, *, required: bool = True, default: float) -> float: ...
@overload
def get_number(
    path: str | Path, line: int, obj: dict, key: str, *, required: bool = True, default: None = None
) -> float | None: ...
def get_number(
    path: str | Path, line: int, obj: dict, key: str, *, required: bool = True, default: float | None = None
) -> float | None:
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
        raise TraceError(
            path, line, f"field {key!r} must be a finite number below {MAX_TIMESTAMP:g}, got {_short(value)}"
        )
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


def sort_by_arrival(requests: Sequence[Request], notes: ReadNotes | None = None) -> Trace:
    return Trace(sorted(requests, key=lambda r: r.arrival_s), notes)  # stable: equal arrivals keep file order


def unique_id(seen: set[str], rid: str) -> str:
    """`rid`, or when `seen` holds it already the first free ``rid#2``, ``rid#3``, ...; added to `seen`."""
    new, k = rid, 2
    while new in seen:
        new, k = f"{rid}#{k}", k + 1
    seen.add(new)
    return new


# ---- timestamps ------------------------------------------------------------------------------

MAX_RAW_TIMESTAMP = 1e19  # nanoseconds since 1970 stay below this until the year 2286
_DIGITS = re.compile(r"\d{1,25}", re.ASCII)
_DECIMAL = re.compile(r"\d{1,25}\.\d{0,25}|\.\d{1,25}|\d{1,25}(\.\d{0,25})?[eE][+-]?\d{1,3}", re.ASCII)
ABSOLUTE_FROM = 1e9  # a first timestamp this large is a time since the epoch (2001-09-09 in seconds)
UNITS = (("s", 1e11, 1.0), ("ms", 1e14, 1e3), ("us", 1e17, 1e6), ("ns", math.inf, 1e9))


def get_timestamp(path: str | Path, line: int, obj: dict, key: str, notes: ReadNotes | None = None) -> int | float:
    """A timestamp field as written: a JSON number or (noted once) a string of digits; >= 0, finite,
    below 1e19. The unit is decided for the whole file by `timestamps_to_seconds`."""
    if key not in obj:
        raise TraceError(path, line, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, str):
        text = value.strip()
        if _DIGITS.fullmatch(text):
            value = int(text)
        elif _DECIMAL.fullmatch(text):
            value = float(text)
        else:
            raise TraceError(path, line, f"field {key!r} must be a number or a string of digits, got {_short(value)}")
        if notes is not None:
            notes.add(
                "timestamp-string",
                path,
                line,
                f"field {key!r} is a string of digits ({_short(obj[key])}); read as a number",
            )
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(path, line, f"field {key!r} must be a number, got {_jtype(value)} ({_short(value)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise TraceError(path, line, f"field {key!r} must be a finite number, got {_short(value)}")
    if value < 0:
        raise TraceError(path, line, f"field {key!r} must be >= 0, got {_short(value)} (negative)")
    if value >= MAX_RAW_TIMESTAMP:
        raise TraceError(path, line, f"field {key!r} is out of range: {_short(value)} (at most 1e19)")
    return value


def timestamps_to_seconds(
    path: str | Path, rows: Sequence[tuple[int, int | float]], relative_unit: str, notes: ReadNotes
) -> list[float]:
    """Arrival seconds for ``(line, raw timestamp)`` rows, the unit chosen once for the file by magnitude.

    If the smallest timestamp is below 1e9 the trace is relative (starts near 0) and in the format's
    own `relative_unit` (``"ms"`` for Mooncake): ``arrival = raw / unit``, as before. Otherwise the
    timestamps are absolute times since the epoch and the smallest one's magnitude gives the unit:
    below 1e11 seconds, below 1e14 milliseconds, below 1e17 microseconds, else nanoseconds (today that
    is ~1.7e9, 1.7e12, 1.7e15, 1.7e18); ``arrival = (raw - smallest) / unit``, noted once.
    """
    if not rows:
        return []
    first_line, low = min(rows, key=lambda r: r[1])
    if low < ABSOLUTE_FROM:
        per_s = {u: f for u, _, f in UNITS}[relative_unit]
        return [raw / per_s for _, raw in rows]
    unit, per_s = next((u, f) for u, bound, f in UNITS if low < bound)
    notes.add(
        "timestamp-unit",
        path,
        first_line,
        f"timestamps are absolute, read as {unit} since the epoch by their magnitude ({_short(low)}); "
        f"arrivals count from the earliest one",
    )
    return [(raw - low) / per_s for _, raw in rows]  # int - int is exact, even for nanoseconds


# ---- synthetic tokens ------------------------------------------------------------------------


# splitmix64 (Steele, Lea, Flood 2014): a counter-based generator, so every id is a pure function of
# (key, position) and a whole request's blocks are drawn in one vectorised pass
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


class TokenSynth:
    """Deterministic pseudo-random token ids for formats that give lengths, not text.

    Definition: with ``h = xxh3_64(f"{seed}:{key}")``, id ``j`` (from 0) of ``tokens(key, n)`` is
    ``(splitmix64((h + (j + 1) * 0x9E3779B97F4A7C15) mod 2**64) >> 32) % (vocab_size - token_offset)
    + token_offset``: the same on every run, machine and Python, and a shorter draw for the same key
    is a prefix of a longer one. Drawn in numpy when present (`tokens_many`: all of a request's new
    blocks in one pass); `_reference` is the definition in plain Python.

    (Before 2026-12 the ids were ``random.Random(f"{seed}:{key}")``'s 32-bit words: SHA-512 seeding and
    a Mersenne Twister per block were a tenth of a long replay. Hits and times do not depend on which
    ids a block gets, only on which blocks are equal; a disk tier written by a replay of the older
    version does not match the new ids.)
    """

    def __init__(self, vocab_size: int, token_offset: int, seed: int) -> None:
        self.span = vocab_size - token_offset
        self.offset = token_offset
        self.seed = seed

    def _key_hash(self, key: object) -> int:
        return xxhash.xxh3_64_intdigest(f"{self.seed}:{key}".encode())

    def _reference(self, key: object, n: int) -> array:
        h, span, off = self._key_hash(key), self.span, self.offset
        return array("q", [(_splitmix64((h + (j + 1) * _GOLDEN) & _MASK64) >> 32) % span + off for j in range(n)])

    def _ids(self, keys: Sequence[object], n: int) -> _np.ndarray:
        """The ids of every key, one row a key (int64, numpy)."""
        u64 = _np.uint64
        h = _np.fromiter((self._key_hash(k) for k in keys), dtype=u64, count=len(keys))
        with _np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64, as the definition says
            z = h[:, None] + _np.arange(1, n + 1, dtype=u64)[None, :] * u64(_GOLDEN)
            z ^= z >> u64(30)
            z *= u64(_MIX1)
            z ^= z >> u64(27)
            z *= u64(_MIX2)
            z ^= z >> u64(31)
        ids = (z >> u64(32)).astype(_np.int64)
        ids %= self.span
        ids += self.offset
        return ids

    def tokens_many(self, keys: Sequence[object], n: int) -> list[array]:
        """``[tokens(key, n) for key in keys]``, drawn in one vectorised pass when numpy is present
        (a streamed replay synthesises a dozen new blocks a request)."""
        if n <= 0 or not keys:
            return [array("q") for _ in keys]
        if _np is None:
            return [self._reference(k, n) for k in keys]
        buf = memoryview(self._ids(keys, n).tobytes())
        out = []
        for i in range(len(keys)):
            a = array("q")
            a.frombytes(buf[8 * n * i : 8 * n * (i + 1)])
            out.append(a)
        return out

    def tokens(self, key: object, n: int) -> array:
        return self.tokens_many([key], n)[0]


def check_synth_options(vocab_size: int, token_offset: int, seed: int) -> None:
    check_positive_int("token_offset", token_offset, minimum=0)
    check_positive_int("vocab_size", vocab_size, minimum=token_offset + 2)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Note",
    "ReadNotes",
    "Request",
    "Trace",
    "TraceError",
    "Tokenizer",
    "load_tokenizer",
]
