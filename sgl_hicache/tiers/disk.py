"""The disk tier: content-addressed page files that survive a restart and never serve wrong KV.

One file per page, named by the page key: `<dir>/<k0k1>/<32 hex of key>.page`. Because a page's
name is its chained key (see `hashing.py`), splitting a tree node costs nothing on disk, and a
process that restarts can find a prefix's pages again by recomputing the keys of the prompt.

File format (version 1, little endian, 128-byte header then payload)::

    offset size  field
      0     8    magic b"SGLHPAGE"           \
      8     2    format version (u16)         | stable across versions: a reader of any version
     10     2    header size (u16)            | can tell "another namespace" from "corrupt"
     12    16    namespace root               /
     28    16    page key
     44     8    payload length (u64)
     52    16    dtype name (ASCII, NUL padded)
     68     4    ndim (u32)
     72    32    shape (8 x u32, unused dims 0)
    104     8    xxh3_64 of the payload
    112     8    xxh3_64 of header bytes 0..111
    120     8    zero padding
    128     -    payload: the page tensor's raw bytes, shape `page_shape(layout, page_size)`

Crash safety: a page is written to a temp name (`.<hex>.<owner>.<n>.tmp`, owner = `<pid>-<16 hex>`)
in its final directory and then `os.replace`d, so a page file is either absent or complete. With
`fsync=True` the file and its directory are fsynced too (survives power loss, not only a process
crash). A write batch's temp files are written first, then renamed into place together in one
critical section of the shared ledger (one lock, one update of each count). Temp files whose owner
is dead are deleted when the next store opens the directory; a live owner's are left alone (temp
names without an owner, written before directories were shared, are treated as dead).

Sharing (see `shared.py`): any number of processes may open one directory at once. Per namespace
they share one capacity (`capacity_pages` is checked against the pages of every process, through
the namespace's ledger); every rename into and unlink of a page path happens under the ledger's
lock. A page written by another process is found while both run: `discover(key)` opens its file
once another process has written into the namespace since this store opened (a lone process never
pays for the check). Any process may delete any page of the namespace (eviction; `evict_unindexed`
deletes the oldest pages this store never indexed, for a process locked out of a full directory);
a page deleted under a reader is `PageGoneError`, a miss -- never corruption, never wrong bytes (an
open file keeps its bytes; a rename swaps in a complete file). Call `close()` when done (garbage
collection and process death do it too).

Restart: the constructor scans the directory and indexes every page file whose header is valid for
this namespace. Payload checksums are verified lazily, on read (or all at once by `verify_all`).

- A file with our magic but another namespace belongs to another model sharing the directory: it
  is ignored (not deleted, not counted against capacity, never served); `foreign_ignored` counts it.
- A page-named file that is zero-length, truncated, garbage, of another format version, whose
  header checksum fails, or whose key/shape/dtype/length disagree with its name or our layout, is
  deleted and counted in `corrupt_removed`.
- Files and directories whose names are not ours are ignored (`stray_ignored`).
- Overfull policy: if more valid pages are found than `capacity_pages`, every one is indexed (so the
  cache can see and evict them); `free_pages` is 0 and `overfull_pages` says how many must go
  before allocation succeeds again. The store itself never picks what to evict.

Errors:
- `allocate(keys)`: None when fewer than `len(keys)` pages are free or while writes are disabled;
  ValueError for a malformed key, a duplicate in `keys`, or a key that is already allocated/stored
  (check `contains` first).
- `free(keys)`: KeyError if any key is neither allocated nor stored (nothing is freed then).
- `write`: KeyError for a key that was not allocated, ValueError for a wrong shape or dtype,
  TierIOError for any OSError (pages before the failing one are stored; free the batch). An
  OSError also disables writes: `write_disabled` is True, `allocate` returns None, and `write`
  raises TierIOError at once, until a probe write succeeds after `retry_interval_s` (checked by
  `allocate` or `try_enable_writes`, on the injectable `clock`). An obstacle specific to one key (a
  directory where the page file should go) fails that write without disabling the tier.
- `read` / `read_into`: KeyError for a key that is not stored; PageCorruptError (with `.key_hex`
  and `.reason`) when the header, length or checksum fails -- the store has already deleted the
  file and dropped the key from its index, so the caller must forget the key and NOT free it;
  PageGoneError (same attributes, reason "gone") when the file was deleted (another process
  evicted it): the key is dropped from the index likewise, and counted in `pages_gone`.

Thread safety: reads and writes of distinct keys may run concurrently from many threads; a lock
guards only the index and the counters. The constructor starts no thread.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import xxhash

from ..config import KVLayout
from ..hashing import KEY_BYTES, Namespace, PageKey
from .base import DISK, Handle, KeyedStore, PageCorruptError, PageGoneError, ReadsInto, TierIOError, WritesFrom
from .codec import FORMAT_VERSION, HEADER_SIZE, MAGIC, PAGE_SUFFIX, PageCodec
from .shared import OWNER_PATTERN, DirectoryLedger, LocalLedger, is_shared_entry

log = logging.getLogger(__name__)

_PAGE_NAME = re.compile(r"^[0-9a-f]{32}\.page$")
# group 1: the owner (absent in the legacy `.<hex>.<pid>.<n>.tmp` form, whose owner counts as dead)
_TEMP_NAME = re.compile(rf"^\.[0-9a-f]{{32}}\.(?:({OWNER_PATTERN})|[0-9]+)\.[0-9]+\.tmp$")
_PROBE_NAME = re.compile(rf"^\.probe\.(?:({OWNER_PATTERN})|[0-9]+)\.[0-9]+\.tmp$")
# header checks that prove the file carried our namespace (and was counted in our ledger)
_UNPROVEN_REASONS = frozenset({"zero-length", "truncated header", "bad magic", "foreign", "unreadable", "absent", "not a file"})
_FANOUT_NAME = re.compile(r"^[0-9a-f]{2}$")

_RESERVED, _STORED = 0, 1
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_EVICT_LIST_LIMIT = 4096  # directory entries one evict_unindexed call lists before settling for what it found

COUNTER_NAMES = (
    "pages_written",
    "pages_read",
    "bytes_written",
    "bytes_read",
    "corrupt_removed",
    "foreign_ignored",
    "partial_removed",
    "write_errors",
    "pages_restored",
    "stray_ignored",
    "unlink_errors",
    "pages_gone",
    "pages_discovered",
    "peer_temp_kept",
    "peer_pages_evicted",
)


def check_key(key: object) -> PageKey:
    """A page key is exactly KEY_BYTES `bytes`; anything else is refused before it names a path."""
    if type(key) is not bytes or len(key) != KEY_BYTES:
        shown = repr(key)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise ValueError(f"disk: a page key must be {KEY_BYTES} bytes, got {type(key).__name__} {shown}")
    return key


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage, without a copy.

    The view does not keep the tensor alive: the caller must hold the tensor while using it.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("disk: tensor_bytes needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


class DiskPageStore(KeyedStore, ReadsInto, WritesFrom):
    """Content-addressed page files under one directory; handles are the 16-byte page keys."""

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
        self.counters: dict[str, int] = {name: 0 for name in COUNTER_NAMES}
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
        self._ledger: DirectoryLedger | LocalLedger
        try:
            self._ledger = DirectoryLedger(self.directory, namespace.root)
        except OSError as exc:  # e.g. read-only now: serve what is there, unshared (writes fail and disable)
            log.warning("disk tier: cannot set up sharing of %s (%s); this process accounts for it alone", self.directory, exc)
            self._ledger = LocalLedger()
        self.owner = self._ledger.owner
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
        return self._index.get(key) == _STORED

    def discover(self, key: PageKey) -> bool:
        """`contains`, or, for a key the index does not know once `peers_wrote`, whether another
        process has stored the page: its file is opened and its header checked (one failed `open`
        when absent), and a valid page is indexed (`pages_discovered`). A bad file there is removed
        like at start-up."""
        state = self._index.get(key)
        if state is not None or not self.peers_wrote:
            return state == _STORED
        hexkey = check_key(key).hex()
        path = self._page_str(hexkey)
        reason = self._scan_file(path, key)
        if reason == "":
            with self._lock:
                if key in self._index:
                    return self._index[key] == _STORED
                self._index[key] = _STORED
                self.counters["pages_discovered"] += 1
            return True
        if reason not in ("foreign", "unreadable", "absent", "not a file"):  # a bad file under our key: as at start-up
            self._remove_bad_file(Path(path), reason)
            with self._lock:
                self.counters["corrupt_removed"] += 1
        return False

    def evict_unindexed(self, num_pages: int) -> int:
        """Delete up to `num_pages` page files of this namespace that this store does not index
        (written by another process since this one opened), oldest first among those looked at:
        what a process does when the shared directory is full of pages it cannot see, so that one
        process's pages cannot lock the others out of the capacity. Looks at fan-out directories
        from a rotating start, listing about `_EVICT_LIST_LIMIT` entries per call once it has enough
        candidates. Returns the files deleted."""
        if num_pages <= 0:
            return 0
        candidates: list[tuple[float, str, PageKey]] = []
        want = max(256, 4 * num_pages)  # look at more than needed, to prefer the oldest
        try:
            subs = sorted(e.name for e in os.scandir(self.directory) if _FANOUT_NAME.match(e.name) and e.is_dir(follow_symlinks=False))
        except OSError:
            return 0
        if not subs:
            return 0
        start = self._evict_cursor % len(subs)
        listed = 0
        for n, name in enumerate(subs[start:] + subs[:start]):
            # bounded work per call (it may run on a scheduler thread): stop at enough candidates,
            # or at enough listing once there are as many as needed
            if len(candidates) >= want or (listed >= _EVICT_LIST_LIMIT and len(candidates) >= num_pages):
                self._evict_cursor = start + n
                break
            try:
                entries = list(os.scandir(self.directory / name))
            except OSError:
                continue
            listed += len(entries)
            for entry in entries:
                if not (_PAGE_NAME.match(entry.name) and entry.name.startswith(name)):
                    continue
                key = bytes.fromhex(entry.name[: 2 * KEY_BYTES])
                if key in self._index:
                    continue
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                candidates.append((mtime, entry.path, key))
        else:
            self._evict_cursor = start + len(subs)
        candidates.sort()
        freed = 0
        for _, path, key in candidates:
            if freed >= num_pages:
                break
            if self._scan_file(path, key) != "":  # another namespace's page (or not a page): not ours
                continue
            with self._ledger.locked():
                if key not in self._index and self._unlink(Path(path), quiet=True):
                    self._ledger.file_removed()
                    freed += 1
        with self._lock:
            self.counters["peer_pages_evicted"] += freed
        return freed

    def keys(self) -> Iterator[PageKey]:
        """The stored pages' keys (a snapshot)."""
        with self._lock:
            snapshot = [k for k, state in self._index.items() if state == _STORED]
        return iter(snapshot)

    def page_path(self, key: PageKey) -> Path:
        return Path(self._page_str(check_key(key).hex()))

    def _page_str(self, hexkey: str) -> str:
        """`page_path` as a string, without pathlib's cost (paid on every page read, write and free)."""
        return f"{self._dir_str}/{hexkey[:2]}/{hexkey}{PAGE_SUFFIX}"

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
                self._index[k] = _RESERVED
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
                self._n_reserved -= sum(1 for s in states if s == _RESERVED)
                ledgered = sum(1 for k, s in zip(keys, states) if s == _RESERVED and not self._unledger(k))
            if ledgered:
                self._ledger.unreserve(ledgered)
            removed = 0
            for k, state in zip(keys, states):
                # a reserved page has no file of ours (a write racing this free drops its own temp
                # file); whatever sits at its path is not ours to delete. A stored page's file may
                # already be gone (another process evicted it): then it is not counted twice.
                if state == _STORED and self._unlink(self._page_str(k.hex())):
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
                raise ValueError(f"disk: write_from a page of {tuple(p.shape)} / {p.dtype} on {p.device}, expected {shape} / {dtype} on cpu")
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
            raise ValueError(f"disk: read_into a tensor of shape {tuple(out.shape)} / {out.dtype}, expected {self.page_shape} / {self.dtype}")
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("disk: read_into needs a contiguous CPU tensor")
        if self._index.get(key) != _STORED:
            raise KeyError(f"disk: page {key.hex()} is not stored")
        path = self._page_str(key.hex())
        try:
            # O_NONBLOCK: a FIFO planted at the path must not block the reader (no effect on files)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
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

    def verify_all(self) -> list[PageKey]:
        """Read and checksum every stored page; delete the bad ones. Returns the keys removed."""
        buf = torch.empty(self.page_shape, dtype=self.dtype)
        bad: list[PageKey] = []
        for key in self.keys():
            try:
                self.read_into(key, buf)
            except PageCorruptError:
                bad.append(key)
            except (KeyError, PageGoneError):  # freed meanwhile, here or by another process
                pass
        return bad

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

    # ------------------------------------------------------------------ internals
    def _parse_header(self, header: bytes, size: int, key: PageKey) -> tuple[dict | None, str]:
        """(fields, "") for a valid header of ours; (None, reason) otherwise (see `PageCodec`)."""
        return self._codec.parse_header(header, size, key)

    @staticmethod
    def _pread_into(fd: int, view: memoryview, offset: int) -> int:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    def _write_fd(self, fd: int, buffers: list) -> None:
        """The one low-level write (tests inject ENOSPC here)."""
        views = [b if type(b) is bytes else memoryview(b).cast("B") for b in buffers]
        total = sum(map(len, views))
        done = 0
        while True:
            n = os.writev(fd, views)
            if n <= 0:
                raise OSError(errno.EIO, "writev wrote nothing")
            done += n
            if done >= total:  # the usual case: the first call wrote everything
                return
            while n > 0 and views:  # a short write: drop what was written
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0

    def _write_file(self, path: str | Path, buffers: list) -> None:
        fd = os.open(path, _CREATE, 0o600)
        try:
            self._write_fd(fd, buffers)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _ensure_dir(self, name: str) -> None:
        """Create the fan-out directory `name` (two hex digits) once per store."""
        if name in self._made_dirs:
            return
        sub = f"{self._dir_str}/{name}"
        try:
            os.mkdir(sub, 0o700)
        except FileExistsError:
            st = os.lstat(sub)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "fan-out entry is not a directory", sub) from None
        self._made_dirs.add(name)
        if self.fsync:
            self._fsync_dir(self.directory)

    @staticmethod
    def _fsync_dir(path: str | Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_pages(self, keys: list[PageKey], pages: Sequence[torch.Tensor]) -> None:
        """Write a batch of allocated pages (contiguous CPU tensors of `page_shape` and dtype): each
        to its own temp file, then all renamed into place in ONE critical section of the ledger
        (`_publish`). On an OSError the pages before the failing one are stored, the rest are not
        (their temp files are removed), and TierIOError is raised."""
        for k in keys:
            if k not in self._index:
                raise KeyError(f"disk: page {k.hex()} was not allocated")
        if self._write_disabled:
            raise TierIOError(f"disk: writes are disabled ({self._disabled_reason}); retrying after {self.retry_interval_s:g} s")
        written: list[tuple[PageKey, str, str]] = []  # (key, temp path, page path)
        failed: tuple[PageKey, OSError] | None = None
        dir_str, owner, seq, made, digest, header = self._dir_str, self.owner, self._tmp_seq, self._made_dirs, xxhash.xxh3_64_intdigest, self._codec.header
        page_ctype = self._page_ctype
        for key, page in zip(keys, pages):
            hexkey = key.hex()
            fan = hexkey[:2]
            tmp = f"{dir_str}/{fan}/.{hexkey}.{owner}.{next(seq)}.tmp"
            # `tensor_bytes` without its checks: `write` and `write_from` checked the pages
            payload = memoryview(page_ctype.from_address(page.data_ptr())).cast("B")
            try:
                if fan not in made:
                    self._ensure_dir(fan)
                self._write_file(tmp, [header(key, digest(payload)), payload])
            except OSError as exc:
                self._unlink(tmp, quiet=True)
                failed = (key, exc)
                break
            written.append((key, tmp, self._page_str(hexkey)))
        published = 0
        try:
            published = self._publish(written)
        except OSError as exc:
            published = getattr(exc, "published", 0)  # none when the lock itself failed (a closed store)
            for _, tmp, _ in written[published:]:  # the failing page's and those after it
                self._unlink(tmp, quiet=True)
            failed = (written[published][0], exc)
        if self.fsync and published:
            for sub in {w[2].rsplit("/", 1)[0] for w in written[:published]}:
                try:
                    self._fsync_dir(sub)
                except OSError as exc:
                    if failed is None:
                        failed = (written[0][0], exc)
        with self._lock:
            self.counters["pages_written"] += published
            self.counters["bytes_written"] += published * self._payload_bytes
        if failed is not None:
            key, exc = failed
            with self._lock:
                self.counters["write_errors"] += 1
            if not (isinstance(exc, IsADirectoryError) or (isinstance(exc, NotADirectoryError) and self.directory.is_dir())):
                self._disable(exc)
            # else: one key's path is blocked (a directory on the page's name, a file on its fan-out
            # directory's); the medium is fine
            raise TierIOError(f"disk: cannot write page {key.hex()}: {exc}") from exc

    def _publish(self, batch: list[tuple[PageKey, str, str]]) -> int:
        """Rename written temp files to their page paths and account for them, all under one hold
        of the ledger's lock, with one update of each shared count: the ledger's file count equals
        the files when the lock is released. A key freed while being written has its temp file
        removed instead (no unaccounted file). Returns how many entries of `batch` were handled
        (published pages, including freed ones); an OSError from a rename is raised after the
        entries before it are accounted for, with `.published` set to their number."""
        if not batch:
            return 0
        index = self._index
        done = created = 0
        stored: list[PageKey] = []
        with self._ledger.locked():
            # while no peer has written, a counted file sits at a page path only if we index it (we
            # free before rewriting) or its unlink failed: otherwise no look is needed. (Files the
            # start-up scan left, foreign or unreadable, are not counted: replacing one counts it.)
            look = self._kept_files or self.peers_wrote
            try:
                for key, tmp, final in batch:
                    if key not in index:  # freed while being written: leave no unaccounted file
                        self._unlink(tmp, quiet=True)
                        done += 1
                        continue
                    if self._rename_new(tmp, final, look):
                        created += 1
                    stored.append(key)
                    done += 1
            except OSError as exc:
                exc.published = done  # type: ignore[attr-defined]
                raise
            finally:
                if created:
                    self._ledger.file_created(created)
                if stored:
                    self._own_writes += len(stored)  # before the shared count, so `peers_wrote` never sees ours as a peer's
                    self._ledger.page_written(len(stored))
                    unreserve = 0
                    with self._lock:
                        for key in stored:
                            if index.get(key) == _RESERVED:
                                self._n_reserved -= 1
                                if not self._unledger(key):
                                    unreserve += 1
                            index[key] = _STORED
                    if unreserve:
                        self._ledger.unreserve(unreserve)
        return done

    def _rename_new(self, tmp: str, final: str, look: bool = True) -> bool:
        """Rename a temp file onto its page path; True if no file was there (another process's copy
        of the same page -- same bytes -- is replaced and not counted again). Without `look` the
        caller knows no file is there (one `lstat` a page saved). Call under the ledger."""
        existed = look and os.path.lexists(final)
        os.replace(tmp, final)
        return not existed

    def _disable(self, exc: OSError) -> None:
        with self._lock:
            was = self._write_disabled
            self._write_disabled = True
            self._disabled_reason = f"{type(exc).__name__}: {exc}"
            self._next_probe_at = self._clock() + self.retry_interval_s
        if not was:
            log.error(
                "disk tier: write into %s failed (%s); disk writes disabled, retrying every %g s",
                self.directory, self._disabled_reason, self.retry_interval_s,
            )

    def _corrupt(self, key: PageKey, path: str | Path, reason: str, detail: str, delete: bool = True) -> None:
        """Discard a page that failed verification and raise PageCorruptError."""
        if delete:
            with self._ledger.locked():
                if self._unlink(path, quiet=True):
                    self._ledger.file_removed()  # it was indexed, so it was counted
        with self._lock:
            state = self._index.pop(key, None)
            if state == _RESERVED:
                self._n_reserved -= 1
            self.counters["corrupt_removed"] += 1
            first = reason not in self._logged_reasons
            self._logged_reasons.add(reason)
        (log.warning if first else log.debug)("disk tier: page %s discarded (%s): %s", key.hex(), reason, detail)
        err = PageCorruptError(f"disk: page {key.hex()} is corrupt ({reason}): {detail}")
        err.key_hex = key.hex()  # type: ignore[attr-defined]
        err.reason = reason  # type: ignore[attr-defined]
        raise err

    def _unledger(self, key: PageKey) -> bool:
        """Forget a reservation made while the ledger could not be written; True if it was one
        (then the ledger never counted it). Call with `_lock` held."""
        if key in self._unledgered:
            self._unledgered.discard(key)
            return True
        return False

    def _gone(self, key: PageKey) -> None:
        """A stored page's file was deleted (another process evicted it): forget it, raise PageGoneError."""
        with self._lock:
            state = self._index.pop(key, None)
            if state == _RESERVED:
                self._n_reserved -= 1
            self.counters["pages_gone"] += 1
        log.debug("disk tier: page %s was deleted by another process", key.hex())
        err = PageGoneError(f"disk: page {key.hex()} is gone (deleted by another process)")
        err.key_hex = key.hex()  # type: ignore[attr-defined]
        err.reason = "gone"  # type: ignore[attr-defined]
        raise err

    def _remove_bad_file(self, path: Path, reason: str) -> None:
        """Delete a bad page file; it leaves the ledger's count only if its header proved it ours."""
        with self._ledger.locked():
            if self._unlink(path, quiet=True) and reason not in _UNPROVEN_REASONS:
                self._ledger.file_removed()

    def _unlink(self, path: str | Path, quiet: bool = False) -> bool:
        """Delete a file; True if this call removed it (False: already gone, or the unlink failed)."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            with self._lock:
                self.counters["unlink_errors"] += 1
                self._kept_files = True  # if it was a page, its file outlives its index entry
            if not quiet:
                log.warning("disk tier: cannot delete %s: %s", path, exc)
            return False

    def _scan(self) -> int:
        """Rebuild the index from the directory (see the module docstring for the rules). Returns
        the valid page files of our namespace found."""
        c = self.counters
        try:
            top = list(os.scandir(self.directory))
        except OSError as exc:
            raise TierIOError(f"disk: cannot list {str(self.directory)!r}: {exc}") from exc
        reasons: dict[str, int] = {}
        alive: dict[str, bool] = {}

        def owner_dead(m: re.Match) -> bool:  # a legacy name (no owner) counts as dead
            owner = m.group(1)
            if owner is None:
                return True
            if owner not in alive:
                alive[owner] = self._ledger.is_alive(owner)
            return not alive[owner]

        for sub in top:
            if is_shared_entry(sub.name):
                continue
            m = _PROBE_NAME.match(sub.name)
            if m and sub.is_file(follow_symlinks=False):
                if owner_dead(m):
                    self._unlink(Path(sub.path), quiet=True)
                continue
            if not (_FANOUT_NAME.match(sub.name) and sub.is_dir(follow_symlinks=False)):
                c["stray_ignored"] += 1
                continue
            self._made_dirs.add(sub.name)
            try:
                entries = list(os.scandir(sub.path))
            except OSError as exc:
                log.warning("disk tier: cannot list %s: %s", sub.path, exc)
                continue
            for entry in entries:
                name = entry.name
                m = _TEMP_NAME.match(name)
                if m and entry.is_file(follow_symlinks=False):
                    if owner_dead(m):  # an interrupted write: its owner will never rename it
                        self._unlink(Path(entry.path), quiet=True)
                        c["partial_removed"] += 1
                    else:  # a live process is writing it: not ours to touch
                        c["peer_temp_kept"] += 1
                    continue
                if not (_PAGE_NAME.match(name) and name.startswith(sub.name) and entry.is_file(follow_symlinks=False)):
                    c["stray_ignored"] += 1
                    continue
                key = bytes.fromhex(name[: 2 * KEY_BYTES])
                reason = self._scan_file(entry.path, key)
                if reason == "":
                    self._index[key] = _STORED
                    c["pages_restored"] += 1
                elif reason == "foreign":
                    c["foreign_ignored"] += 1
                elif reason not in ("unreadable", "absent", "not a file"):  # absent: deleted by another process meanwhile
                    self._remove_bad_file(Path(entry.path), reason)
                    c["corrupt_removed"] += 1
                    reasons[reason] = reasons.get(reason, 0) + 1
        if reasons:
            log.warning("disk tier: removed %d bad page files from %s at start: %s", sum(reasons.values()), self.directory, reasons)
        if c["partial_removed"]:
            log.info("disk tier: removed %d temp files left by an interrupted write in %s", c["partial_removed"], self.directory)
        return c["pages_restored"]

    def _warn_overfull(self) -> None:
        if self.overfull_pages:
            log.warning(
                "disk tier: %s holds %d pages, capacity is %d; %d must be evicted before new pages fit",
                self.directory, self._ledger.used, self.capacity_pages, self.overfull_pages,
            )

    def _scan_file(self, path: str, key: PageKey) -> str:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return "absent"
        except OSError as exc:
            log.warning("disk tier: cannot open %s: %s", path, exc)
            return "unreadable"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a directory or FIFO on the page's path: not ours
                return "not a file"
            size = st.st_size
            header = os.pread(fd, HEADER_SIZE, 0)
        except OSError as exc:
            log.warning("disk tier: cannot read %s: %s", path, exc)
            return "unreadable"
        finally:
            os.close(fd)
        _, reason = self._parse_header(header, size, key)
        return reason


__all__ = ["COUNTER_NAMES", "DiskPageStore", "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "check_key", "tensor_bytes"]
