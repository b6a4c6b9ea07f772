"""Full disk and failing I/O *through the cache*: when the disk tier's directory runs out of
space or turns read-only, the disk tier stops accepting writes with one clear log line and a metric,
serving goes on from device and host (and from the pages already on disk), and writes resume after
the retry interval once the medium works again (on a fake clock).

Media tried: a real 1 MiB tmpfs filled to the last block (ENOSPC) and the same tmpfs remounted
read-only (EROFS, which root cannot bypass, unlike chmod 0500); both need `mount` (root) and are
skipped where it is not permitted. The store's fault-injection point (`_write_fd` / `_write_file`)
gives the same two errors everywhere. chmod 0500 is tried only when not running as root.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LAYOUT, kv_for, serve

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig
from sgl_hicache.hashing import Namespace, chain_keys
from sgl_hicache.tiers.base import DEVICE, DISK, HOST
from sgl_hicache.tiers.disk import DiskPageStore

PS = 4
PAGES = 4
RETRY = 30.0
DISK_LOG = "sgl_hicache.tiers.disk"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seq(i: int) -> list[int]:
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + PAGES * PS))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def build(directory: Path, clock: FakeClock) -> TieredCache:
    """Device and host hold two prompts each; every page that lands on host is written to disk."""
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=8 * PS,
        host_tokens=8 * PS,
        disk_tokens=100_000 * PS,
        page_size=PS,
        disk_dir=directory,
        disk_write_policy="write_through",
        write_policy="write_back",
        eviction_demotes="all",
        predictor="none",
    )
    store = DiskPageStore(
        SMALL_LAYOUT,
        PS,
        cfg.disk_pages,
        directory,
        Namespace.for_model(SMALL_LAYOUT, PS),
        retry_interval_s=RETRY,
        clock=clock,
    )
    return TieredCache(cfg, disk=store)


def on_disk(cache: TieredCache, prompt) -> bool:
    return all(cache.stores[DISK].contains(k) for k in chain_keys(cache.namespace.root, prompt, PS))


def served_right(cache: TieredCache, prompt, tier: str) -> None:
    """The prompt is a hit in `tier`, promotes to the device, and reads back bit-identical."""
    m = cache.match(prompt)
    assert {DEVICE: m.device_tokens, HOST: m.host_tokens, DISK: m.disk_tokens}[tier] == len(prompt), (
        tier,
        m.device_tokens,
        m.host_tokens,
        m.disk_tokens,
    )
    cache.record_request(len(prompt), m)
    m = cache.promote(m)
    assert m.device_tokens == len(prompt)
    assert torch.equal(bits(cache.stores[DEVICE].read(m.device_handles)), bits(kv_for(cache, prompt)))


def scenario(directory: Path, break_it, fix_it, caplog, expect_errno: int) -> dict:
    clock = FakeClock()
    cache = build(directory, clock)
    disk = cache.stores[DISK]
    n = 0
    for _ in range(6):  # phase 1: healthy; the oldest prompts reach disk
        serve(cache, seq(n))
        n += 1
    early = [seq(i) for i in range(2)]
    assert all(on_disk(cache, p) for p in early)

    break_it()
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="sgl_hicache")
    for _ in range(50):  # phase 2: until a write fails
        serve(cache, seq(n))
        n += 1
        cache.check()
        if disk.write_disabled:
            break
    assert disk.write_disabled, "the disk tier never noticed the failing medium"
    assert os.strerror(expect_errno) in disk._disabled_reason, disk._disabled_reason
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == DISK_LOG and "disk writes disabled" in errors[0].getMessage()
    metric = dict(cache.snapshot()["errors"])
    assert metric == {"host->disk_errors": 1}, metric  # the metric: one failed transfer, then no more tries
    write_errors = disk.counters["write_errors"]
    assert write_errors == 1
    assert not list(directory.rglob("*.tmp"))

    # phase 3: serving goes on from device, host, and the pages already on disk; no new error
    for _ in range(6):
        serve(cache, seq(n))
        n += 1
        cache.check()
    served_right(cache, seq(n - 1), DEVICE)
    served_right(cache, seq(n - 3), HOST)
    served_right(cache, early[0], DISK)
    served_right(cache, seq(n - 3), DEVICE)
    before_fix = n
    assert disk.counters["write_errors"] == write_errors and cache.snapshot()["errors"] == metric
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == errors  # still the one line
    assert disk.write_disabled

    # phase 4: the medium works again; nothing changes before the retry interval, then writes resume
    fix_it()
    serve(cache, seq(n))
    n += 1
    assert disk.write_disabled
    clock.now += RETRY + 1
    for _ in range(4):
        serve(cache, seq(n))
        n += 1
        cache.check()
    assert not disk.write_disabled
    resumed = [r for r in caplog.records if r.name == DISK_LOG and "work again" in r.getMessage()]
    assert len(resumed) == 1
    later = [seq(i) for i in range(before_fix, n) if on_disk(cache, seq(i))]
    assert later, "nothing was written after the disk tier came back"
    assert disk.counters["write_errors"] == write_errors
    assert not list(directory.rglob("*.tmp"))

    # a restart finds the pages written before the failure and after the recovery, bit-identical
    del cache
    again = build(directory, FakeClock())
    for p in [*early, *later]:
        served_right(again, p, DISK)
    again.check()
    return {"write_errors": write_errors, "errors": metric}


# ---- media ----------------------------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path: Path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True, timeout=20)
        gc.collect()  # a store the test dropped may still hold a file open on the mount
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=20).returncode != 0:
            # still busy (a writer thread's open file): detach it now, freed when the file closes;
            # never leave a mount behind under /tmp
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


def fill_up(mnt: Path) -> Path:
    """Write a ballast file until the filesystem is full to the last block."""
    ballast = mnt / "ballast"
    chunk = b"\0" * 4096
    with open(ballast, "wb", buffering=0) as f:
        try:
            for _ in range(10_000):
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        else:
            raise AssertionError("the 1 MiB tmpfs never filled up")
    return ballast


def test_full_tmpfs_disables_disk_writes_serving_goes_on_and_resumes(tmpfs: Path, caplog) -> None:
    directory = tmpfs / "tier"
    holder = {}
    scenario(
        directory, lambda: holder.setdefault("b", fill_up(tmpfs)), lambda: holder["b"].unlink(), caplog, errno.ENOSPC
    )


def test_read_only_tmpfs_disables_disk_writes_serving_goes_on_and_resumes(tmpfs: Path, caplog) -> None:
    def remount(mode: str) -> None:
        proc = subprocess.run(
            ["mount", "-o", f"remount,{mode}", str(tmpfs)], capture_output=True, text=True, timeout=20
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs {mode}: {proc.stderr.strip()}")

    scenario(tmpfs / "tier", lambda: remount("ro"), lambda: remount("rw"), caplog, errno.EROFS)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO], ids=["ENOSPC", "EROFS", "EIO"])
def test_injected_write_faults_disable_then_resume(tmp_path: Path, monkeypatch, caplog, code: int) -> None:
    """The store's fault-injection point (every page write and every probe goes through
    `_write_file`), for machines where no filesystem can be mounted."""
    real = DiskPageStore._write_file
    state = {"broken": False}

    def faulty(self, path, buffers):
        if state["broken"]:
            raise OSError(code, os.strerror(code))
        return real(self, path, buffers)

    monkeypatch.setattr(DiskPageStore, "_write_file", faulty)
    scenario(tmp_path / "tier", lambda: state.update(broken=True), lambda: state.update(broken=False), caplog, code)


def test_chmod_read_only_directory(tmp_path: Path, caplog) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; the read-only tmpfs and the injected EROFS cover this")
    directory = tmp_path / "tier"
    dirs: list[Path] = []

    def lock() -> None:
        dirs[:] = [directory, *[p for p in directory.iterdir() if p.is_dir()]]
        for d in dirs:
            d.chmod(0o500)

    def unlock() -> None:
        for d in dirs:
            d.chmod(0o700)

    try:
        scenario(directory, lock, unlock, caplog, errno.EACCES)
    finally:
        unlock()
