"""Rewriting the payload of a stopped server's disk page files so they stay valid pages (not a test
module): the header's dtype and shape name the payload's tensor, and the payload and header checksums
are recomputed (`docs/disk-format.md`), so a reader takes the changed bytes for a page of its own.
What the server tests use to show the forward reads the bytes a tier served."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import xxhash

from sgl_hicache.tiers.codec import HEADER_SIZE


def rewrite_payloads(files: Iterable[Path], change: Callable[[torch.Tensor], None]) -> int:
    """Apply `change` in place to each file's payload, viewed as (layers, planes, tokens, heads,
    head dim) bfloat16, and rewrite the checksums. Returns the number of files changed."""
    n = 0
    for f in files:
        raw = bytearray(Path(f).read_bytes())
        dtype = bytes(raw[52:68]).rstrip(b"\0").decode()
        (ndim,) = struct.unpack_from("<I", raw, 68)
        shape = struct.unpack_from(f"<{ndim}I", raw, 72)
        assert dtype == "bfloat16", (f, dtype)
        change(torch.frombuffer(raw, dtype=torch.bfloat16, offset=HEADER_SIZE).view(shape))
        struct.pack_into("<Q", raw, 104, xxhash.xxh3_64_intdigest(bytes(raw[HEADER_SIZE:])))
        struct.pack_into("<Q", raw, 112, xxhash.xxh3_64_intdigest(bytes(raw[:112])))
        Path(f).write_bytes(raw)
        n += 1
    return n


def page_shape(f: Path) -> tuple[int, ...]:
    """The page shape a page file's header names."""
    raw = Path(f).read_bytes()[:HEADER_SIZE]
    (ndim,) = struct.unpack_from("<I", raw, 68)
    return tuple(struct.unpack_from(f"<{ndim}I", raw, 72))
