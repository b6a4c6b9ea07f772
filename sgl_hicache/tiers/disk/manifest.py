"""The disk-tier directory's format manifest: `<dir>/format.json`, which names the on-disk format
version every page file under the directory was written in.

A build opens a directory only if it reads that version; otherwise it refuses before it reads,
indexes or deletes anything, with an error naming the version found and the versions it reads (a
scan by the wrong build would take every page for corrupt and delete it, or worse, misread it). A
directory with page files and no manifest was written before manifests existed, when version 1 was
the only format: it is read as version 1 (every page header is still checked) and the manifest is
added. The rules: `docs/disk-format.md` ("Format versions").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..codec import FORMAT_VERSION, HEADER_SIZE, MAGIC
from .files import FANOUT_NAME, log

MANIFEST_NAME = "format.json"
FORMAT_NAME = "sgl_hicache disk tier"
# the versions this build reads (page headers and directory layout); a manifest naming another is refused
READABLE_VERSIONS = frozenset({FORMAT_VERSION})
# the version of a directory written before manifests existed (its page files are version 1)
UNMARKED_VERSION = 1
_MAX_MANIFEST_BYTES = 64 * 1024


class DiskFormatError(ValueError):
    """A disk-tier directory written in a format this build does not read (or whose manifest is not
    one): nothing in it was read, indexed or deleted. `.found` is the version found (None when the
    manifest is unreadable), `.readable` the versions this build reads."""

    def __init__(self, message: str, found: int | None) -> None:
        super().__init__(message)
        self.found = found
        self.readable = sorted(READABLE_VERSIONS)


def manifest_bytes() -> bytes:
    """The manifest this build writes."""
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "page_magic": MAGIC.decode("ascii"),
        "page_header_bytes": HEADER_SIZE,
        "spec": "docs/disk-format.md",
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("ascii")


def check_manifest(directory: Path) -> int | None:
    """The format version `directory`'s manifest names, after checking this build reads it; None
    when there is no manifest (a new directory, or one written before manifests: version 1). Only
    reads. Raises DiskFormatError for a version this build does not read or a manifest that is not
    one."""
    path = directory / MANIFEST_NAME
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        if _has_pages(directory):
            log.info(
                "disk tier: %s has page files and no %s (written before format manifests): reading it as "
                "format version %d; every page header is still checked",
                directory,
                MANIFEST_NAME,
                UNMARKED_VERSION,
            )
            _refuse_unreadable(directory, UNMARKED_VERSION, "its page files (no manifest)")
        return None
    except OSError as exc:
        raise DiskFormatError(f"disk: cannot read the format manifest {str(path)!r}: {exc}", None) from exc
    try:
        doc = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_MANIFEST_BYTES else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME or type(version) is not int:
        raise DiskFormatError(
            f"disk: {str(path)!r} is not an sgl_hicache disk-tier format manifest (expected a JSON object "
            f'with "format": "{FORMAT_NAME}" and an integer "format_version"); nothing in {str(directory)!r} '
            "was read or deleted. Restore the file, or delete the directory to start with an empty disk tier",
            None,
        )
    _refuse_unreadable(directory, version, str(path))
    return version


def record_manifest(directory: Path, temp_path: Path) -> None:
    """Write this build's manifest into `directory` unless one is there, atomically (written to
    `temp_path`, then hard-linked into place: a racing writer's manifest is never replaced), then
    check the manifest that won. A directory that cannot be written keeps working without one (it
    is read as version 1 next time, which is what it holds). Raises DiskFormatError when a racing
    process of another format version recorded its own."""
    path = directory / MANIFEST_NAME
    if path.exists():  # (recorded by a process that opened the directory since this one checked)
        check_manifest(directory)
        return
    try:
        fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, manifest_bytes())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp_path, path)
        except FileExistsError:  # another process recorded one meanwhile: it must be readable too
            check_manifest(directory)
    except OSError as exc:
        log.warning("disk tier: cannot write the format manifest %s: %s", path, exc)
    finally:
        try:
            os.unlink(temp_path)
        except OSError:
            pass


def _refuse_unreadable(directory: Path, version: int, where: str) -> None:
    if version in READABLE_VERSIONS:
        return
    readable = ", ".join(str(v) for v in sorted(READABLE_VERSIONS))
    raise DiskFormatError(
        f"disk: {str(directory)!r} holds disk-tier format version {version} ({where}); this build of "
        f"sgl_hicache reads format version {readable}. Nothing in it was read or deleted: run the build "
        "that wrote it, point the disk directory elsewhere, or delete it to start with an empty disk tier",
        version,
    )


def _has_pages(directory: Path) -> bool:
    """Whether the directory holds any fan-out directory (a page file lives in one)."""
    try:
        with os.scandir(directory) as entries:
            return any(FANOUT_NAME.match(e.name) for e in entries)
    except OSError:
        return False


__all__ = [
    "MANIFEST_NAME",
    "READABLE_VERSIONS",
    "UNMARKED_VERSION",
    "DiskFormatError",
    "check_manifest",
    "manifest_bytes",
    "record_manifest",
]
