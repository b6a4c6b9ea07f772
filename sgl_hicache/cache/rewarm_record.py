"""The re-warm record: the prefixes a cache used most, saved beside its disk tier at a clean stop
(and periodically), read by the next process on the same directory to bring them back to host.

File `<disk_dir>/.shared/<namespace hex>.rewarm` (one per namespace; little endian): magic
`SGLHRWRM`, version (u32), path count (u32), then per path its token count (u32) and token ids
(i64). Written to a temp file and renamed into place, so a reader sees a whole record or the last
one. It holds prompt token ids: it lives under the disk tier's private (0700) directory.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from array import array
from pathlib import Path

from ..hashing import Namespace

log = logging.getLogger(__name__)

MAGIC = b"SGLHRWRM"
VERSION = 1
_HEAD = struct.Struct("<8sII")
_LEN = struct.Struct("<I")
_MAX_TOKENS = 1 << 28  # a sanity bound on one record (2 GiB of token ids)


def record_path(disk_dir: Path, namespace: Namespace) -> Path:
    """Where the record of `namespace` lives in the disk tier's directory."""
    return Path(disk_dir) / ".shared" / f"{namespace.root.hex()}.rewarm"


def save_record(path: Path, paths: list[array]) -> bool:
    """Write `paths` (int64 token arrays, most valuable first) atomically. False (logged) when the
    directory cannot be written: the next start then re-warms from the previous record, or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, len(paths)))
            for p in paths:
                f.write(_LEN.pack(len(p)))
                f.write(p.tobytes() if p.typecode == "q" else array("q", p).tobytes())
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("re-warm: cannot write the record %s: %s", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def load_record(path: Path) -> list[array]:
    """The paths of a record, most valuable first; [] when there is none. A record that is not one
    (another version, truncated) is ignored with a warning: re-warm is an optimisation, never a
    reason not to start."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("re-warm: cannot read the record %s: %s", path, exc)
        return []
    try:
        magic, version, count = _HEAD.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"magic {magic!r}, version {version} (this build reads {VERSION})")
        paths, at, total = [], _HEAD.size, 0
        for _ in range(count):
            (n,) = _LEN.unpack_from(data, at)
            at += _LEN.size
            total += n
            if total > _MAX_TOKENS or at + 8 * n > len(data):
                raise ValueError("truncated")
            paths.append(array("q", data[at : at + 8 * n]))
            at += 8 * n
        return paths
    except (struct.error, ValueError) as exc:
        log.warning("re-warm: ignoring the record %s: %s", path, exc)
        return []


class RecordWriter:
    """Writes re-warm records on a thread of its own, so the thread that chose the paths (SGLang's
    scheduler) never touches the disk.

    Contract:
    - `submit(path, paths)` never blocks and does no I/O: it leaves the record in a one-slot mailbox
      (a newer record replaces one not yet written) and wakes the writer thread, which writes it
      with `save_record`.
    - `written` counts the records written, `failed` those `save_record` could not write.
    - `close(timeout_s)` writes what is pending, then stops the thread; `submit` after it is ignored.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: tuple[Path, list[array]] | None = None
        self._closed = False
        self.written = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="sgl_hicache-rewarm-record", daemon=True)
        self._thread.start()

    def submit(self, path: Path, paths: list[array]) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending = (path, paths)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                job, self._pending = self._pending, None
                if job is None:  # closed, nothing left
                    return
            if save_record(*job):
                self.written += 1
            else:
                self.failed += 1

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)


__all__ = ["MAGIC", "VERSION", "RecordWriter", "load_record", "record_path", "save_record"]
