"""What every process sharing one disk-tier directory agrees on: who is alive, and how full it is.

Under `<dir>/.shared/`: one owner lock file per live store (an exclusive flock the kernel drops when
the process dies, however it dies) and one capacity ledger per namespace (a flock'ed record of page
files, reservations and writes). `DiskPageStore` does every rename into and unlink of a page path
inside the ledger's critical section (`locked()`). The layout of both, and why it holds up under
SIGKILL and a read-only remount: `docs/disk-format.md` ("Shared state"). Not for network file
systems: flock is node-local.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SHARED_DIR = ".shared"
LEDGER_MAGIC = b"SGLHLEDG"
LEDGER_VERSION = 1
SLOTS = 64
_HEAD = struct.Struct("<8sIIqqQ")
_HEAD_SIZE = 64
_SLOT = struct.Struct("<40sq")
LEDGER_SIZE = _HEAD_SIZE + SLOTS * _SLOT.size
_FILES_AT, _RESERVED_AT, _WRITES_AT = 16, 24, 32

OWNER_PATTERN = r"[0-9]+-[0-9a-f]{16}"
_OWNER_NAME = re.compile(rf"^({OWNER_PATTERN})\.lock$")

_OPEN = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


_THREAD = threading.local()


def _held_here() -> dict[Path, int]:
    """Ledger paths whose flock this thread holds, with how many of this process's stores hold it."""
    held = getattr(_THREAD, "ledgers", None)
    if held is None:
        held = _THREAD.ledgers = {}
    return held


def new_owner_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def _mkdir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError as exc:
        if path.is_symlink() or not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path)) from exc


def owner_alive(owners_dir: Path, owner: str) -> bool:
    """True while the process that holds `owner`'s lock file lives (see `docs/disk-format.md`).
    A dead owner's lock file is removed on the way."""
    path = owners_dir / f"{owner}.lock"
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN)
    except FileNotFoundError:
        return False
    except OSError as exc:  # cannot tell: assume alive (never delete a live peer's work)
        log.warning("disk tier: cannot check owner %s: %s", owner, exc)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # dead: its file goes while we hold the lock, so no live owner loses it
        return False
    finally:
        os.close(fd)


