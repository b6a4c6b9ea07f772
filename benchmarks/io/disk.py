"""Disk-tier bandwidth against the physical limit, side by side in one run.

    python -m benchmarks.io.disk --pages 512 --threads 8 --json out.json

Writes N pages (default layout: 8 layers x 8 KV heads x 64 dim x 16 tokens, bf16 = 256 KiB a page)
through DiskPageStore and, interleaved (A B A B ...), the same bytes as plain files on the same disk
(open / write / close: no header, no checksum, no temp file + rename). Then reads them back serially
and with a ThreadPoolExecutor of T readers, both into a preallocated buffer (`read_into` for the
store, `readinto` for the raw files). Every figure is the median of `--repeats` rounds; the ratios
are store / raw in the same run, because these machines are noisy.

Writes are reported twice: `buffered` (until write() returns: page-cache speed) and `durable`
(buffered plus an fsync of every file: what the disk takes).

Cold reads: dropping the page cache globally (`/proc/sys/vm/drop_caches`) needs root and hurts other
users of a shared machine, so by default each benchmark file is fsynced and then evicted with
posix_fadvise(POSIX_FADV_DONTNEED); `mincore` then measures how much of it is still resident, and
the JSON reports that fraction next to the cold figures (`--drop-caches` uses the global knob when
writable). A virtual disk may still be cached by the hypervisor; the JSON says so.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.disk import DiskPageStore, tensor_bytes

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' bytes in the page cache (mincore); None where it cannot be measured."""
    total = resident = 0
    try:
        for p in paths:
            size = p.stat().st_size
            if size == 0:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    n = (size + _PAGE - 1) // _PAGE
                    vec = (ctypes.c_ubyte * n)()
                    if _libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += sum(b & 1 for b in vec)
                    total += n
                finally:
                    _libc.munmap(addr, size)
            finally:
                os.close(fd)
    except (OSError, AttributeError):
        return None
    return resident / total if total else 0.0


