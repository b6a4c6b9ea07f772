"""Streamed Mooncake traces: requests read lazily, token ids synthesised when a request is taken.

`MooncakeStream(path, ...)` is an iterable of `Request`s in arrival order that holds no prompt:
each iteration reads the file line by line and synthesises a request's token ids (exactly as
`read_mooncake` does, so a replay gives the same figures either way) only when the consumer takes
it; the consumer drops them when the request completes. Memory is the block cache (at most
`max_blocks` synthesised hash ids, least recently used dropped) plus what the consumer keeps.

Construction validates the whole file once (every line, with `read_mooncake`'s `FILE:LINE` errors)
and counts it, so a malformed line 900,000 fails before a replay starts and progress knows the
total. A stream needs what streaming cannot fix afterwards: lines in arrival order (non-decreasing
timestamps) and hash ids that each cover `block_size` tokens. Where a trace breaks either,
`open_mooncake` falls back to `read_mooncake` (everything in memory) and says so in a note.
Sessions are not inferred (the embedded engine does not use them; the session index grows with
the trace): `Request.session` is None.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .mooncake import _FixedSynth, check_options, parse_row, read_mooncake
from .trace import (
    ABSOLUTE_FROM,
    UNITS,
    ReadNotes,
    Request,
    TokenSynth,
    Trace,
    check_positive_int,
    read_lines,
    timestamps_to_seconds,
)

DEFAULT_MAX_BLOCKS = 16384  # synthesised hash ids kept (4 KiB each at 512 tokens): 64 MiB at most


class NotStreamable(ValueError):
    """The trace cannot be streamed as it is (lines out of arrival order, or varying block sizes)."""


class MooncakeStream:
    """A Mooncake JSONL trace as a lazily read iterable of requests (module docstring).

    `len()` is the number of requests it yields (after `limit`); `notes` are the read's notes.
    Iterating twice reads the file twice and yields the same requests. Picklable (a path and
    options), so a worker process can stream the trace itself."""

    def __init__(
        self,
        path: str | Path,
        *,
        block_size: int = 512,
        scale: int | None = None,
        limit: int | None = None,
        vocab_size: int = 32000,
        token_offset: int = 16,
        seed: int = 0,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        check_options(block_size, scale, limit, vocab_size, token_offset, seed)
        check_positive_int("max_blocks", max_blocks)
        self.path = Path(path)
        self.block_size, self.scale, self.limit = block_size, scale, limit
        self.vocab_size, self.token_offset, self.seed, self.max_blocks = vocab_size, token_offset, seed, max_blocks
        self.notes = ReadNotes()
        self._count, self._low = self._scan()

    def _scan(self) -> tuple[int, int | float]:
        """Validate every line (up to `limit`); return (count, smallest raw timestamp)."""
        count, prev, low = 0, None, None
        if self.limit == 0:
            return 0, 0
        for line, text in read_lines(self.path):
            ts, _, _, _, fits = parse_row(self.path, line, text, self.notes, self.block_size, "auto")
            if not fits:
                raise NotStreamable(f"{self.path}:{line}: hash ids cover a varying number of tokens")
            if prev is not None and ts < prev:
                raise NotStreamable(f"{self.path}:{line}: timestamp {ts} is before the previous line's ({prev})")
            prev = ts
            low = ts if low is None else min(low, ts)
            count += 1
            if self.limit is not None and count >= self.limit:
                break
        # the unit note (absolute timestamps), once, as read_mooncake gives it
        timestamps_to_seconds(self.path, [(1, low)], "ms", self.notes)  # type: ignore[list-item]
        return count, low  # type: ignore[return-value]

    def __len__(self) -> int:
        return self._count

    def _to_seconds(self):
        low = self._low
        if low < ABSOLUTE_FROM:
            return lambda raw: raw / 1e3  # relative, milliseconds (Mooncake's unit)
        per_s = next(f for _, bound, f in UNITS if low < bound)
        return lambda raw: (raw - low) / per_s

    def __iter__(self) -> Iterator[Request]:
        if not self._count:
            return
        blocks = _FixedSynth(
            TokenSynth(self.vocab_size, self.token_offset, self.seed),
            self.scale if self.scale is not None else self.block_size,
            self.max_blocks,
        )
        seconds = self._to_seconds()
        scratch = ReadNotes()  # the scan took the notes already
        for n, (line, text) in enumerate(read_lines(self.path), 1):
            ts, input_length, output_length, hash_ids, _ = parse_row(
                self.path, line, text, scratch, self.block_size, "auto"
            )
            length = input_length if self.scale is None else -(-input_length * self.scale // self.block_size)
            yield Request(f"L{line}", None, seconds(ts), blocks.tokens(hash_ids, length), output_length, line)
            if n >= self._count:
                return


def open_mooncake(path: str | Path, **opts) -> MooncakeStream | Trace:
    """A `MooncakeStream` when the trace can be streamed, else the whole trace read by
    `read_mooncake` (with a note saying why it is held in memory)."""
    max_blocks = opts.pop("max_blocks", DEFAULT_MAX_BLOCKS)
    try:
        return MooncakeStream(path, max_blocks=max_blocks, **opts)
    except NotStreamable as exc:
        trace = read_mooncake(path, infer_sessions=False, **opts)
        trace.notes.add("not-streamed", path, 1, f"the trace is read whole, not streamed: {exc}")
        return trace


__all__ = ["DEFAULT_MAX_BLOCKS", "MooncakeStream", "NotStreamable", "open_mooncake"]
