"""A disk tier any TP size can read: each shard of the KV heads in its own directory, and the pages
of the other shards found there assembled into the heads this cache holds.

Layout under one base directory (`docs/disk-format.md`, "Head shards"): the whole model's pages (a TP
1 server's) in the base directory itself, a shard's `[lo, hi)` in `<base>/heads<lo>-<hi>`. Page keys
are named by the whole model (`CacheConfig.key_layout`), so a page has one key at every TP size, and
each page file's header names its shape, heads included: a file is never read as another shard's.

A cache of one shard writes only its own directory; at start it also opens every other shard's
directory under the base (and the base, when it holds the whole model's pages) read-only, and indexes
the pages whose heads those directories cover together as *borrowed*: readable like its own, assembled
head by head on the transfer engine's threads, never deleted and never counted against its capacity
(freeing one forgets it). A borrowed page is as good as the files it is read from: a corrupt or vanished
piece fails the read like a page of its own.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ...config import HeadShard, KVLayout
from ...hashing import Namespace, PageKey
from ..base import Handle, PageCorruptError, PageGoneError, TierIOError
from ..codec import check_key
from .files import FANOUT_NAME, log
from .manifest import DiskFormatError
from .page_store import DiskPageStore

SHARD_DIR = re.compile(r"^heads([0-9]+)-([0-9]+)$")
LEGACY_RANK_DIR = re.compile(r"^tp[0-9]+-rank[0-9]+$")  # pages of a build that keyed them by TP size
_SOURCE_CAPACITY = 1 << 62  # a source is only read: its capacity is its owners' business


def shard_dir(base: Path, shard: HeadShard) -> Path:
    """Where `shard`'s pages live under `base`: the base itself for the whole model."""
    return Path(base) if shard.whole else Path(base) / f"heads{shard.lo}-{shard.hi}"


def shards_under(base: Path, total: int) -> list[HeadShard]:
    """The shards with a directory under `base` (the whole model when `base` holds page files)."""
    found: list[HeadShard] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return found
    if any(FANOUT_NAME.match(e.name) and e.is_dir(follow_symlinks=False) for e in entries):
        found.append(HeadShard(0, total, total))
    for e in entries:
        m = SHARD_DIR.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            lo, hi = int(m.group(1)), int(m.group(2))
            if 0 <= lo < hi <= total and (lo, hi) != (0, total):
                found.append(HeadShard(lo, hi, total))
    return sorted(found, key=lambda s: (s.lo, -s.hi))


def cover(want: HeadShard, have: Sequence[HeadShard]) -> list[HeadShard] | None:
    """The fewest of `have` whose heads together hold every head of `want` (greedy by reach), or None."""
    pieces: list[HeadShard] = []
    at = want.lo
    while at < want.hi:
        reach = max((s for s in have if s.lo <= at < s.hi), key=lambda s: s.hi, default=None)
        if reach is None:
            return None
        pieces.append(reach)
        at = reach.hi
    return pieces


