"""`DiskPageStore`, the disk tier's public API: content-addressed page files under one directory
that survive a restart and never serve wrong KV (allocate, free, write, read, contains, accounting).

The file protocol is in `files.py`, the start-up scan and the pages other processes wrote in
`recovery.py`, the state shared with them in `ledger.py`. Format, rules and errors:
`docs/disk-format.md`.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import torch
import xxhash

from ...config import KVLayout
from ...hashing import KEY_BYTES, Namespace, PageKey
from ..base import DISK, Handle, KeyedStore, PageCorruptError, PageGoneError, ReadsInto, TierIOError, WritesFrom
from ..codec import DTYPE_MISMATCH, HEADER_SIZE, PageCodec, check_key, is_other_version, tensor_bytes
from .files import READ_FLAGS, RESERVED, STORED, log
from .ledger import DirectoryLedger, LocalLedger
from .manifest import check_manifest, record_manifest
from .recovery import DirectoryScan

COUNTER_NAMES = (
    "pages_written",
    "pages_read",
    "bytes_written",
    "bytes_read",
    "corrupt_removed",
    "dtype_mismatch",  # of corrupt_removed: a page whose header named another KV dtype (never served)
    "foreign_ignored",
    "version_skipped",  # a page file of another format version: left in place, never served
    "partial_removed",
    "write_errors",
    "pages_restored",
    "stray_ignored",
    "unlink_errors",
    "pages_gone",
    "pages_discovered",
    "peer_temp_kept",
    "peer_pages_evicted",
    "borrowed_pages",  # pages another shard's directories hold, readable here (`head_shards.py`)
    "borrowed_reads",  # of pages_read: borrowed pages, assembled from other shards' files
)


class DiskPageStore(DirectoryScan, KeyedStore, ReadsInto, WritesFrom):
    """Content-addressed page files under one directory; handles are the 16-byte page keys.

    Contract (in full, with the file format: `docs/disk-format.md`):
    - `allocate(keys)` reserves room for every key or none (None when the directory, shared with
      every process that opened it, is full, or while writes are disabled); `write` / `write_from`
      store allocated pages; `free` forgets and deletes them; `read` / `read_into` return the bytes
      written, verified, or raise (PageCorruptError: the file was bad and is gone; PageGoneError:
      another process deleted it; both drop the key, which the caller must not free).
    - `contains(key)` answers from the index, with no I/O; `discover(key)` also looks for a page
      another process wrote.
    - A page file is either absent or complete; a restart indexes every valid page file of this
      namespace and deletes the bad ones.
    - A directory whose format manifest names a version this build does not read is refused
      (DiskFormatError, naming both versions) before anything in it is read or deleted; a page file
      of another format version is never served, never deleted (`version_skipped`).
    - Reads and writes of distinct keys may run concurrently from many threads. The constructor
      starts no thread. Call `close()` when done.
    """

    name = DISK
    persistent = True

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        capacity_pages: int,
        directory: str | os.PathLike[str],
        namespace: Namespace,
        fsync: bool = False,
        *,
        retry_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(layout, page_size, capacity_pages)
        if not isinstance(namespace, Namespace) or len(namespace.root) != KEY_BYTES:
            raise ValueError(f"disk: namespace must be a hashing.Namespace, got {namespace!r}")
        if retry_interval_s < 0:
            raise ValueError(f"disk: retry_interval_s must be >= 0, got {retry_interval_s}")
        self.directory = Path(directory)
        self._dir_str = os.fspath(self.directory)
        self.namespace = namespace
        self.fsync = bool(fsync)
        self.retry_interval_s = float(retry_interval_s)
        self._clock = clock
        self.dtype = layout.torch_dtype
        self._codec = PageCodec(namespace, self.page_shape, layout.dtype, self.page_bytes, "disk")
        self._payload_bytes = self.page_bytes
        self._page_ctype = ctypes.c_ubyte * self._payload_bytes  # a page's bytes in place (see _write_pages)

        self._lock = threading.Lock()
        self._index: dict[PageKey, int] = {}
        self._n_reserved = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._logged_reasons: set[str] = set()
        self._tmp_seq = itertools.count()
        self._made_dirs: set[str] = set()
        self._write_disabled = False
        self._next_probe_at = 0.0
        self._disabled_reason = ""
        self._own_writes = 0
        self._peers_wrote = False
        # a page file whose unlink failed outlives its index entry and is still counted by the
        # ledger: from then on a rename must look before replacing a file
        self._kept_files = False
        self._evict_cursor = 0
        self._unledgered: set[PageKey] = set()  # reserved while the ledger could not be written

        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise TierIOError(f"disk: cannot create the disk tier directory {str(self.directory)!r}: {exc}") from exc
        if not self.directory.is_dir():
            raise TierIOError(f"disk: {str(self.directory)!r} is not a directory")
        check_manifest(self.directory)  # before anything reads, indexes or deletes a page
        self._ledger: DirectoryLedger | LocalLedger
        try:
            self._ledger = DirectoryLedger(self.directory, namespace.root)
        except OSError as exc:  # e.g. read-only now: serve what is there, unshared (writes fail and disable)
            log.warning(
                "disk tier: cannot set up sharing of %s (%s); this process accounts for it alone", self.directory, exc
            )
            self._ledger = LocalLedger()
        self.owner = self._ledger.owner
        try:
            record_manifest(self.directory, self.directory / f".probe.{self.owner}.{next(self._tmp_seq)}.tmp")
        except ValueError:
            self._ledger.close()
            raise
        with self._ledger.locked():
            alone = not self._ledger.others_alive()
            if alone:  # nobody writes meanwhile: the scan's count is exact, so it resets the ledger
                self._ledger.recount(self._scan())
        if not alone:
            self._scan()
        self._warn_overfull()

    def close(self) -> None:
        """Leave the directory: give up this process's ledger slot (and reservations) and owner lock.
        Stored pages stay. The store must not be used afterwards."""
        self._ledger.close()

    # ------------------------------------------------------------------ accounting
    @property
    def stored_pages(self) -> int:
        """Pages written and readable (as far as the index knows)."""
        return len(self._index) - self._n_reserved

    @property
    def free_pages(self) -> int:
        """Capacity left for the whole directory (every process's pages and reservations count)."""
        return max(0, self.capacity_pages - self._ledger.used)

    @property
    def overfull_pages(self) -> int:
        """Pages in the directory beyond this store's capacity (found on restart, or written by a
        process given a larger capacity): the cache must free this many before allocating."""
        return max(0, self._ledger.used - self.capacity_pages)

    @property
    def peers_wrote(self) -> bool:
        """Another process has written a page into this namespace since this store opened (then, and
        only then, `discover` looks at files the index does not know)."""
        if not self._peers_wrote:
            self._peers_wrote = self._ledger.writes - self._ledger.writes_at_open > self._own_writes
        return self._peers_wrote

    @property
    def write_disabled(self) -> bool:
        return self._write_disabled

    def contains(self, key: PageKey) -> bool:
        """True when the page is stored (written and indexed). No I/O."""
        return self._index.get(key) == STORED

    def keys(self) -> Iterator[PageKey]:
        """The stored pages' keys (a snapshot)."""
        with self._lock:
            snapshot = [k for k, state in self._index.items() if state == STORED]
        return iter(snapshot)

    # ------------------------------------------------------------------ protocol
    def allocate(self, keys: Sequence[PageKey]) -> list[Handle] | None:
        keys = [check_key(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("disk: allocate got the same key twice")
        if self._write_disabled and not self.try_enable_writes():
            return None
        with self._ledger.locked(), self._lock:
            for k in keys:
                if k in self._index:
                    raise ValueError(f"disk: page {k.hex()} is already allocated or stored (check contains() first)")
            try:
                if not self._ledger.reserve(len(keys), self.capacity_pages):
                    return None
            except OSError:
                # the ledger cannot be written (the medium just failed): reserve here only, and let
                # the page write meet the failure, which disables writes the usual way
                self._unledgered.update(keys)
            for k in keys:
                self._index[k] = RESERVED
            self._n_reserved += len(keys)
        return list(keys)

    def free(self, handles: Sequence[Handle]) -> None:
        keys = [check_key(k) for k in handles]
        with self._ledger.locked():
            with self._lock:
                for k in keys:
                    if k not in self._index:
                        raise KeyError(f"disk: page {k.hex()} is not allocated")
                if len(set(keys)) != len(keys):
                    raise KeyError("disk: free got the same key twice")
                states = [self._index.pop(k) for k in keys]
                self._n_reserved -= sum(1 for s in states if s == RESERVED)
                ledgered = sum(1 for k, s in zip(keys, states) if s == RESERVED and not self._unledger(k))
            if ledgered:
                self._ledger.unreserve(ledgered)
            removed = 0
            for k, state in zip(keys, states):
                # a reserved page has no file of ours (a write racing this free drops its own temp
                # file); whatever sits at its path is not ours to delete. A stored page's file may
                # already be gone (another process evicted it): then it is not counted twice.
                if state == STORED and self._unlink(self._page_str(k.hex())):
                    removed += 1
            if removed:  # one update for the batch, still inside the critical section
                self._ledger.file_removed(removed)

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        keys = [check_key(k) for k in handles]
        self._check_data(keys, data)
        if data.dtype != self.dtype:
            raise ValueError(f"disk: write of dtype {data.dtype}, expected {self.dtype}")
        if data.device.type != "cpu":
            data = data.to("cpu")
        self._write_pages(keys, data.contiguous().unbind(0))

    def write_from(self, handles: Sequence[Handle], pages: Sequence[torch.Tensor]) -> None:
        """`write`, from one caller's tensor per page (CPU, `page_shape`, layout dtype; a host
        tier's page views), with no gathered intermediate copy. Same errors as `write`."""
        keys = [check_key(k) for k in handles]
        if len(pages) != len(keys):
            raise ValueError(f"disk: write_from got {len(pages)} pages for {len(keys)} keys")
        shape, dtype = self.page_shape, self.dtype
        for p in pages:
            if p.dtype != dtype or p.shape != shape or p.device.type != "cpu":
                raise ValueError(
                    f"disk: write_from a page of {tuple(p.shape)} / {p.dtype} on {p.device}, "
                    f"expected {shape} / {dtype} on cpu"
                )
        self._write_pages(keys, [p if p.is_contiguous() else p.contiguous() for p in pages])

    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        keys = [check_key(k) for k in handles]
        out = torch.empty((len(keys), *self.page_shape), dtype=self.dtype)
        for i, k in enumerate(keys):
            self.read_into(k, out[i])
        return out

    def read_into(self, key: PageKey, out: torch.Tensor) -> None:
        """Read one page straight into `out` (contiguous CPU, `page_shape`, layout dtype), no copy.

        On PageCorruptError the contents of `out` are undefined and must not be used.
        """
        key = check_key(key)
        if tuple(out.shape) != self.page_shape or out.dtype != self.dtype:
            raise ValueError(
                f"disk: read_into a tensor of shape {tuple(out.shape)} / {out.dtype}, "
                f"expected {self.page_shape} / {self.dtype}"
            )
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("disk: read_into needs a contiguous CPU tensor")
        if self._index.get(key) != STORED:
            raise KeyError(f"disk: page {key.hex()} is not stored")
        path = self._page_str(key.hex())
        try:
            fd = os.open(path, READ_FLAGS)
        except FileNotFoundError:
            self._gone(key)
        except OSError as exc:
            raise TierIOError(f"disk: cannot open page {key.hex()}: {exc}") from exc
        try:
            try:
                st = os.fstat(fd)
                header = os.pread(fd, HEADER_SIZE, 0) if stat.S_ISREG(st.st_mode) else b""
            except OSError as exc:
                raise TierIOError(f"disk: cannot read page {key.hex()}: {exc}") from exc
            if not stat.S_ISREG(st.st_mode):  # a directory or FIFO took the file's place: not ours
                self._corrupt(key, path, "not a file", "the page path is not a regular file", delete=False)
            size = st.st_size
            fields, reason = self._parse_header(header, size, key)
            if fields is None:
                self._corrupt(key, path, reason, f"bad header: {reason}")
            view = tensor_bytes(out)
            try:
                got = self._pread_into(fd, view, HEADER_SIZE)
            except OSError as exc:
                raise TierIOError(f"disk: cannot read page {key.hex()}: {exc}") from exc
            if got != self._payload_bytes:
                self._corrupt(key, path, "truncated", f"payload is {got} bytes, expected {self._payload_bytes}")
            if xxhash.xxh3_64_intdigest(view) != fields["checksum"]:
                self._corrupt(key, path, "checksum", "payload checksum mismatch")
        finally:
            os.close(fd)
        with self._lock:
            self.counters["pages_read"] += 1
            self.counters["bytes_read"] += self._payload_bytes

    def try_enable_writes(self) -> bool:
        """Re-enable writes if the retry interval has passed and a probe write succeeds."""
        if not self._write_disabled:
            return True
        now = self._clock()
        if now < self._next_probe_at:
            return False
        probe = self.directory / f".probe.{self.owner}.{next(self._tmp_seq)}.tmp"
        try:
            self._write_file(probe, [b"probe"])
        except OSError as exc:
            self._unlink(probe, quiet=True)
            self._next_probe_at = now + self.retry_interval_s
            log.debug("disk tier: probe write into %s still fails: %s", self.directory, exc)
            return False
        self._unlink(probe, quiet=True)
        self._write_disabled = False
        self._disabled_reason = ""
        log.warning("disk tier: writes into %s work again; re-enabled", self.directory)
        return True

    # ------------------------------------------------------------------ a page that cannot be served
    def _corrupt(self, key: PageKey, path: str | Path, reason: str, detail: str, delete: bool = True) -> NoReturn:
        """Discard a page that failed verification and raise PageCorruptError. A page of another
        format version is dropped from the index only: its file is not ours to delete."""
        other_version = is_other_version(reason)
        if delete and not other_version:
            with self._ledger.locked():
                if self._unlink(path, quiet=True):
                    self._ledger.file_removed()  # it was indexed, so it was counted
        with self._lock:
            state = self._index.pop(key, None)
            if state == RESERVED:
                self._n_reserved -= 1
            self.counters["version_skipped" if other_version else "corrupt_removed"] += 1
            if other_version or not delete:  # an indexed (counted) file outlives its index entry
                self._kept_files = True
            if reason == DTYPE_MISMATCH:
                self.counters["dtype_mismatch"] += 1
            first = reason not in self._logged_reasons
            self._logged_reasons.add(reason)
        (log.warning if first else log.debug)("disk tier: page %s discarded (%s): %s", key.hex(), reason, detail)
        err = PageCorruptError(f"disk: page {key.hex()} is corrupt ({reason}): {detail}")
        err.key_hex = key.hex()  # type: ignore[attr-defined]
        err.reason = reason  # type: ignore[attr-defined]
        raise err

    def _gone(self, key: PageKey) -> None:
        """A stored page's file was deleted (another process evicted it): forget it, raise PageGoneError."""
        with self._lock:
            state = self._index.pop(key, None)
            if state == RESERVED:
                self._n_reserved -= 1
            self.counters["pages_gone"] += 1
        log.debug("disk tier: page %s was deleted by another process", key.hex())
        err = PageGoneError(f"disk: page {key.hex()} is gone (deleted by another process)")
        err.key_hex = key.hex()  # type: ignore[attr-defined]
        err.reason = "gone"  # type: ignore[attr-defined]
        raise err


__all__ = ["COUNTER_NAMES", "DiskPageStore"]
