"""The disk tier's file protocol: page paths and names, the header check, reads and writes of page
files, publishing a written batch (renames under the ledger), fsync and unlink.

The format and the crash-safety rules: `docs/disk-format.md`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash

from ...hashing import PageKey
from ..base import TierIOError
from ..codec import PAGE_SUFFIX, PageCodec, check_key
from .ledger import OWNER_PATTERN, DirectoryLedger, LocalLedger

# one logger for every module of the disk tier (users and tests filter on this name)
log = logging.getLogger("sgl_hicache.tiers.disk")

PAGE_NAME = re.compile(r"^[0-9a-f]{32}\.page$")
# group 1: the owner (absent in the legacy `.<hex>.<pid>.<n>.tmp` form, whose owner counts as dead)
TEMP_NAME = re.compile(rf"^\.[0-9a-f]{{32}}\.(?:({OWNER_PATTERN})|[0-9]+)\.[0-9]+\.tmp$")
PROBE_NAME = re.compile(rf"^\.probe\.(?:({OWNER_PATTERN})|[0-9]+)\.[0-9]+\.tmp$")
FANOUT_NAME = re.compile(r"^[0-9a-f]{2}$")

# a key's state in a store's index
RESERVED, STORED = 0, 1
# opening a page file to read it: no symlinks; O_NONBLOCK, so that a FIFO planted at the path cannot
# block the reader (no effect on files)
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class PageFiles:
    """The page files of one store's directory: the file-level half of `DiskPageStore` (a mixin; the
    store's constructor sets the state declared below, and the store provides `peers_wrote`).

    Contract:
    - `page_path(key)` is where a key's page lives; nothing here reads or writes outside
      `directory` (a key is checked before it names a path).
    - `_write_pages(keys, pages)` writes allocated pages: each to a temp file, then all renamed into
      place in one critical section of the ledger (`_publish`); an OSError leaves the pages before
      the failing one stored, disables writes unless only that key's path is blocked, and raises
      TierIOError.
    - `_unlink(path)` is the one way a file of ours is deleted; a failure is counted
      (`unlink_errors`), never raised.
    - `_write_fd` is the one low-level write (tests inject ENOSPC there).
    """

    directory: Path
    fsync: bool
    owner: str
    retry_interval_s: float
    counters: dict[str, int]
    if TYPE_CHECKING:  # the store's, a read-only property there

        @property
        def peers_wrote(self) -> bool: ...

    _dir_str: str
    _clock: Callable[[], float]
    _codec: PageCodec
    _payload_bytes: int
    _page_ctype: type[ctypes.Array]
    _lock: threading.Lock
    _index: dict[PageKey, int]
    _n_reserved: int
    _ledger: DirectoryLedger | LocalLedger
    _tmp_seq: Iterator[int]
    _made_dirs: set[str]
    _write_disabled: bool
    _next_probe_at: float
    _disabled_reason: str
    _own_writes: int
    _kept_files: bool
    _unledgered: set[PageKey]

    def page_path(self, key: PageKey) -> Path:
        return Path(self._page_str(check_key(key).hex()))

    def _page_str(self, hexkey: str) -> str:
        """`page_path` as a string, without pathlib's cost (paid on every page read, write and free)."""
        return f"{self._dir_str}/{hexkey[:2]}/{hexkey}{PAGE_SUFFIX}"

    # ------------------------------------------------------------------ reading
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

    # ------------------------------------------------------------------ writing
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
            raise TierIOError(
                f"disk: writes are disabled ({self._disabled_reason}); retrying after {self.retry_interval_s:g} s"
            )
        written: list[tuple[PageKey, str, str]] = []  # (key, temp path, page path)
        failed: tuple[PageKey, OSError] | None = None
        dir_str, owner, seq, made = self._dir_str, self.owner, self._tmp_seq, self._made_dirs
        digest, header = xxhash.xxh3_64_intdigest, self._codec.header
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
            key, err = failed
            with self._lock:
                self.counters["write_errors"] += 1
            blocked = isinstance(err, IsADirectoryError) or (
                isinstance(err, NotADirectoryError) and self.directory.is_dir()
            )
            if not blocked:
                self._disable(err)
            # else: one key's path is blocked (a directory on the page's name, a file on its fan-out
            # directory's); the medium is fine
            raise TierIOError(f"disk: cannot write page {key.hex()}: {err}") from err

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
                    # before the shared count, so `peers_wrote` never sees ours as a peer's
                    self._own_writes += len(stored)
                    self._ledger.page_written(len(stored))
                    unreserve = 0
                    with self._lock:
                        for key in stored:
                            if index.get(key) == RESERVED:
                                self._n_reserved -= 1
                                if not self._unledger(key):
                                    unreserve += 1
                            index[key] = STORED
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

    def _unledger(self, key: PageKey) -> bool:
        """Forget a reservation made while the ledger could not be written; True if it was one
        (then the ledger never counted it). Call with `_lock` held."""
        if key in self._unledgered:
            self._unledgered.discard(key)
            return True
        return False

    def _disable(self, exc: OSError) -> None:
        with self._lock:
            was = self._write_disabled
            self._write_disabled = True
            self._disabled_reason = f"{type(exc).__name__}: {exc}"
            self._next_probe_at = self._clock() + self.retry_interval_s
        if not was:
            log.error(
                "disk tier: write into %s failed (%s); disk writes disabled, retrying every %g s",
                self.directory,
                self._disabled_reason,
                self.retry_interval_s,
            )

    # ------------------------------------------------------------------ deleting
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


__all__ = [
    "FANOUT_NAME",
    "PAGE_NAME",
    "PROBE_NAME",
    "READ_FLAGS",
    "RESERVED",
    "STORED",
    "TEMP_NAME",
    "PageFiles",
    "log",
]