class HeadShardDiskStore(DiskPageStore):
    """`DiskPageStore` of one head shard, which also serves the pages other shards' directories
    under the same base hold together (see the module docstring).

    Contract, beyond `DiskPageStore`'s:
    - `contains`, `keys`, `discover`, `read` / `read_into` and `stored_pages` count borrowed pages as
      stored; `own_keys` and `free_pages` / `overfull_pages` are this directory's alone.
    - `free` of a borrowed page forgets it (its files stay); a borrowed page's failed read raises
      PageCorruptError or PageGoneError and forgets it, as for a page of its own.
    - Directories of other shards are found at start; `discover` also finds pages written there since.
    """

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        capacity_pages: int,
        base_dir: str | os.PathLike[str],
        shard: HeadShard,
        namespace: Namespace,
        fsync: bool = False,
        **kwargs,
    ) -> None:
        if shard.heads != layout.num_kv_heads:
            raise ValueError(f"disk: shard {shard} holds {shard.heads} KV heads, the layout {layout.num_kv_heads}")
        base = Path(base_dir)
        super().__init__(layout, page_size, capacity_pages, shard_dir(base, shard), namespace, fsync, **kwargs)
        self.shard = shard
        self._sources: dict[HeadShard, DiskPageStore] = {}
        self._borrowed: dict[PageKey, tuple[HeadShard, ...]] = {}
        for other in shards_under(base, shard.total):
            if other != shard and other.hi > shard.lo and other.lo < shard.hi:
                self._open_source(base, other, layout, page_size, namespace)
        self._index_borrowed(self._source_keys())
        self._warn_legacy(base)

    def _open_source(self, base: Path, other: HeadShard, layout: KVLayout, page_size: int, ns: Namespace) -> None:
        where = shard_dir(base, other)
        try:
            self._sources[other] = DiskPageStore(
                dataclasses.replace(layout, num_kv_heads=other.heads), page_size, _SOURCE_CAPACITY, where, ns
            )
        except (DiskFormatError, TierIOError, OSError) as exc:
            log.warning("disk tier: the pages of KV heads %d-%d in %s are not read: %s", other.lo, other.hi, where, exc)

    def _source_keys(self) -> dict[PageKey, list[HeadShard]]:
        holders: dict[PageKey, list[HeadShard]] = {}
        for other, src in self._sources.items():
            for key in src.keys():
                holders.setdefault(key, []).append(other)
        return holders

    def _index_borrowed(self, holders: dict[PageKey, list[HeadShard]]) -> None:
        found = 0
        for key, have in holders.items():
            pieces = cover(self.shard, have)
            if pieces is not None:
                with self._lock:
                    if key not in self._borrowed:
                        self._borrowed[key] = tuple(pieces)
                        found += 1
        if found:
            self.counters["borrowed_pages"] += found
            log.info(
                "disk tier: %d pages of other TP sizes readable for KV heads %d-%d of %d",
                found,
                self.shard.lo,
                self.shard.hi,
                self.shard.total,
            )

    @staticmethod
    def _warn_legacy(base: Path) -> None:
        try:
            legacy = sorted(e.name for e in os.scandir(base) if LEGACY_RANK_DIR.match(e.name))
        except OSError:
            return
        if legacy:
            log.warning(
                "disk tier: %s holds %s, pages of a build that keyed them by TP size; they are not read "
                "(delete them to reclaim the space)",
                base,
                ", ".join(legacy),
            )

    def close(self) -> None:
        for src in self._sources.values():
            src.close()
        super().close()

    # ------------------------------------------------------------------ what is readable
    @property
    def stored_pages(self) -> int:
        return super().stored_pages + len(self._borrowed)

    def contains(self, key: PageKey) -> bool:
        return super().contains(key) or key in self._borrowed

    def keys(self) -> Iterator[PageKey]:
        own = list(super().keys())
        with self._lock:
            own += list(self._borrowed)
        return iter(own)

    def own_keys(self) -> Iterator[PageKey]:
        return super().keys()

    def discover(self, key: PageKey) -> bool:
        # borrowed first: a peer's own-directory copy is not indexed beside it (own and borrowed disjoint)
        if key in self._borrowed or super().discover(key):
            return True
        have = [other for other, src in self._sources.items() if src.discover(key)]
        if cover(self.shard, have) is None:
            return False
        self._index_borrowed({key: have})
        return True

    def allocate(self, keys: Sequence[PageKey]) -> list[Handle] | None:
        got = super().allocate(keys)
        if got is not None:  # its own copy replaces a borrowed one: own and borrowed stay disjoint
            with self._lock:
                for k in got:
                    self._borrowed.pop(k, None)
        return got

    def free(self, handles: Sequence[Handle]) -> None:
        keys = [check_key(k) for k in handles]
        with self._lock:  # a borrowed page is forgotten: its files belong to the other shards
            borrowed = {k for k in keys if self._borrowed.pop(k, None) is not None}
        own = [k for k in keys if k not in borrowed]
        if own:
            super().free(own)

    def read_into(self, key: PageKey, out: torch.Tensor) -> None:
        key = check_key(key)
        pieces = self._borrowed.get(key)
        if pieces is None:
            super().read_into(key, out)
            return
        if tuple(out.shape) != self.page_shape or out.dtype != self.dtype:
            raise ValueError(
                f"disk: read_into a tensor of shape {tuple(out.shape)} / {out.dtype}, "
                f"expected {self.page_shape} / {self.dtype}"
            )
        lo = self.shard.lo
        for piece in pieces:
            shape = (*self.page_shape[:3], piece.heads, self.page_shape[4])
            part = torch.empty(shape, dtype=self.dtype)
            try:
                self._sources[piece].read_into(key, part)
            except (PageCorruptError, PageGoneError) as exc:
                self._forget_borrowed(key)
                raise type(exc)(f"disk: page {key.hex()} of KV heads {piece.lo}-{piece.hi}: {exc}") from exc
            except KeyError:  # the source forgot it (a reader there found it gone)
                self._forget_borrowed(key)
                raise PageGoneError(f"disk: page {key.hex()} of KV heads {piece.lo}-{piece.hi} is gone") from None
            a, b = max(piece.lo, lo), min(piece.hi, self.shard.hi)
            out[:, :, :, a - lo : b - lo].copy_(part[:, :, :, a - piece.lo : b - piece.lo])
        with self._lock:
            self.counters["borrowed_reads"] += 1
            self.counters["pages_read"] += 1
            self.counters["bytes_read"] += self.page_bytes

    def _forget_borrowed(self, key: PageKey) -> None:
        with self._lock:
            self._borrowed.pop(key, None)


__all__ = ["HeadShardDiskStore", "cover", "shard_dir", "shards_under"]
