"""Corrupt data *through the cache*: every kind of bad page file is a miss, counted,
removed (or ignored where it is not ours), logged once per reason, and never an exception out of
match / promote / insert. The store-level twins of these tests are in tests/unit/tiers/test_disk_store.py.

Two moments are tried for each corruption: before a restarted cache opens the directory (its scan
judges the header) and after the cache adopted the pages (the read at promotion judges everything,
payload checksum included).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from conftest import kv_for, make_cache, serve

from sgl_hicache.hashing import chain_keys
from sgl_hicache.tiers.base import DEVICE, DISK
from sgl_hicache.tiers.disk import FORMAT_VERSION, HEADER_SIZE

PS = 4
PAGES = 4  # pages per prompt


def seq(start: int, pages: int = PAGES) -> list[int]:
    return list(range(start, start + pages * PS))


def persist(tmp_path: Path, prompts) -> None:
    """Write every prompt's pages through to disk with one cache, then drop that cache (a restart)."""
    cache = make_cache(
        tmp_path, device=8, host=8, disk=256, write_policy="write_through", disk_write_policy="write_through"
    )
    for p in prompts:
        serve(cache, p)
    cache.check()
    assert cache.stores[DISK].stored_pages == len(prompts) * PAGES


def fresh(tmp_path: Path):
    return make_cache(tmp_path, device=8, host=8, disk=256)


def page_file(cache, prompt, i: int) -> Path:
    return cache.stores[DISK].page_path(chain_keys(cache.namespace.root, prompt, PS)[i])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_served_right(cache, prompt) -> None:
    m = cache.promote(cache.match(prompt))
    assert m.device_tokens == len(prompt)
    assert torch.equal(bits(cache.stores[DEVICE].read(m.device_handles)), bits(kv_for(cache, prompt)))


# ---- the corruptions: each takes the victim's path and the path of another valid page of ours
def flip_payload(p: Path, other: Path) -> None:
    b = bytearray(p.read_bytes())
    b[HEADER_SIZE + 37] ^= 0x10
    p.write_bytes(bytes(b))


def flip_header(p: Path, other: Path) -> None:
    b = bytearray(p.read_bytes())
    b[60] ^= 0x01  # inside the dtype field: caught by the header checksum
    p.write_bytes(bytes(b))


