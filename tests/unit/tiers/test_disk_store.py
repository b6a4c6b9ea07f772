"""DiskPageStore beyond the common contract: restart, corruption, permissions, keys, full disk, threads."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import PageCorruptError, PageGoneError, TierIOError
from sgl_hicache.tiers.disk import COUNTER_NAMES, HEADER_SIZE, DiskPageStore
from sgl_hicache.tiers.memory import HostKVBuffer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 4
NS = Namespace.for_model(LAYOUT, PAGE)
OTHER_NS = Namespace.for_model(LAYOUT, PAGE, tenant_salt="another-tenant")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys_for(n: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return [page_key(ns.root, [start + i] * PAGE) for i in range(n)]


def pages(store: DiskPageStore, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *store.page_shape), generator=g).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def open_store(d: Path, capacity: int = 16, ns: Namespace = NS, **kw) -> DiskPageStore:
    return DiskPageStore(LAYOUT, PAGE, capacity, d, ns, **kw)


def filled(d: Path, n: int, capacity: int = 16, ns: Namespace = NS, start: int = 0, seed: int = 0):
    s = open_store(d, capacity, ns)
    ks = keys_for(n, start, ns)
    assert s.allocate(ks) == ks
    data = pages(s, n, seed)
    s.write(ks, data)
    return s, ks, data


def temp_files(d: Path) -> list[Path]:
    return list(d.rglob("*.tmp"))


# ----------------------------------------------------------------------------- restart
def test_restart_restores_index_and_bytes(tmp_path: Path) -> None:
    s, ks, data = filled(tmp_path, 5)
    assert s.counters["pages_written"] == 5 and s.counters["bytes_written"] == 5 * s.page_bytes
    s2 = open_store(tmp_path)
    assert s2.counters["pages_restored"] == 5
    assert sorted(s2.keys()) == sorted(ks)
    assert all(s2.contains(k) for k in ks)
    assert s2.free_pages == 11 and s2.used_pages == 5 and s2.overfull_pages == 0
    assert torch.equal(bits(s2.read(ks)), bits(data))
    assert s2.counters["pages_read"] == 5 and s2.counters["bytes_read"] == 5 * s2.page_bytes
    assert s2.verify_all() == []
    assert set(s2.counters) >= set(COUNTER_NAMES)


def test_restart_overfull_indexes_all_and_reports(tmp_path: Path) -> None:
    _, ks, data = filled(tmp_path, 5)
    s = open_store(tmp_path, capacity=3)
    assert s.stored_pages == 5 and s.overfull_pages == 2
    assert s.free_pages == 0 and s.used_pages == 3  # free + used == capacity still holds
    assert s.allocate(keys_for(1, 100)) is None
    assert torch.equal(bits(s.read(ks)), bits(data))  # every page still readable until evicted
    s.free(ks[:3])  # the cache evicts
    assert s.overfull_pages == 0 and s.free_pages == 1
    assert s.allocate(keys_for(1, 100)) is not None


def test_free_deletes_files(tmp_path: Path) -> None:
    s, ks, _ = filled(tmp_path, 3)
    s.free(ks[:2])
    assert not s.page_path(ks[0]).exists() and not s.page_path(ks[1]).exists()
    assert s.page_path(ks[2]).exists()
    assert sorted(open_store(tmp_path).keys()) == [ks[2]]


def test_allocated_but_unwritten_is_not_contained(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    (k,) = s.allocate(keys_for(1))
    assert not s.contains(k) and list(s.keys()) == []
    with pytest.raises(KeyError):
        s.read([k])
    assert open_store(tmp_path).stored_pages == 0  # reservations do not survive a restart


# ----------------------------------------------------------------------------- corruption
def _flip_payload(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[HEADER_SIZE + 17] ^= 0x40
    p.write_bytes(bytes(b))


def _flip_header_key(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[30] ^= 0x01
    p.write_bytes(bytes(b))


def _truncate(p: Path) -> None:
    b = p.read_bytes()
    p.write_bytes(b[: len(b) - 100])


def _truncate_header(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:40])


def _zero(p: Path) -> None:
    p.write_bytes(b"")


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def _trailing(p: Path) -> None:
    p.write_bytes(p.read_bytes() + b"x")


MUTATIONS = {
    "truncate": _truncate,
    "truncate_header": _truncate_header,
    "zero_length": _zero,
    "garbage": _garbage,
    "trailing_bytes": _trailing,
    "header_bitflip": _flip_header_key,
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_bad_file_removed_at_restart(tmp_path: Path, name: str) -> None:
    s, ks, data = filled(tmp_path, 3)
    victim = s.page_path(ks[1])
    MUTATIONS[name](victim)
    s.close()  # a restart: the writer is gone, so the scan's count is the directory's
    s2 = open_store(tmp_path)
    assert s2.counters["corrupt_removed"] == 1
    assert not s2.contains(ks[1]) and not victim.exists()
    assert sorted(s2.keys()) == sorted([ks[0], ks[2]])
    assert torch.equal(bits(s2.read([ks[0], ks[2]])), bits(data[[0, 2]]))
    assert s2.free_pages == 14


@pytest.mark.parametrize("name", sorted(["flip_payload", *MUTATIONS]))
def test_bad_file_at_read_raises_page_corrupt(tmp_path: Path, name: str) -> None:
    s, ks, data = filled(tmp_path, 3)
    victim = s.page_path(ks[1])
    (_flip_payload if name == "flip_payload" else MUTATIONS[name])(victim)
    with pytest.raises(PageCorruptError) as info:
        s.read(ks)
    assert info.value.key_hex == ks[1].hex() and info.value.reason
    assert ks[1].hex() in str(info.value)
    assert s.counters["corrupt_removed"] == 1
    assert not victim.exists() and not s.contains(ks[1])
    assert s.free_pages == 14  # the store released it: the cache must not free it again
    with pytest.raises(KeyError):
        s.free([ks[1]])
    with pytest.raises(KeyError):
        s.read([ks[1]])
    assert torch.equal(bits(s.read([ks[0], ks[2]])), bits(data[[0, 2]]))


def test_payload_bitflip_is_caught_lazily_and_by_verify_all(tmp_path: Path) -> None:
    s, ks, _ = filled(tmp_path, 4)
    _flip_payload(s.page_path(ks[2]))
    s2 = open_store(tmp_path)
    assert s2.stored_pages == 4 and s2.counters["corrupt_removed"] == 0  # header is fine: lazy
    assert s2.verify_all() == [ks[2]]
    assert s2.stored_pages == 3 and s2.counters["corrupt_removed"] == 1
    assert not s2.page_path(ks[2]).exists()


def test_vanished_file_is_a_gone_miss_not_corruption(tmp_path: Path) -> None:
    s, ks, _ = filled(tmp_path, 2)
    os.unlink(s.page_path(ks[0]))  # as another process's eviction would
    with pytest.raises(PageGoneError) as info:
        s.read([ks[0]])
    assert not isinstance(info.value, PageCorruptError)
    assert info.value.reason == "gone" and info.value.key_hex == ks[0].hex()
    assert s.counters["pages_gone"] == 1 and s.counters["corrupt_removed"] == 0
    assert not s.contains(ks[0])
    with pytest.raises(KeyError):
        s.free([ks[0]])  # the store forgot it: the cache must not free it again
    # deleted behind the ledger's back, so still counted, until a restart with no peer alive recounts
    assert s.free_pages == 14
    s.close()
    assert open_store(tmp_path).free_pages == 15


def test_corruption_logged_once_per_reason(tmp_path: Path, caplog) -> None:
    s, ks, _ = filled(tmp_path, 3)
    for k in ks:
        _flip_payload(s.page_path(k))
    caplog.set_level(logging.DEBUG, logger="sgl_hicache.tiers.disk")
    for k in ks:
        with pytest.raises(PageCorruptError):
            s.read([k])
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "checksum" in r.getMessage()]
    assert len(warnings) == 1
    assert s.counters["corrupt_removed"] == 3


def test_other_namespace_ignored_not_served_not_deleted(tmp_path: Path) -> None:
    _, foreign, foreign_data = filled(tmp_path, 3, ns=OTHER_NS)
    _s, ours, _ = filled(tmp_path, 2)  # same directory, another model / tenant
    s2 = open_store(tmp_path)
    assert s2.counters["foreign_ignored"] == 3 and s2.counters["corrupt_removed"] == 0
    assert sorted(s2.keys()) == sorted(ours) and s2.free_pages == 14
    for k in foreign:
        assert not s2.contains(k)
        assert s2.page_path(k).exists()
        with pytest.raises(KeyError):
            s2.read([k])
    other = open_store(tmp_path, ns=OTHER_NS)  # still there for its owner
    assert torch.equal(bits(other.read(foreign)), bits(foreign_data))


def test_foreign_page_planted_under_our_key_is_not_served(tmp_path: Path) -> None:
    s, ks, _ = filled(tmp_path, 1)
    o, oks, _ = filled(tmp_path / "o", 1, ns=OTHER_NS)
    os.replace(o.page_path(oks[0]), s.page_path(ks[0]))  # header says: other namespace
    with pytest.raises(PageCorruptError):
        s.read(ks)
    assert open_store(tmp_path).stored_pages == 0


def test_a_page_rewritten_over_a_file_whose_unlink_failed_is_counted_once(tmp_path: Path, monkeypatch) -> None:
    # alone in its directory a store renames without looking first, unless an unlink failed: that
    # file stays counted, so rewriting its page over it must not count it again
    s, ks, data = filled(tmp_path, 2)
    real_unlink = os.unlink

    def refuse(path, *a, **kw):
        raise PermissionError(errno.EACCES, "refused by the test", path)

    monkeypatch.setattr(os, "unlink", refuse)
    s.free(ks[:1])
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert s.counters["unlink_errors"] == 1 and s._ledger.files == 2 and s.page_path(ks[0]).exists()
    s.write(s.allocate(ks[:1]), data[:1])
    s.write(s.allocate(keys_for(1, 10)), pages(s, 1))
    assert s._ledger.files == 3 == len(list(tmp_path.glob("*/*.page")))
    assert torch.equal(bits(s.read(ks)), bits(data))


def test_stray_files_and_dirs_ignored(tmp_path: Path) -> None:
    s, ks, data = filled(tmp_path, 2)
    sub = s.page_path(ks[0]).parent
    strays = [tmp_path / "README.txt", sub / "notes.txt", tmp_path / "zz" / "x.page", tmp_path / ks[1].hex()]
    (tmp_path / "zz").mkdir()
    for p in strays:
        p.write_bytes(b"hello")
    (tmp_path / "somedir").mkdir()
    misplaced = tmp_path / "00" / (ks[0].hex() + ".page")  # page name under the wrong fan-out dir
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(s.page_path(ks[0]).read_bytes())
    key_dir = keys_for(1, 50)[0]
    dir_like_page = tmp_path / key_dir.hex()[:2] / (key_dir.hex() + ".page")
    dir_like_page.mkdir(parents=True)

    s2 = open_store(tmp_path)
    assert sorted(s2.keys()) == sorted(ks) and s2.counters["corrupt_removed"] == 0
    assert s2.counters["stray_ignored"] >= 6
    assert all(p.exists() for p in strays) and misplaced.exists() and dir_like_page.is_dir()
    assert torch.equal(bits(s2.read(ks)), bits(data))
    assert not s2.contains(key_dir)
    # a directory squatting on one key's path fails that write only; the tier stays enabled
    assert s2.allocate([key_dir]) == [key_dir]
    with pytest.raises(TierIOError):
        s2.write([key_dir], pages(s2, 1))
    assert not s2.write_disabled and temp_files(tmp_path) == []
    s2.free([key_dir])


def test_temp_files_left_behind_are_removed(tmp_path: Path) -> None:
    s, ks, _data = filled(tmp_path, 2)
    k = keys_for(1, 9)[0]
    sub = tmp_path / k.hex()[:2]
    sub.mkdir(exist_ok=True)
    tmp1 = sub / f".{k.hex()}.4242.0.tmp"
    tmp1.write_bytes(s.page_path(ks[0]).read_bytes()[:300])
    probe = tmp_path / ".probe.4242.3.tmp"
    probe.write_bytes(b"probe")
    s2 = open_store(tmp_path)
    assert s2.counters["partial_removed"] == 1
    assert not tmp1.exists() and not probe.exists() and temp_files(tmp_path) == []
    assert not s2.contains(k) and sorted(s2.keys()) == sorted(ks)


def test_symlinked_page_is_not_followed(tmp_path: Path) -> None:
    s, ks, _ = filled(tmp_path / "a", 1)
    target = tmp_path / "outside.page"
    target.write_bytes(s.page_path(ks[0]).read_bytes())
    os.unlink(s.page_path(ks[0]))
    os.symlink(target, s.page_path(ks[0]))
    s2 = open_store(tmp_path / "a")
    assert s2.stored_pages == 0 and target.exists()


# ----------------------------------------------------------------------------- permissions, keys
def test_permissions_owner_only(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        s, ks, _ = filled(tmp_path / "tier", 2)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "tier") == 0o700
    for k in ks:
        assert mode(s.page_path(k)) == 0o600
        assert mode(s.page_path(k).parent) == 0o700


@pytest.mark.parametrize(
    "bad",
    [b"short", b"x" * 17, b"", bytearray(16), "0123456789abcdef", 12345, None, b"x" * 32],
    ids=["short", "long", "empty", "bytearray", "str", "int", "none", "hex32"],
)
def test_key_validation(tmp_path: Path, bad) -> None:
    s, ks, _ = filled(tmp_path, 1)
    for call in (
        lambda: s.allocate([bad]),
        lambda: s.free([bad]),
        lambda: s.read([bad]),
        lambda: s.write([bad], pages(s, 1)),
        lambda: s.read_into(bad, torch.empty(s.page_shape, dtype=torch.bfloat16)),
        lambda: s.page_path(bad),
    ):
        with pytest.raises(ValueError):
            call()
    assert s.contains(ks[0]) and s.free_pages == 15


def test_key_bytes_never_escape_the_directory(tmp_path: Path) -> None:
    s = open_store(tmp_path / "tier")
    k = b"../../etc/passwd"  # 16 bytes: a valid key, harmless because names are hex
    assert len(k) == 16
    p = s.page_path(k)
    assert p.parent.parent == tmp_path / "tier" and p.name == k.hex() + ".page"
    s.allocate([k])
    s.write([k], pages(s, 1))
    assert p.exists() and s.contains(k)


def test_misuse_errors(tmp_path: Path) -> None:
    s, ks, _ = filled(tmp_path, 2)
    with pytest.raises(ValueError):  # already stored: the cache checks contains() first
        s.allocate([ks[0]])
    k = keys_for(1, 77)[0]
    with pytest.raises(ValueError):
        s.allocate([k, k])
    assert s.free_pages == 14
    with pytest.raises(KeyError):
        s.write([k], pages(s, 1))
    s.allocate([k])
    with pytest.raises(ValueError):
        s.write([k], pages(s, 1).float())
    with pytest.raises(ValueError):
        s.read_into(ks[0], torch.empty((1, *s.page_shape), dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        s.read_into(ks[0], torch.empty(s.page_shape, dtype=torch.float16))


def test_read_into_host_page_view(tmp_path: Path) -> None:
    s, ks, data = filled(tmp_path, 3)
    host = HostKVBuffer(LAYOUT, PAGE, 4, pin_memory=False)
    slots = host.allocate(ks)
    for k, slot in zip(ks, slots):
        s.read_into(k, host.page_view(slot))
    assert torch.equal(bits(host.read(slots)), bits(data))


def test_fsync_mode(tmp_path: Path) -> None:
    s = open_store(tmp_path, fsync=True)
    ks = keys_for(2)
    s.allocate(ks)
    data = pages(s, 2)
    s.write(ks, data)
    assert torch.equal(bits(open_store(tmp_path).read(ks)), bits(data))


def test_unwritable_directory_fails_clearly(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(TierIOError, match="file"):
        open_store(blocker / "tier")
    with pytest.raises(TierIOError):
        open_store(blocker)


# ----------------------------------------------------------------------------- full disk
def test_full_disk_disables_then_recovers(tmp_path: Path, monkeypatch, caplog) -> None:
    clock = FakeClock()
    s = open_store(tmp_path, retry_interval_s=30.0, clock=clock)
    ks = keys_for(3)
    assert s.allocate(ks) == ks
    s.write(ks[:1], pages(s, 1))

    real_write = s._write_fd

    def enospc(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(s, "_write_fd", enospc)
    caplog.set_level(logging.INFO, logger="sgl_hicache.tiers.disk")
    with pytest.raises(TierIOError) as info:
        s.write(ks[1:], pages(s, 2))
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert s.write_disabled and s.counters["write_errors"] == 1
    assert temp_files(tmp_path) == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "disabled" in errors[0].getMessage()

    assert s.allocate(keys_for(1, 10)) is None  # disabled
    with pytest.raises(TierIOError):  # fails fast, without touching the disk
        s.write(ks[1:2], pages(s, 1))
    assert s.counters["write_errors"] == 1
    assert s.contains(ks[0]) and s.read(ks[:1]).shape[0] == 1  # reads still served
    s.free(ks[1:])  # the reservations of the failed batch can be released

    clock.now += 31  # the probe runs, still fails: stays disabled, next probe in 30 s
    assert s.allocate(keys_for(1, 10)) is None and s.write_disabled
    monkeypatch.setattr(s, "_write_fd", real_write)  # space is back
    clock.now += 10
    assert s.allocate(keys_for(1, 10)) is None  # not yet time to probe
    clock.now += 25
    k = keys_for(1, 10)
    assert s.allocate(k) == k and not s.write_disabled
    data = pages(s, 1, 5)
    s.write(k, data)
    assert torch.equal(bits(s.read(k)), bits(data))
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    assert temp_files(tmp_path) == []


def test_replace_failure_also_disables_and_cleans_up(tmp_path: Path, monkeypatch) -> None:
    clock = FakeClock()
    s = open_store(tmp_path, retry_interval_s=5.0, clock=clock)
    ks = keys_for(1)
    s.allocate(ks)

    def erofs(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", erofs)
    with pytest.raises(TierIOError):
        s.write(ks, pages(s, 1))
    monkeypatch.undo()
    assert s.write_disabled and temp_files(tmp_path) == [] and not s.contains(ks[0])
    clock.now += 5
    assert s.try_enable_writes() and not s.write_disabled
    s.write(ks, pages(s, 1))
    assert s.contains(ks[0])


# ----------------------------------------------------------------------------- threads
def test_concurrent_reads_and_writes_bit_exact(tmp_path: Path) -> None:
    threads, per = 8, 6
    s = open_store(tmp_path, capacity=2 * threads * per)
    # half the keys are written up front and read concurrently while the other half are written
    pre = keys_for(threads * per, 0)
    s.allocate(pre)
    pre_data = pages(s, len(pre), seed=1)
    s.write(pre, pre_data)
    new = keys_for(threads * per, 10_000)
    s.allocate(new)
    new_data = pages(s, len(new), seed=2)
    barrier = threading.Barrier(threads)

    def work(t: int) -> bool:
        barrier.wait()
        mine = range(t * per, (t + 1) * per)
        ok = True
        out = torch.empty(s.page_shape, dtype=torch.bfloat16)
        for rep in range(3):
            for i in mine:
                if rep == 0:
                    s.write([new[i]], new_data[i : i + 1])
                s.read_into(pre[i], out)
                ok &= torch.equal(bits(out), bits(pre_data[i]))
                ok &= torch.equal(bits(s.read([new[i]])[0]), bits(new_data[i]))
        return ok

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(work, range(threads)))
    assert all(results)
    assert s.counters["pages_written"] == 2 * threads * per
    assert s.counters["pages_read"] == 3 * 2 * threads * per
    assert s.counters["corrupt_removed"] == 0 and temp_files(tmp_path) == []
    s2 = open_store(tmp_path, capacity=2 * threads * per)
    assert torch.equal(bits(s2.read(new)), bits(new_data)) and torch.equal(bits(s2.read(pre)), bits(pre_data))


# ----------------------------------------------------------------------------- batched writes
def test_write_from_host_pages_stores_their_bytes_in_one_ledger_section(tmp_path: Path) -> None:
    s = open_store(tmp_path, capacity=16)
    host = HostKVBuffer(s.layout, s.page_size, 8, pin_memory=False)
    slots = host.allocate([b""] * 5)
    data = pages(s, 5, seed=3)
    host.write(slots, data)
    ks = keys_for(5)
    assert s.allocate(ks) == ks
    sections = []
    real = s._ledger.locked

    def counted():
        sections.append(1)
        return real()

    s._ledger.locked = counted  # type: ignore[method-assign]
    s.write_from(ks, [host.page_view(h) for h in slots])
    assert len(sections) == 1  # the five renames and the count updates: one critical section
    assert s.stored_pages == 5 and s._ledger.files == 5 and s._ledger.reserved == 0 and s._ledger.writes == 5
    assert torch.equal(bits(s.read(ks)), bits(data)) and temp_files(tmp_path) == []
    s.free(ks[:3])  # one critical section, one count update, for the batch
    assert s._ledger.files == 2 and len(sections) == 2


def test_write_from_refuses_a_wrong_page_and_writes_nothing(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    ks = keys_for(2)
    s.allocate(ks)
    good = pages(s, 1)[0]
    for bad in (good.float(), good[..., :4], torch.zeros(3)):
        with pytest.raises(ValueError):
            s.write_from(ks, [good, bad])
    with pytest.raises(ValueError):
        s.write_from(ks, [good])
    assert s.stored_pages == 0 and s._ledger.files == 0 and temp_files(tmp_path) == []


def test_a_failure_mid_batch_keeps_the_pages_before_it(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    ks = keys_for(4)
    s.allocate(ks)
    real, calls = s._write_fd, []

    def third_fails(fd, buffers):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.EIO, "injected")
        return real(fd, buffers)

    s._write_fd = third_fails  # type: ignore[method-assign]
    data = pages(s, 4)
    with pytest.raises(TierIOError):
        s.write(ks, data)
    assert [s.contains(k) for k in ks] == [True, True, False, False]
    assert s._ledger.files == 2 and temp_files(tmp_path) == [] and s.write_disabled
    assert torch.equal(bits(s.read(ks[:2])), bits(data[:2]))
    s.free(ks)
    assert s._ledger.files == 0 and s._ledger.reserved == 0


def test_a_write_after_close_fails_cleanly(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    ks = keys_for(2)
    s.allocate(ks)
    s.close()  # the ledger refuses its critical section: the batch is not published
    with pytest.raises(TierIOError):
        s.write(ks, pages(s, 2))
    assert temp_files(tmp_path) == [] and not any(s.contains(k) for k in ks)
