"""Crash safety of the disk tier: SIGKILL a writer at random moments, then restart and check.

A helper subprocess imports torch once and acts as a fork server (importing torch takes seconds
here, so one process per kill would not fit 50+ kills into a fast test). For each round it forks a
writer, which opens a DiskPageStore on the shared directory and writes pages in a loop, printing
`key <hex>` after each `write` returns. The test SIGKILLs the writer after a random (seeded) delay,
then opens a fresh store on the directory and checks that every printed key is present and reads
back bit-exact (page data is derived from the key), that no page fails its checksum, and that no
temp file is left.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace
from sgl_hicache.tiers.disk import DiskPageStore

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16")  # 32 KiB pages
PAGE = 16
KILLS = 60
SEED = 20240611
KEEP = 300  # pages carried across rounds (re-verified after every later crash)

_HELPER = r"""
import os, sys
import torch
torch.set_num_threads(1)
from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.disk import DiskPageStore
sys.path.insert(0, sys.argv[2])
from test_disk_crash import LAYOUT, PAGE, page_data

directory = sys.argv[1]
ns = Namespace.for_model(LAYOUT, PAGE)
out = sys.stdout.fileno()
for line in sys.stdin:
    rnd = int(line)
    pid = os.fork()
    if pid == 0:
        os.write(out, ("start %d\n" % os.getpid()).encode())
        store = DiskPageStore(LAYOUT, PAGE, 1 << 30, directory, ns)
        i = 0
        while True:
            k = page_key(ns.root, [rnd, i] + [0] * (PAGE - 2))
            i += 1
            if store.allocate([k]) is None:
                continue
            store.write([k], page_data(k).unsqueeze(0))
            os.write(out, ("key %s\n" % k.hex()).encode())
    _, status = os.waitpid(pid, 0)
    os.write(out, ("exit %d %d\n" % (pid, status)).encode())
"""


def page_data(key: bytes) -> torch.Tensor:
    """Deterministic page contents for a key (any bf16 bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    shape = (LAYOUT.num_layers, 2, PAGE, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)


class _Lines:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def next(self, deadline: float) -> str:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, "crash helper timed out"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 65536)
                assert chunk, "crash helper exited"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


class CrashHelper:
    """The fork-server helper above, on `directory`: `kill_round(rnd, delay_s)` forks a writer, lets
    it write for `delay_s`, SIGKILLs it, and returns (its pid, the keys whose write had returned)."""

    def __init__(self, directory: Path) -> None:
        tests_dir = str(Path(__file__).resolve().parent)
        repo = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HELPER, str(directory), tests_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=repo,
        )
        self.lines = _Lines(self.proc.stdout.fileno())

    def kill_round(self, rnd: int, delay_s: float, timeout_s: float = 30.0) -> tuple[int, list[bytes]]:
        self.proc.stdin.write(b"%d\n" % rnd)
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        first = self.lines.next(deadline)
        assert first.startswith("start "), first
        pid = int(first.split()[1])
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
        acked = []
        while True:
            line = self.lines.next(deadline)
            if line.startswith("key "):
                acked.append(bytes.fromhex(line[4:]))
            elif line.startswith("exit "):
                _, epid, status = line.split()
                assert int(epid) == pid
                assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL
                return pid, acked
            else:
                raise AssertionError(f"unexpected helper output {line!r}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(timeout=10)


def test_sigkill_at_random_moments_loses_nothing_acknowledged(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    directory = tmp_path / "tier"
    ns = Namespace.for_model(LAYOUT, PAGE)
    helper = CrashHelper(directory)
    expected: dict[bytes, None] = {}  # acknowledged and not yet freed, oldest first
    totals = dict(kills=0, acked=0, verified_reads=0, partial_removed=0, corrupt_removed=0, zero_ack_rounds=0)
    t0 = time.monotonic()
    try:
        for rnd in range(KILLS):
            _, acked = helper.kill_round(rnd, rng.uniform(0.0, 0.12))
            totals["kills"] += 1
            totals["acked"] += len(acked)
            totals["zero_ack_rounds"] += not acked
            for k in acked:
                expected[k] = None

            store = DiskPageStore(LAYOUT, PAGE, 1 << 30, directory, ns)  # restart
            totals["partial_removed"] += store.counters["partial_removed"]
            totals["corrupt_removed"] += store.counters["corrupt_removed"]
            assert store.counters["corrupt_removed"] == 0
            assert list(directory.rglob("*.tmp")) == []
            missing = [k.hex() for k in expected if not store.contains(k)]
            assert not missing, f"round {rnd}: acknowledged pages lost: {missing[:3]}"
            out = torch.empty(store.page_shape, dtype=torch.bfloat16)
            for k in expected:
                store.read_into(k, out)  # raises PageCorruptError on a bad checksum
                assert torch.equal(out.view(torch.int16), page_data(k).view(torch.int16)), k.hex()
                totals["verified_reads"] += 1
            assert store.verify_all() == []
            # keep the directory small: drop every unacknowledged page and the oldest acknowledged
            drop = [k for k in store.keys() if k not in expected]
            while len(expected) > KEEP:
                drop.append(next(iter(expected)))
                del expected[drop[-1]]
            store.free(drop)
    finally:
        helper.close()
    totals["seconds"] = round(time.monotonic() - t0, 1)
    print(f"\ndisk crash test: {totals}")
    assert totals["kills"] >= 50
    assert totals["acked"] > 0