def truncate(p: Path, other: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def truncate_header(p: Path, other: Path) -> None:
    p.write_bytes(p.read_bytes()[:50])


def zero_length(p: Path, other: Path) -> None:
    p.write_bytes(b"")


def garbage(p: Path, other: Path) -> None:
    p.write_bytes(os.urandom(HEADER_SIZE + 64))


def trailing(p: Path, other: Path) -> None:
    p.write_bytes(p.read_bytes() + b"\0")


def other_version(p: Path, other: Path) -> None:
    b = bytearray(p.read_bytes())
    struct.pack_into("<H", b, 8, FORMAT_VERSION + 1)
    p.write_bytes(bytes(b))


def wrong_key(p: Path, other: Path) -> None:
    """Another page's valid file (right magic, namespace, checksums) under this page's name."""
    p.write_bytes(other.read_bytes())


CORRUPTIONS = {
    "flip_payload": flip_payload,
    "flip_header": flip_header,
    "truncate": truncate,
    "truncate_header": truncate_header,
    "zero_length": zero_length,
    "garbage": garbage,
    "trailing": trailing,
    "other_version": other_version,
    "wrong_key": wrong_key,
}
PER_KIND = 3  # prompts corrupted per kind (to prove logging is per reason, not per page)
CORRUPTIONS_TRIED = 2 * len(CORRUPTIONS) * PER_KIND  # both moments; quoted in docs/reliability.md


def warnings_from(caplog, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == logger]


def test_corruption_before_restart_is_a_shorter_hit(tmp_path: Path, caplog) -> None:
    """Header damage is judged by the restarted store's scan: the bad page and everything after it in
    its prompt are a miss, the pages before it still hit and come back bit-identical, and the scan
    logs one line for all bad files. A payload bit flip passes the scan and is caught at promotion."""
    kinds = sorted(CORRUPTIONS)
    prompts = {(k, j): seq(10_000 * (1 + i) + 100 * j) for i, k in enumerate(kinds) for j in range(PER_KIND)}
    clean = seq(999_000)
    persist(tmp_path, [*prompts.values(), clean])
    probe = fresh(tmp_path)
    victims = {}
    for (kind, j), p in prompts.items():
        victims[(kind, j)] = page_file(probe, p, 2)
        CORRUPTIONS[kind](victims[(kind, j)], page_file(probe, clean, 0))
    del probe

    caplog.set_level(logging.DEBUG, logger="sgl_hicache")
    cache = fresh(tmp_path)
    disk = cache.stores[DISK]
    header_kinds = [k for k in kinds if k != "flip_payload"]
    # a page of another format version is not corrupt: kept for the build that wrote it, never served
    assert disk.counters["corrupt_removed"] == (len(header_kinds) - 1) * PER_KIND
    assert disk.counters["version_skipped"] == PER_KIND
    scan_lines = sorted(r.getMessage() for r in warnings_from(caplog, "sgl_hicache.tiers.disk"))
    assert len(scan_lines) == 2 and "another format version" in scan_lines[0] and "removed" in scan_lines[1]
    for kind in header_kinds:
        for j in range(PER_KIND):
            assert victims[(kind, j)].exists() == (kind == "other_version"), kind
            m = cache.match(prompts[(kind, j)])
            assert m.disk_tokens == 2 * PS, kind  # pages 0 and 1 only
            m = cache.promote(m)
            assert m.device_tokens == 2 * PS
            got = cache.stores[DEVICE].read(m.device_handles)
            assert torch.equal(bits(got), bits(kv_for(cache, prompts[(kind, j)])[:2]))
    caplog.clear()
    for j in range(PER_KIND):  # the payload flip: adopted whole, lost whole at the read
        p = prompts[("flip_payload", j)]
        m = cache.match(p)
        assert m.disk_tokens == PAGES * PS
        m = cache.promote(m)
        assert m.device_tokens == 0
        assert cache.match(p, touch=False).tokens == 0
        assert not victims[("flip_payload", j)].exists()
    assert cache.snapshot()["errors"] == {"corrupt_pages": PER_KIND}
    assert len(warnings_from(caplog, "sgl_hicache.tiers.disk")) == 1
    assert len(warnings_from(caplog, "sgl_hicache.cache")) == 1  # not one per page
    assert_served_right(cache, clean)
    cache.check()


def test_corruption_after_adoption_is_a_miss_counted_removed_logged_once(tmp_path: Path, caplog) -> None:
    """Every kind of damage, made after the cache adopted the pages, is caught by the read at
    promotion: the node is a miss (a corrupt page costs its whole node), the error is counted, the
    bad file is removed, each reason is logged once, and nothing raises."""
    kinds = sorted(CORRUPTIONS)
    prompts = {(k, j): seq(10_000 * (1 + i) + 100 * j) for i, k in enumerate(kinds) for j in range(PER_KIND)}
    clean = seq(999_000)
    persist(tmp_path, [*prompts.values(), clean])
    cache = fresh(tmp_path)
    for p in [*prompts.values(), clean]:
        assert cache.match(p).disk_tokens == PAGES * PS  # adopted from disk
    victims = {}
    for (kind, j), p in prompts.items():
        victims[(kind, j)] = page_file(cache, p, 1)
        CORRUPTIONS[kind](victims[(kind, j)], page_file(cache, clean, 0))

    caplog.set_level(logging.DEBUG, logger="sgl_hicache")
    for (kind, j), p in prompts.items():
        m = cache.promote(cache.match(p))
        assert m.device_tokens == 0 and m.tokens == 0, kind
        assert victims[(kind, j)].exists() == (kind == "other_version"), kind
        assert cache.match(p, touch=False).tokens == 0
        # serving goes on: the engine recomputes the prompt and inserts it
        serve(cache, p)
        assert cache.match(p, touch=False).device_tokens == len(p)
        cache.check()
    n = len(prompts)
    assert cache.snapshot()["errors"] == {"corrupt_pages": n}
    assert cache.stores[DISK].counters["corrupt_removed"] == n - PER_KIND
    assert cache.stores[DISK].counters["version_skipped"] == PER_KIND
    disk_lines = warnings_from(caplog, "sgl_hicache.tiers.disk")
    reasons = {r.args[1] for r in disk_lines}
    assert len(disk_lines) == len(reasons), [r.getMessage() for r in disk_lines]  # one line per reason
    assert len(reasons) >= len(CORRUPTIONS) - 1 and len(disk_lines) < n
    cache_lines = warnings_from(caplog, "sgl_hicache.cache")
    assert len(cache_lines) == len(reasons), [
        r.getMessage() for r in cache_lines
    ]  # the transfer's line: also once per reason
    assert_served_right(cache, clean)
    cache.check()


def test_stray_files_and_directories_are_ignored_through_the_cache(tmp_path: Path) -> None:
    """Files that are not ours (any name, any place) are never deleted, never served, never counted
    against capacity; a directory squatting on a page's path at restart is a miss for that page."""
    a, b = seq(0), seq(50_000)
    persist(tmp_path, [a, b])
    root = tmp_path / "disk"
    probe = fresh(tmp_path)
    squat = page_file(probe, b, 1)
    del probe
    squat.unlink()
    squat.mkdir()
    (squat / "inside").write_bytes(b"x")
    strays = [
        root / "README",
        root / "zz" / "y.page",
        root / squat.parent.name / "notes.txt",
        root / ("ab" * 16 + ".page"),
    ]
    strays[1].parent.mkdir()
    for s in strays:
        s.write_bytes(b"not a page")
    cache = fresh(tmp_path)
    disk = cache.stores[DISK]
    assert disk.counters["stray_ignored"] >= len(strays) + 1 and disk.counters["corrupt_removed"] == 0
    assert disk.stored_pages == 2 * PAGES - 1
    assert_served_right(cache, a)
    m = cache.match(b)
    assert m.disk_tokens == PS  # page 0 only: page 1's path is a directory
    m = cache.promote(m)
    assert m.device_tokens == PS
    serve(cache, b)
    assert all(s.exists() for s in strays) and squat.is_dir()
    cache.check()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_non_file_replacing_an_adopted_page_is_a_miss(tmp_path: Path, caplog, kind: str) -> None:
    """A page file that turns into a directory (or a FIFO, which must not block the reader) after
    the cache adopted it: the read is a miss and the node's disk copy is forgotten (the thing at the
    path, not ours, is left alone); nothing raises and asking again does not retry the read."""
    a, b = seq(0), seq(50_000)
    persist(tmp_path, [a, b])
    cache = fresh(tmp_path)
    assert cache.match(a).disk_tokens == PAGES * PS
    victim = page_file(cache, a, 1)
    victim.unlink()
    victim.mkdir() if kind == "directory" else os.mkfifo(victim, 0o600)
    caplog.set_level(logging.DEBUG, logger="sgl_hicache")
    results = []

    def attempt() -> None:
        for _ in range(3):
            results.append(cache.promote(cache.match(a)).device_tokens)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "promotion blocked on a non-file page path"
    assert results == [0, 0, 0]
    assert victim.exists() and not victim.is_file()
    assert sum(cache.snapshot()["errors"].values()) == 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 2
    serve(cache, a)
    assert_served_right(cache, b)
    cache.check()


def test_obstacles_to_a_write_fail_one_page_not_the_tier(tmp_path: Path) -> None:
    """A directory where a page file must be written, or a file where a fan-out directory must be:
    that node's demotion fails (counted), the disk tier stays enabled for every other page."""
    cache = make_cache(
        tmp_path, device=4, host=4, disk=256, write_policy="write_through", disk_write_policy="write_through"
    )
    disk = cache.stores[DISK]
    blocked_dir = seq(0)
    blocked_fan = seq(70_000)
    others = [seq(100_000 + 1000 * i) for i in range(6)]
    k_dir = chain_keys(cache.namespace.root, blocked_dir, PS)[0]
    disk.page_path(k_dir).mkdir(parents=True)
    k_fan = chain_keys(cache.namespace.root, blocked_fan, PS)[0]
    fan = disk.page_path(k_fan).parent
    if not fan.exists():
        fan.write_bytes(b"a file where a fan-out directory goes")
    for p in [blocked_dir, blocked_fan, *others]:
        serve(cache, p)  # never raises
        cache.check()
    assert not disk.write_disabled
    errors = cache.snapshot()["errors"]
    assert sum(errors.values()) >= 1 and set(errors) <= {"host->disk_errors"}
    for p in others:
        keys = chain_keys(cache.namespace.root, p, PS)
        assert all(disk.contains(k) for k in keys)