class DirectoryLedger:
    """One store's membership in a shared disk directory: its owner lock and its namespace's ledger.

    Contract:
    - Opening registers a live owner (`owner`) and a ledger slot; `close()` (or garbage collection,
      or the process's death) gives both up. A store must not be used across `fork()`: a child
      opens its own.
    - `locked()` is the one critical section for the namespace's page files: every rename into
      and unlink of a page path, and every accounting change, happens inside it. Reads of
      `used` / `files` / `writes` outside it are unlocked snapshots.
    - `reserve(n, capacity)` reserves `n` pages for this owner if `used + n <= capacity` (after
      reclaiming dead owners' reservations when short); all or nothing.
    - `is_alive(owner)` is True for this owner and for any owner whose process still lives.
    """

    def __init__(self, directory: Path, namespace_root: bytes) -> None:
        self.shared_dir = directory / SHARED_DIR
        self.owners_dir = self.shared_dir / "owners"
        self.path = self.shared_dir / f"{namespace_root.hex()}.ledger"
        _mkdir(self.shared_dir)
        _mkdir(self.owners_dir)
        self.owner = new_owner_id()
        self._mutex = threading.RLock()
        self._depth = 0
        self._wfd: int | None = None  # writable only inside the critical section (see _flock)
        self._write_failed = False
        # No file of ours stays open for writing: a writable descriptor (or shared writable mapping)
        # would keep the file system from being remounted read-only under a running server.
        owner_path = self.owners_dir / f"{self.owner}.lock"
        # Locked before it is visible: created under a private name, flocked, then linked into place
        # (O_EXCL's semantics: fails if it exists). Created in place and locked after, a peer's
        # `owner_alive` could find it unlocked in between, take us for dead and unlink it; every
        # later peer would then take our temp files for a dead owner's and remove them mid-write.
        private = self.owners_dir / f".{self.owner}.{os.getpid()}.creating"
        self._owner_fd = os.open(private, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
        try:
            fcntl.flock(self._owner_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(private, owner_path)
        except BaseException:
            os.close(self._owner_fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _OPEN, 0o600)
        try:
            if os.fstat(fd).st_size < LEDGER_SIZE:
                os.ftruncate(fd, LEDGER_SIZE)
        finally:
            os.close(fd)
        self._fd = os.open(self.path, os.O_RDONLY | _OPEN)
        self._map = mmap.mmap(self._fd, LEDGER_SIZE, access=mmap.ACCESS_READ)
        self._slot = -1
        self._closer = weakref.finalize(
            self, DirectoryLedger._release, owner_path, self._owner_fd, self._fd, self.path, self._map
        )
        with self._flock():
            magic, version, slots, *_ = _HEAD.unpack_from(self._map, 0)
            if (magic, version, slots) != (LEDGER_MAGIC, LEDGER_VERSION, SLOTS):
                if magic != b"\0" * 8:
                    log.warning(
                        "disk tier: ledger %s was unreadable (magic %r, version %d); starting it afresh",
                        self.path,
                        magic,
                        version,
                    )
                fresh = _HEAD.pack(LEDGER_MAGIC, LEDGER_VERSION, SLOTS, 0, 0, 0).ljust(LEDGER_SIZE, b"\0")
                self._write(0, fresh, strict=True)
            self._claim_slot()
            self._sweep_owner_files()
            self.writes_at_open = self.writes  # under the lock: every later write is someone's since we opened

    # ---- lifetime -----------------------------------------------------------------------------
    @staticmethod
    def _release(owner_path: Path, owner_fd: int, fd: int, path: Path, mapping: mmap.mmap, wait: bool = False) -> None:
        # The finalizer (wait=False) runs at any allocation, in any thread -- also one inside another
        # store's critical section on this same ledger (two stores of one directory in one process),
        # or holding locks that ledger's holder needs. flock is per open file description, so
        # waiting there could wait on ourselves forever: take the lock only if it is free now, and
        # otherwise leave the wait to a helper thread. `close()` waits (wait=True) when it can.
        if wait:
            DirectoryLedger._finish_release(owner_path, owner_fd, fd, path, mapping, wait=True)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            args = (owner_path, owner_fd, fd, path, mapping, True)
            try:
                threading.Thread(
                    target=DirectoryLedger._finish_release, args=args, name="sgl-hicache-ledger-release", daemon=True
                ).start()
                return
            except RuntimeError:  # the interpreter is exiting: the slot is reclaimed as a dead owner's
                DirectoryLedger._finish_release(owner_path, owner_fd, fd, path, mapping, False)
                return
        except (OSError, ValueError):
            DirectoryLedger._finish_release(owner_path, owner_fd, fd, path, mapping, False)
            return
        DirectoryLedger._finish_release(owner_path, owner_fd, fd, path, mapping, False, locked=True)

    @staticmethod
    def _finish_release(
        owner_path: Path, owner_fd: int, fd: int, path: Path, mapping: mmap.mmap, wait: bool, locked: bool = False
    ) -> None:
        """Drop our slot (its reservations die with us) if we hold, or `wait` for, the ledger's
        flock; then give up the owner lock. Without the slot drop, the next store that runs short
        reclaims the slot as a dead owner's (`reclaim_dead`)."""
        with contextlib.suppress(OSError, ValueError):
            if wait:
                fcntl.flock(fd, fcntl.LOCK_EX)
                locked = True
            if locked:
                try:
                    own = owner_path.name[: -len(".lock")].encode()
                    for i in range(SLOTS):
                        at = _HEAD_SIZE + i * _SLOT.size
                        name, reserved = _SLOT.unpack_from(mapping, at)
                        if name.rstrip(b"\0") == own:
                            wfd = os.open(path, os.O_RDWR | _OPEN)
                            try:
                                total = struct.unpack_from("<q", mapping, _RESERVED_AT)[0]
                                os.pwrite(wfd, struct.pack("<q", total - reserved), _RESERVED_AT)
                                os.pwrite(wfd, _SLOT.pack(b"", 0), at)
                            finally:
                                os.close(wfd)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError, ValueError, BufferError):
            mapping.close()
        with contextlib.suppress(OSError):
            os.unlink(owner_path)
        for f in (fd, owner_fd):
            with contextlib.suppress(OSError):
                os.close(f)

    def close(self) -> None:
        """Give up the slot and the owner lock (idempotent). Waits for the ledger's lock unless this
        thread holds it through another store of the directory (then the slot goes once it is free)."""
        with self._mutex:
            detached = self._closer.detach()
            if detached is not None:
                owner_path, owner_fd, fd, path, mapping = detached[2]
                DirectoryLedger._release(
                    owner_path, owner_fd, fd, path, mapping, wait=_held_here().get(self.path, 0) == 0
                )

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    # ---- the critical section -------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._mutex:
            if self.closed:
                raise OSError(errno.EBADF, "disk tier: the store was closed")
            with self._flock():
                yield

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        with self._mutex:  # re-entrant for this thread; flock itself is taken once
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                held = _held_here()
                held[self.path] = held.get(self.path, 0) + 1
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    if self._wfd is not None:
                        with contextlib.suppress(OSError):
                            os.close(self._wfd)
                        self._wfd = None
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    _held_here()[self.path] -= 1

    def _write(self, at: int, data: bytes, strict: bool = False) -> bool:
        """Write ledger bytes (inside the critical section) through a descriptor opened for this
        section only. A failure (a file system gone read-only) is logged once and returns False;
        the counts may then drift until a lone start recounts them."""
        try:
            if self._wfd is None:
                self._wfd = os.open(self.path, os.O_RDWR | _OPEN)
            os.pwrite(self._wfd, data, at)
            return True
        except OSError as exc:
            if strict:
                raise
            if not self._write_failed:  # once: the store's own write failure says the rest
                log.warning(
                    "disk tier: cannot update the shared ledger %s (%s); no new pages until it can", self.path, exc
                )
            self._write_failed = True
            return False

    # ---- fields (snapshots outside `locked`) ----------------------------------------------------
    def _get(self, at: int) -> int:
        return struct.unpack_from("<q", self._map, at)[0]

    def _add(self, at: int, delta: int) -> bool:
        return self._write(at, struct.pack("<q", self._get(at) + delta))

    @property
    def files(self) -> int:
        return self._get(_FILES_AT)

    @property
    def reserved(self) -> int:
        return self._get(_RESERVED_AT)

    @property
    def writes(self) -> int:
        """Page files written into the namespace by any process, ever (never decreases)."""
        return self._get(_WRITES_AT)

    @property
    def used(self) -> int:
        return max(0, self.files) + max(0, self.reserved)

    # ---- changes (call inside `locked`) ---------------------------------------------------------
    def reserve(self, n: int, capacity: int) -> bool:
        """False when there is no room; OSError when the ledger cannot be written (the medium
        failed: the caller disables writes)."""
        if self.used + n > capacity:
            self.reclaim_dead()
            if self.used + n > capacity:
                return False
        return self._slot_add(n, strict=True)

    def unreserve(self, n: int) -> None:
        self._slot_add(-n)

    def file_created(self, n: int = 1) -> None:
        """`n` page files appeared (renamed into place) in this critical section."""
        self._add(_FILES_AT, n)

    def file_removed(self, n: int = 1) -> None:
        """`n` page files were unlinked in this critical section (the count never goes below 0)."""
        n = min(n, self.files)
        if n > 0:
            self._add(_FILES_AT, -n)

    def page_written(self, n: int = 1) -> None:
        self._add(_WRITES_AT, n)

    def recount(self, files: int) -> None:
        """Reset the file count to what a scan found, and the reservation total to the sum of the
        slots' (only when no other owner is alive). A SIGKILL between a slot's update and the
        total's (two writes) leaves the total off; a lone start puts it right, as it does the count."""
        self._write(_FILES_AT, struct.pack("<q", files))
        self._write(_RESERVED_AT, struct.pack("<q", sum(self._slot_reserved(i) for i in range(SLOTS))))

    def others_alive(self) -> bool:
        """Any other live owner of a slot (dead owners' slots are reclaimed on the way)."""
        self.reclaim_dead()
        return any(self._slot_name(i) not in ("", self.owner) for i in range(SLOTS))

    def reclaim_dead(self) -> int:
        """Free the slots (and reservations) of owners that died. Returns how many."""
        n = 0
        for i in range(SLOTS):
            name = self._slot_name(i)
            if name and name != self.owner and not owner_alive(self.owners_dir, name):
                _, reserved = _SLOT.unpack_from(self._map, self._slot_at(i))
                if self._add(_RESERVED_AT, -reserved):
                    self._write(self._slot_at(i), _SLOT.pack(b"", 0))
                n += 1
        if self.reserved < 0:  # a torn update by a killed owner: reservations cannot be negative
            self._write(_RESERVED_AT, struct.pack("<q", sum(self._slot_reserved(i) for i in range(SLOTS))))
        return n

    def _sweep_owner_files(self) -> None:
        """Remove the lock files of dead owners, those that never got a slot included (killed
        while starting)."""
        try:
            names = [m.group(1) for e in os.scandir(self.owners_dir) if (m := _OWNER_NAME.match(e.name))]
        except OSError:
            return
        for owner in names:
            if owner != self.owner:
                owner_alive(self.owners_dir, owner)  # unlinks a dead owner's file

    def is_alive(self, owner: str) -> bool:
        return owner == self.owner or owner_alive(self.owners_dir, owner)

    # ---- slots ----------------------------------------------------------------------------------
    @staticmethod
    def _slot_at(i: int) -> int:
        return _HEAD_SIZE + i * _SLOT.size

    def _slot_name(self, i: int) -> str:
        name, _ = _SLOT.unpack_from(self._map, self._slot_at(i))
        return name.rstrip(b"\0").decode("ascii", "replace")

    def _slot_reserved(self, i: int) -> int:
        return _SLOT.unpack_from(self._map, self._slot_at(i))[1]

    def _claim_slot(self) -> None:
        for attempt in range(2):
            for i in range(SLOTS):
                if self._slot_name(i) == "":
                    self._write(self._slot_at(i), _SLOT.pack(self.owner.encode(), 0), strict=True)
                    self._slot = i
                    return
            if attempt == 0:
                self.reclaim_dead()
        raise OSError(errno.EUSERS, f"disk tier: more than {SLOTS} live processes share this directory's namespace")

    def _slot_add(self, n: int, strict: bool = False) -> bool:
        at = self._slot_at(self._slot)
        name, reserved = _SLOT.unpack_from(self._map, at)
        if not self._write(at, _SLOT.pack(name, reserved + n), strict=strict):
            return False
        return self._write(_RESERVED_AT, struct.pack("<q", self._get(_RESERVED_AT) + n))


class LocalLedger:
    """The same accounting for one process alone: what a store falls back to when the directory's
    shared state cannot be created (a directory that is read-only when the server starts). Nothing
    is shared; every other owner counts as dead (so leftover temp files are removed, as before
    directories were shared)."""

    def __init__(self) -> None:
        self.owner = new_owner_id()
        self._mutex = threading.RLock()
        self.files = self.reserved = self.writes = self.writes_at_open = 0

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._mutex:
            yield

    @property
    def used(self) -> int:
        return self.files + self.reserved

    def reserve(self, n: int, capacity: int) -> bool:
        if self.used + n > capacity:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def file_created(self, n: int = 1) -> None:
        self.files += n

    def file_removed(self, n: int = 1) -> None:
        self.files = max(0, self.files - n)

    def page_written(self, n: int = 1) -> None:
        self.writes += n

    def recount(self, files: int) -> None:
        self.files = files

    def others_alive(self) -> bool:
        return False

    def is_alive(self, owner: str) -> bool:
        return owner == self.owner

    def close(self) -> None:
        pass


def is_shared_entry(name: str) -> bool:
    """The top-level entry that holds the shared state (never a stray, never a page)."""
    return name == SHARED_DIR


__all__ = [
    "DirectoryLedger",
    "LEDGER_SIZE",
    "LocalLedger",
    "OWNER_PATTERN",
    "SHARED_DIR",
    "is_shared_entry",
    "new_owner_id",
    "owner_alive",
]
