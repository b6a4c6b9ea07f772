"""Upgrade safety of the disk tier's on-disk format: a directory of another format version is read
(the unmarked directories every build before the format manifest wrote) or refused with both
versions named, before anything in it is read or deleted; a page file of another version is never
served and never deleted."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import PageCorruptError
from sgl_hicache.tiers.disk import FORMAT_VERSION, MANIFEST_NAME, DiskFormatError, DiskPageStore
from sgl_hicache.tiers.disk.manifest import record_manifest

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 4
NS = Namespace.for_model(LAYOUT, PAGE)
_SUMMED = 112  # the header checksum covers bytes 0..111 (docs/disk-format.md)


def open_store(d: Path) -> DiskPageStore:
    return DiskPageStore(LAYOUT, PAGE, 16, d, NS)


def written(d: Path, n: int = 3) -> tuple[list[bytes], torch.Tensor]:
    """`n` pages written and the store closed (a stopped server's directory)."""
    s = open_store(d)
    ks = [page_key(NS.root, [i] * PAGE) for i in range(n)]
    assert s.allocate(ks) == ks
    data = torch.randn((n, *s.page_shape), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    s.write(ks, data)
    s.close()
    return ks, data


def restamp(page: Path, version: int) -> None:
    """Rewrite a page file's header as a build of format `version` would have written it (a valid
    header checksum: only the version tells it apart)."""
    b = bytearray(page.read_bytes())
    struct.pack_into("<H", b, 8, version)
    struct.pack_into("<Q", b, _SUMMED, xxhash.xxh3_64_intdigest(bytes(b[:_SUMMED])))
    page.write_bytes(bytes(b))


def set_manifest_version(d: Path, version: int) -> None:
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["format_version"] = version
    (d / MANIFEST_NAME).write_text(json.dumps(doc))


def files_of(d: Path) -> dict[str, bytes]:
    """Every file outside the shared state, with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file() and ".shared" not in p.parts}


def test_a_new_directory_records_its_format_and_it_is_no_stray(tmp_path: Path) -> None:
    written(tmp_path)
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert doc["format_version"] == FORMAT_VERSION and doc["format"] == "sgl_hicache disk tier"
    s = open_store(tmp_path)
    assert s.counters["stray_ignored"] == 0 and s.counters["pages_restored"] == 3
    assert not list(tmp_path.glob(".probe.*"))  # the manifest's temp file is gone


def test_a_directory_of_the_previous_format_is_read_and_marked(tmp_path: Path, caplog) -> None:
    # the previous format: the same page files, no manifest (what every build before it wrote)
    ks, data = written(tmp_path)
    (tmp_path / MANIFEST_NAME).unlink()
    pages_before = files_of(tmp_path)
    caplog.set_level(logging.INFO, logger="sgl_hicache.tiers.disk")
    s = open_store(tmp_path)
    assert s.counters["pages_restored"] == 3 and s.counters["corrupt_removed"] == 0
    assert torch.equal(s.read(ks).view(torch.int16), data.view(torch.int16))
    assert any("format version 1" in r.getMessage() for r in caplog.records)
    after = files_of(tmp_path)
    assert json.loads(after.pop(MANIFEST_NAME))["format_version"] == FORMAT_VERSION
    assert after == pages_before  # read, not rewritten


@pytest.mark.parametrize("found", [FORMAT_VERSION - 1, FORMAT_VERSION + 1])
def test_a_directory_of_a_version_not_read_is_refused_untouched(tmp_path: Path, found: int) -> None:
    ks, _ = written(tmp_path)
    set_manifest_version(tmp_path, found)
    for k in ks:  # its pages as that build wrote them: a scan would misread or delete them
        restamp(tmp_path / k.hex()[:2] / f"{k.hex()}.page", found)
    before = files_of(tmp_path)
    with pytest.raises(DiskFormatError) as info:
        open_store(tmp_path)
    message = str(info.value)
    assert f"format version {found}" in message and f"reads format version {FORMAT_VERSION}" in message
    assert str(tmp_path) in message
    assert (info.value.found, info.value.readable) == (found, [FORMAT_VERSION])
    assert files_of(tmp_path) == before  # nothing read into an index, nothing deleted, no temp left


@pytest.mark.parametrize("content", [b"", b"\x00garbage", b"[1, 2]", b'{"format": "other", "format_version": 1}'])
def test_a_manifest_that_is_not_one_is_refused(tmp_path: Path, content: bytes) -> None:
    written(tmp_path)
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    before = files_of(tmp_path)
    with pytest.raises(DiskFormatError, match="not an sgl_hicache disk-tier format manifest"):
        open_store(tmp_path)
    assert files_of(tmp_path) == before


def test_a_racing_process_of_another_version_is_caught(tmp_path: Path) -> None:
    # another build recorded its manifest between this process's check and its own record
    written(tmp_path)
    set_manifest_version(tmp_path, FORMAT_VERSION + 1)
    with pytest.raises(DiskFormatError, match=f"format version {FORMAT_VERSION + 1}"):
        record_manifest(tmp_path, tmp_path / ".probe.tmp")


def test_a_page_of_another_version_is_skipped_at_start_never_served_kept(tmp_path: Path, caplog) -> None:
    ks, data = written(tmp_path)
    victim = tmp_path / ks[1].hex()[:2] / f"{ks[1].hex()}.page"
    restamp(victim, FORMAT_VERSION + 1)
    caplog.set_level(logging.WARNING, logger="sgl_hicache.tiers.disk")
    s = open_store(tmp_path)
    assert s.counters["version_skipped"] == 1 and s.counters["corrupt_removed"] == 0
    assert not s.contains(ks[1]) and victim.exists()
    with pytest.raises(KeyError):
        s.read([ks[1]])
    assert torch.equal(s.read([ks[0], ks[2]]).view(torch.int16), data[[0, 2]].view(torch.int16))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"format version {FORMAT_VERSION + 1} (this build reads {FORMAT_VERSION})" in said


def test_a_page_turned_another_version_under_a_reader_is_not_served(tmp_path: Path) -> None:
    ks, _ = written(tmp_path)
    s = open_store(tmp_path)
    victim = s.page_path(ks[0])
    restamp(victim, FORMAT_VERSION + 1)  # replaced by another build since this store indexed it
    with pytest.raises(PageCorruptError) as info:
        s.read([ks[0]])
    assert info.value.reason.startswith(f"format version {FORMAT_VERSION + 1}")
    assert s.counters["version_skipped"] == 1 and s.counters["corrupt_removed"] == 0
    assert victim.exists() and not s.contains(ks[0])
