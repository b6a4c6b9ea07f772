"""Per-request records kept as columns: what a replay remembers of each finished request.

A million-request replay must not keep a million objects: `RecordColumns` holds the numbers of
`RequestRecord` (times and token counts, no prompt, no id) in typed arrays, 65 bytes a request, and
the report reads them as columns (sums in C). Indexing or iterating gives `RequestRecord`s, so code
that reads records one by one keeps working.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

PRECEDED_BY = ("none", "person", "tool")  # what came before a call in its session (`Request.preceded_by`)
ENDS_IN = (
    "tool",
    "person",
)  # what a call ended in: a tool call, or an answer that waits for a person (`Request.ends_in`)


@dataclass
class RequestRecord:
    """What a report keeps of each request: times in seconds (virtual for the embedded engine,
    wall clock for the HTTP replayer), the prompt tokens served from each tier, and what preceded
    the call in its session (`PRECEDED_BY`, None when the trace does not tell)."""

    request_id: str
    arrival_s: float
    ttft_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    hit_device: int = 0
    hit_host: int = 0
    hit_disk: int = 0
    preceded_by: str | None = None


_FLOATS = ("arrival_s", "ttft_s", "finish_s")
_INTS = ("prompt_tokens", "output_tokens", "hit_device", "hit_host", "hit_disk")


class RecordColumns:
    """Append-only columns of request records, in completion order.

    Contract: `append(record)` takes anything with `RequestRecord`'s attributes; `len`, `[i]` and
    iteration give `RequestRecord`s (ids are the position, as strings: ids are not kept); every
    column is an `array` (`arrival_s`, `ttft_s`, `finish_s` as 'd', the token counts as 'q',
    `preceded` as 'b': the index in `PRECEDED_BY`, -1 for None)."""

    def __init__(self) -> None:
        for name in _FLOATS:
            setattr(self, name, array("d"))
        for name in _INTS:
            setattr(self, name, array("q"))
        self.preceded = array("b")

    arrival_s: array
    ttft_s: array
    finish_s: array
    prompt_tokens: array
    output_tokens: array
    hit_device: array
    hit_host: array
    hit_disk: array
    preceded: array

    @classmethod
    def of(cls, records: Iterable[Any]) -> RecordColumns:
        """`records` as columns (returned as they are when they already are)."""
        if isinstance(records, RecordColumns):
            return records
        cols = cls()
        for r in records:
            cols.append(r)
        return cols

    def add(
        self,
        arrival_s: float,
        ttft_s: float,
        finish_s: float,
        prompt_tokens: int,
        output_tokens: int,
        hit_device: int,
        hit_host: int,
        hit_disk: int,
        preceded_by: str | None = None,
    ) -> None:
        self.arrival_s.append(arrival_s)
        self.ttft_s.append(ttft_s)
        self.finish_s.append(finish_s)
        self.prompt_tokens.append(prompt_tokens)
        self.output_tokens.append(output_tokens)
        self.hit_device.append(hit_device)
        self.hit_host.append(hit_host)
        self.hit_disk.append(hit_disk)
        self.preceded.append(-1 if preceded_by is None else PRECEDED_BY.index(preceded_by))

    def append(self, r: Any) -> None:
        self.add(
            r.arrival_s,
            r.ttft_s,
            r.finish_s,
            r.prompt_tokens,
            r.output_tokens,
            r.hit_device,
            r.hit_host,
            r.hit_disk,
            getattr(r, "preceded_by", None),
        )

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __getitem__(self, i: int) -> RequestRecord:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return RequestRecord(
            str(i),
            self.arrival_s[i],
            self.ttft_s[i],
            self.finish_s[i],
            self.prompt_tokens[i],
            self.output_tokens[i],
            self.hit_device[i],
            self.hit_host[i],
            self.hit_disk[i],
            None if self.preceded[i] < 0 else PRECEDED_BY[self.preceded[i]],
        )

    def __iter__(self) -> Iterator[RequestRecord]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).itemsize * len(self) for n in (*_FLOATS, *_INTS, "preceded"))


__all__ = ["PRECEDED_BY", "RecordColumns", "RequestRecord"]