def fsync_files(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in {p.parent for p in paths}:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(paths: list[Path], global_drop: bool) -> str:
    fsync_files(paths)
    if global_drop:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise_dontneed"


class Raw:
    """The physical limit: the same bytes as plain files, nothing else."""

    def __init__(self, directory: Path, n: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.paths = [directory / f"{i:06d}.bin" for i in range(n)]

    def write(self, data: torch.Tensor) -> None:
        for i, p in enumerate(self.paths):
            view = tensor_bytes(data[i])
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            finally:
                os.close(fd)

    def read_one(self, i: int, out: torch.Tensor) -> None:
        view = tensor_bytes(out)
        with open(self.paths[i], "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"short read of {self.paths[i]}")
                got += n


def run(args: argparse.Namespace) -> dict:
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, "bfloat16")
    ns = Namespace.for_model(layout, args.page_size)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sgl_hicache_bw_"))
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run_", dir=base))
    try:
        store = DiskPageStore(layout, args.page_size, args.pages, work / "store", ns)
        raw = Raw(work / "raw", args.pages)
        n, threads = args.pages, args.threads
        g = torch.Generator().manual_seed(0)
        data = torch.randn((n, *store.page_shape), generator=g).to(torch.bfloat16)
        buf = torch.empty_like(data)
        keys = [page_key(ns.root, [i] * args.page_size) for i in range(n)]
        total_bytes = n * store.page_bytes
        pool = ThreadPoolExecutor(threads)
        samples: dict[str, list[float]] = {}
        resident: list[float] = []
        methods: set[str] = set()

        def timed(name: str, fn) -> None:
            t = time.perf_counter()
            fn()
            samples.setdefault(name, []).append(total_bytes / (time.perf_counter() - t) / 1e9)

        def check() -> None:
            assert torch.equal(buf.view(torch.int16), data.view(torch.int16)), "read back differs"
            buf.zero_()

        def store_write() -> None:
            assert store.allocate(keys) is not None
            store.write(keys, data)

        def cold(paths: list[Path]) -> None:
            methods.add(evict(paths, args.drop_caches))
            frac = resident_fraction(paths)
            if frac is not None:
                resident.append(frac)

        store_read_serial = lambda: [store.read_into(k, buf[i]) for i, k in enumerate(keys)]  # noqa: E731
        store_read_par = lambda: list(pool.map(lambda i: store.read_into(keys[i], buf[i]), range(n)))  # noqa: E731
        raw_read_serial = lambda: [raw.read_one(i, buf[i]) for i in range(n)]  # noqa: E731
        raw_read_par = lambda: list(pool.map(lambda i: raw.read_one(i, buf[i]), range(n)))  # noqa: E731

        for _ in range(args.repeats):
            # both sides write fresh files; deleting last round's is not timed
            stored = list(store.keys())
            if stored:
                store.free(stored)
            for p in raw.paths:
                p.unlink(missing_ok=True)
            # A: the store
            t = time.perf_counter()
            store_write()
            t_buf = time.perf_counter() - t
            store_paths = [store.page_path(k) for k in keys]
            fsync_files(store_paths)
            t_dur = time.perf_counter() - t
            samples.setdefault("store_write_buffered", []).append(total_bytes / t_buf / 1e9)
            samples.setdefault("store_write_durable", []).append(total_bytes / t_dur / 1e9)
            cold(store_paths)
            timed("store_read_serial_cold", store_read_serial)
            check()
            cold(store_paths)
            timed("store_read_parallel_cold", store_read_par)
            check()
            timed("store_read_serial_warm", store_read_serial)
            check()
            timed("store_read_parallel_warm", store_read_par)
            check()
            # B: raw files, same bytes, same disk
            t = time.perf_counter()
            raw.write(data)
            t_buf = time.perf_counter() - t
            fsync_files(raw.paths)
            t_dur = time.perf_counter() - t
            samples.setdefault("raw_write_buffered", []).append(total_bytes / t_buf / 1e9)
            samples.setdefault("raw_write_durable", []).append(total_bytes / t_dur / 1e9)
            cold(raw.paths)
            timed("raw_read_serial_cold", raw_read_serial)
            check()
            cold(raw.paths)
            timed("raw_read_parallel_cold", raw_read_par)
            check()
            timed("raw_read_serial_warm", raw_read_serial)
            check()
            timed("raw_read_parallel_warm", raw_read_par)
            check()
        pool.shutdown()

        # significant figures, not decimals: a smoke run of a few tiny pages must not round to 0
        gbps = {k: float(f"{statistics.median(v):.4g}") for k, v in samples.items()}

        def ratio(a: str, b: str) -> float:
            return round(gbps[a] / gbps[b], 3) if gbps[b] else float("nan")

        ratios = {
            "store_parallel_cold / raw_parallel_cold": ratio("store_read_parallel_cold", "raw_read_parallel_cold"),
            "store_parallel_cold / raw_serial_cold": ratio("store_read_parallel_cold", "raw_read_serial_cold"),
            "store_serial_cold / raw_serial_cold": ratio("store_read_serial_cold", "raw_read_serial_cold"),
            "store_parallel_cold / store_serial_cold": ratio("store_read_parallel_cold", "store_read_serial_cold"),
            "store_parallel_warm / raw_parallel_warm": ratio("store_read_parallel_warm", "raw_read_parallel_warm"),
            "store_serial_warm / raw_serial_warm": ratio("store_read_serial_warm", "raw_read_serial_warm"),
            "store_write_buffered / raw_write_buffered": ratio("store_write_buffered", "raw_write_buffered"),
            "store_write_durable / raw_write_durable": ratio("store_write_durable", "raw_write_durable"),
        }
        return {
            "benchmark": "disk_bandwidth",
            "config": {
                "pages": n,
                "threads": threads,
                "repeats": args.repeats,
                "page_bytes": store.page_bytes,
                "total_bytes": total_bytes,
                "layout": {
                    "layers": args.layers,
                    "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim,
                    "page_size": args.page_size,
                    "dtype": "bfloat16",
                },
                "directory": str(base),
                "filesystem_device": os.stat(base).st_dev,
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
            },
            "gbps_median": gbps,
            "gbps_samples": {k: [float(f"{x:.4g}") for x in v] for k, v in samples.items()},
            "ratios": ratios,
            "cache": {
                "cold_method": sorted(methods),
                "cold_resident_fraction_median": round(statistics.median(resident), 4) if resident else None,
                "cold_reads_page_cache_warm": (statistics.median(resident) > 0.5) if resident else None,
                "warm_reads_page_cache_warm": True,
                "note": "cold = fsync + evict each file before reading (mincore checks the result); "
                "a virtual disk may still be served from the hypervisor's cache. Buffered writes measure "
                "the page cache; durable writes include an fsync of every file and its directory.",
            },
            "store_counters": dict(store.counters),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=512, help="pages per round (default 512 = 128 MiB)")
    p.add_argument("--threads", type=int, default=8, help="parallel readers")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; figures are medians")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir); use the disk under test")
    p.add_argument(
        "--drop-caches", action="store_true", help="use /proc/sys/vm/drop_caches (root; affects the whole machine)"
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("pages", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(
        json.dumps(
            {"gbps_median": result["gbps_median"], "ratios": result["ratios"], "cache": result["cache"]}, indent=2
        )
    )
    return result


if __name__ == "__main__":
    main()
