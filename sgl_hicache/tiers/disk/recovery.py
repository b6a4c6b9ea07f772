"""Finding the page files a store's index does not know: the start-up scan that rebuilds the index,
`discover` (a page another process wrote), `evict_unindexed` (deleting such pages when the shared
directory is full) and `verify_all`.

What a restart does with each kind of file: `docs/disk-format.md` ("Restart").
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...hashing import KEY_BYTES, PageKey
from ..base import PageCorruptError, PageGoneError, TierIOError
from ..codec import DTYPE_MISMATCH, HEADER_SIZE, check_key, is_other_version
from .files import FANOUT_NAME, PAGE_NAME, PROBE_NAME, READ_FLAGS, STORED, TEMP_NAME, PageFiles, log
from .ledger import is_shared_entry
from .manifest import MANIFEST_NAME

# header checks that prove the file carried our namespace (and was counted in our ledger)
_UNPROVEN_REASONS = frozenset(
    {"zero-length", "truncated header", "bad magic", "foreign", "unreadable", "absent", "not a file"}
)
_EVICT_LIST_LIMIT = 4096  # directory entries one evict_unindexed call lists before settling for what it found


class DirectoryScan(PageFiles):
    """The directory as found on disk, beyond what the index knows: the recovery half of
    `DiskPageStore` (a mixin; the store provides `keys`, `read_into` and `overfull_pages`).

    Contract:
    - `_scan()` rebuilds the index from the directory (rules: `docs/disk-format.md`) and returns
      the valid page files of our namespace found; bad page files are deleted and counted, foreign
      and stray ones are left alone and counted; dead owners' temp files are removed.
    - `_scan_file(path, key)` is "" for a valid page file of ours under `key`, else the reason
      ("absent", "unreadable", "not a file", "foreign", or a corruption).
    - `discover`, `evict_unindexed` and `verify_all`: as documented on each.
    """

    capacity_pages: int
    page_shape: tuple[int, int, int, int, int]
    dtype: torch.dtype
    _evict_cursor: int

    if TYPE_CHECKING:  # the store's

        def keys(self) -> Iterator[PageKey]: ...

        def read_into(self, key: PageKey, out: torch.Tensor) -> None: ...

        @property
        def overfull_pages(self) -> int: ...

    def discover(self, key: PageKey) -> bool:
        """`contains`, or, for a key the index does not know once `peers_wrote`, whether another
        process has stored the page: its file is opened and its header checked (one failed `open`
        when absent), and a valid page is indexed (`pages_discovered`). A bad file there is removed
        like at start-up."""
        state = self._index.get(key)
        if state is not None or not self.peers_wrote:
            return state == STORED
        hexkey = check_key(key).hex()
        path = self._page_str(hexkey)
        reason = self._scan_file(path, key)
        if reason == "":
            with self._lock:
                if key in self._index:
                    return self._index[key] == STORED
                self._index[key] = STORED
                self.counters["pages_discovered"] += 1
            return True
        if is_other_version(reason):
            with self._lock:
                self.counters["version_skipped"] += 1
        elif reason not in ("foreign", "unreadable", "absent", "not a file"):  # a bad file under our key: as at start
            self._remove_bad_file(Path(path), reason)
            with self._lock:
                self.counters["corrupt_removed"] += 1
                if reason == DTYPE_MISMATCH:
                    self.counters["dtype_mismatch"] += 1
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
            subs = sorted(
                e.name
                for e in os.scandir(self.directory)
                if FANOUT_NAME.match(e.name) and e.is_dir(follow_symlinks=False)
            )
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
                if not (PAGE_NAME.match(entry.name) and entry.name.startswith(name)):
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

    # ------------------------------------------------------------------ the start-up scan
    def _scan(self) -> int:
        """Rebuild the index from the directory (see `docs/disk-format.md` for the rules). Returns
        the valid page files of our namespace found."""
        c = self.counters
        try:
            top = list(os.scandir(self.directory))
        except OSError as exc:
            raise TierIOError(f"disk: cannot list {str(self.directory)!r}: {exc}") from exc
        reasons: dict[str, int] = {}
        skipped: dict[str, int] = {}
        alive: dict[str, bool] = {}

        def owner_dead(m: re.Match) -> bool:  # a legacy name (no owner) counts as dead
            owner = m.group(1)
            if owner is None:
                return True
            if owner not in alive:
                alive[owner] = self._ledger.is_alive(owner)
            return not alive[owner]

        for sub in top:
            if is_shared_entry(sub.name) or sub.name == MANIFEST_NAME:
                continue
            m = PROBE_NAME.match(sub.name)
            if m and sub.is_file(follow_symlinks=False):
                if owner_dead(m):
                    self._unlink(Path(sub.path), quiet=True)
                continue
            if not (FANOUT_NAME.match(sub.name) and sub.is_dir(follow_symlinks=False)):
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
                m = TEMP_NAME.match(name)
                if m and entry.is_file(follow_symlinks=False):
                    if owner_dead(m):  # an interrupted write: its owner will never rename it
                        self._unlink(Path(entry.path), quiet=True)
                        c["partial_removed"] += 1
                    else:  # a live process is writing it: not ours to touch
                        c["peer_temp_kept"] += 1
                    continue
                ours = PAGE_NAME.match(name) and name.startswith(sub.name)
                if not (ours and entry.is_file(follow_symlinks=False)):
                    c["stray_ignored"] += 1
                    continue
                key = bytes.fromhex(name[: 2 * KEY_BYTES])
                reason = self._scan_file(entry.path, key)
                if reason == "":
                    self._index[key] = STORED
                    c["pages_restored"] += 1
                elif reason == "foreign":
                    c["foreign_ignored"] += 1
                elif is_other_version(reason):  # written by another build: not corrupt, not ours to read
                    c["version_skipped"] += 1
                    skipped[reason] = skipped.get(reason, 0) + 1
                # absent: deleted by another process meanwhile
                elif reason not in ("unreadable", "absent", "not a file"):
                    self._remove_bad_file(Path(entry.path), reason)
                    c["corrupt_removed"] += 1
                    if reason == DTYPE_MISMATCH:
                        c["dtype_mismatch"] += 1
                    reasons[reason] = reasons.get(reason, 0) + 1
        if reasons:
            log.warning(
                "disk tier: removed %d bad page files from %s at start: %s",
                sum(reasons.values()),
                self.directory,
                reasons,
            )
        if skipped:
            log.warning(
                "disk tier: %d page files in %s are of another format version, left in place and never "
                "served: %s (delete them to reclaim the space)",
                sum(skipped.values()),
                self.directory,
                skipped,
            )
        if c["partial_removed"]:
            log.info(
                "disk tier: removed %d temp files left by an interrupted write in %s",
                c["partial_removed"],
                self.directory,
            )
        return c["pages_restored"]

    def _scan_file(self, path: str, key: PageKey) -> str:
        try:
            fd = os.open(path, READ_FLAGS)
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

    def _remove_bad_file(self, path: Path, reason: str) -> None:
        """Delete a bad page file; it leaves the ledger's count only if its header proved it ours."""
        with self._ledger.locked():
            if self._unlink(path, quiet=True) and reason not in _UNPROVEN_REASONS:
                self._ledger.file_removed()

    def _warn_overfull(self) -> None:
        if self.overfull_pages:
            log.warning(
                "disk tier: %s holds %d pages, capacity is %d; %d must be evicted before new pages fit",
                self.directory,
                self._ledger.used,
                self.capacity_pages,
                self.overfull_pages,
            )


__all__ = ["DirectoryScan"]
