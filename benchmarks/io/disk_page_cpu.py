"""CPU a small page costs in the disk tier's per-page file protocol, through the real byte movers.

    python -m benchmarks.io.disk_page_cpu --pages 20000 --repeats 3 --json disk_page_cpu.json

Pages of the embedded replay's storage layout (1 layer x 1 KV head x 8 dim x 256 tokens, bf16 = 8 KiB:
`EngineConfig.storage_layout`), so the figure is the per-page overhead (header, checksum, temp file,
`writev`, rename, the shared ledger), not bandwidth (`benchmarks/io/disk.py` measures that). A store in a
fresh directory (default under `/dev/shm`, as a replay's throw-away tier) receives N pages in batches
of `--batch` through the cache's own host -> disk handler (`default_handlers`), reads them back through
the disk -> host handler, then frees them. Per phase: CPU microseconds a page (user + sys of this
process, `os.times`), median over `--repeats` rounds, each round in a new directory. Compare two
checkouts by running this file with each on PYTHONPATH, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import DISK, HOST
from sgl_hicache.tiers.disk import DiskPageStore
from sgl_hicache.tiers.memory import HostKVBuffer
from sgl_hicache.transfer.handlers import default_handlers

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16")
PAGE = 256


def _cpu() -> float:
    return time.process_time()  # user + sys of this process


def one_round(directory: Path, pages: int, batch: int) -> dict[str, float]:
    """CPU microseconds a page for writes, reads and frees of `pages` pages in `directory`."""
    ns = Namespace.for_model(LAYOUT, PAGE)
    store = DiskPageStore(LAYOUT, PAGE, pages, directory, ns)
    host = HostKVBuffer(LAYOUT, PAGE, batch, pin_memory=False)
    slots = host.allocate([b""] * batch)
    host.buffer.view(-1)[:] = 1  # non-zero bytes to checksum
    handlers = default_handlers({HOST: host, DISK: store})
    to_disk, to_host = handlers[(HOST, DISK)], handlers[(DISK, HOST)]
    keys = [page_key(ns.root, [i] * PAGE) for i in range(pages)]
    batches = [keys[i : i + batch] for i in range(0, pages, batch)]
    try:
        t0 = _cpu()
        for ks in batches:
            handles = store.allocate(ks)
            to_disk(SimpleNamespace(src=HOST, dst=DISK, src_handles=slots[: len(ks)], dst_handles=handles), 0, len(ks))
        t1 = _cpu()
        for ks in batches:
            to_host(SimpleNamespace(src=DISK, dst=HOST, src_handles=ks, dst_handles=slots[: len(ks)]), 0, len(ks))
        t2 = _cpu()
        for ks in batches:
            store.free(ks)
        t3 = _cpu()
        assert store.counters["pages_written"] == pages and store.counters["pages_read"] == pages
    finally:
        store.close()
    return {"write_us": 1e6 * (t1 - t0) / pages, "read_us": 1e6 * (t2 - t1) / pages, "free_us": 1e6 * (t3 - t2) / pages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=20000)
    ap.add_argument(
        "--batch", type=int, default=32, help="pages a transfer op moves (the replay's host -> disk ops average ~31)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where the store's directories go (default /dev/shm, else the temp dir)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.pages < 1 or args.batch < 1 or args.repeats < 1:
        ap.error("--pages, --batch and --repeats must be >= 1")
    parent = args.dir or (Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None)
    rounds = []
    for _ in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="disk-page-cpu-", dir=parent))
        try:
            rounds.append(one_round(work / "tier", args.pages, args.batch))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "benchmark": "disk_page_cpu",
        "config": {
            "pages": args.pages,
            "batch": args.batch,
            "repeats": args.repeats,
            "page_bytes": PAGE * LAYOUT.bytes_per_token,
            "dir": str(parent) if parent else tempfile.gettempdir(),
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "rounds": rounds,
        "median_us_per_page": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["median_us_per_page"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
