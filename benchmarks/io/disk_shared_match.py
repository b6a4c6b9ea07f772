"""What sharing one disk directory between processes costs a match: the existence check of pages
past the tree, against a lone server (which skips it) and a cache without a disk tier.

    .venv/bin/python -m benchmarks.io.disk_shared_match --json disk_shared_match.json          # ~30 s here
    .venv/bin/python -m benchmarks.io.disk_shared_match --quick --json disk_shared_match.json  # seconds

Workload: the prompts of the first `--requests` lines of the Mooncake conversation trace (512-token
blocks scaled to `--scale` tokens, page size 16). Each cache holds, on its device tier, the first
half of every prompt's pages; then every prompt is matched (`TieredCache.match`, as a scheduler
calls it), so most matches end before the prompt does and the rest is looked for on disk. The held
halves are written through to host and disk, so a match ends on a node that is on disk: the
worst case, where every match past the tree looks for the next page's file (a match ending on a
node that is not on disk looks for nothing: a disk node must hang under a disk node).

Sides, each its own cache and directory, rounds interleaved in rotated order, medians:
- `no_disk`: no disk tier (the match walks the tree only; host tier as in the others);
- `lone`: a disk tier in a directory no other process has written to since the cache opened: the
  store's gate (`DiskPageStore.peers_wrote`) is closed, the match looks at no file. The gate's own
  cost (one read of the shared ledger's write count) is timed apart: it is all that sharing adds to
  a lone server's match (`lone_gate_us_per_match`); `lone_over_no_disk` is what a disk tier costs a
  match at all, sharing or not;
- `shared`: the same, after another owner (a second store on the directory, as another process
  would be) wrote one page: the gate is open, and each match past the tree costs one `open()` of
  the next page's path (ENOENT here: nobody wrote those pages) plus hashing that page's key.
CPU time is `time.thread_time()` of the loop; `--dir` sets where the directories go (default: a
temporary directory on the disk; `/dev/shm` for tmpfs).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib.trees import add_trace_args
from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.hashing import page_key
from sgl_hicache.replay import load_trace
from sgl_hicache.tiers.base import DEVICE, DISK
from sgl_hicache.tiers.disk import DiskPageStore

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)
SIDES = ("no_disk", "lone", "shared")


def build(side: str, prompts: list[list[int]], page_size: int, root: Path) -> tuple[TieredCache, DiskPageStore | None]:
    pages = sum(len(p) // page_size for p in prompts)
    disk_dir = root / side
    with_disk = side != "no_disk"
    cfg = CacheConfig(
        TINY,
        device_tokens=(pages + 1) * page_size,
        host_tokens=(pages + 1) * page_size,
        page_size=page_size,
        disk_tokens=(pages + 1) * page_size if with_disk else 0,
        disk_dir=disk_dir if with_disk else None,
        write_policy="write_through",
        disk_write_policy="write_through",
    )
    cache = TieredCache(cfg)
    for p in prompts:  # the tree holds the first half of every prompt
        half = (len(p) // page_size // 2) * page_size
        if half == 0:
            continue
        m = cache.match(p[:half], touch=False)
        fresh = cache.allocate_device(half // page_size - len(m.device_handles))
        r = cache.insert(p[:half], m.device_handles + fresh)
        cache.free_device(r.duplicates)
    peer = None
    if side == "shared":  # another owner writes one page: the gate opens
        peer = DiskPageStore(TINY, page_size, cache.stores[DISK].capacity_pages, disk_dir, cache.namespace)
        k = page_key(cache.namespace.root, [-1] * page_size)
        assert peer.allocate([k]) == [k]
        peer.write([k], torch.zeros((1, *peer.page_shape), dtype=peer.dtype))
    disk = cache.stores.get(DISK)
    assert (side == "shared") == bool(disk is not None and disk.peers_wrote), side
    assert cache.snapshot()["evicted_tokens"][DEVICE] == 0
    return cache, peer


def probes(cache: TieredCache, prompts: list[list[int]]) -> int:
    """How many page files the matches of one round look for (counted outside the timed loop)."""
    disk = cache.stores.get(DISK)
    if disk is None or not disk.peers_wrote:
        return 0
    calls = 0
    real = disk.discover

    def counting(key: bytes) -> bool:
        nonlocal calls
        calls += 1
        return real(key)

    disk.discover = counting  # type: ignore[method-assign]
    try:
        for p in prompts:
            cache.match(p)
    finally:
        del disk.discover
    return calls


def timed(cache: TieredCache, prompts: list[list[int]]) -> float:
    gc.collect()
    t0 = time.thread_time()
    for p in prompts:
        cache.match(p)
    return time.thread_time() - t0


def gate_cost(store: DiskPageStore, calls: int = 100_000) -> float:
    """Seconds per read of the gate (`peers_wrote`): all that sharing adds to a lone server's match."""
    t0 = time.thread_time()
    for _ in range(calls):
        store.peers_wrote  # noqa: B018
    return (time.thread_time() - t0) / calls


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(ap, repeats=9)
    ap.add_argument(
        "--dir", type=Path, default=None, help="where the disk directories go (default: a temporary directory)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 50, 2
    prompts = [list(r.input_ids) for r in load_trace(args.trace, limit=args.requests, scale=args.scale)]
    root = Path(tempfile.mkdtemp(prefix="sglh-shared-bench-", dir=args.dir))
    t_start = time.perf_counter()
    try:
        built = {side: build(side, prompts, args.page_size, root) for side in SIDES}
        caches = {side: c for side, (c, _) in built.items()}
        looked = {side: probes(caches[side], prompts) for side in SIDES}
        past_tree = sum(
            1
            for p in prompts
            if caches["lone"].match(p, touch=False).tokens < (len(p) // args.page_size) * args.page_size
        )
        samples: dict[str, list[float]] = {s: [] for s in SIDES}
        gate: list[float] = []
        for rnd in range(args.repeats):
            order = SIDES[rnd % len(SIDES) :] + SIDES[: rnd % len(SIDES)]
            for side in order:
                samples[side].append(timed(caches[side], prompts))
            gate.append(gate_cost(caches["lone"].stores[DISK], 10_000 if args.quick else 100_000))  # type: ignore[arg-type]
        disk_fs = str(root)
        for _, peer in built.values():
            if peer is not None:
                peer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = len(prompts)
    us = {side: round(statistics.median(samples[side]) / n * 1e6, 3) for side in SIDES}
    out = {
        "benchmark": "disk_shared_match",
        "config": {
            "trace": str(args.trace),
            "requests": n,
            "prompt_tokens": sum(map(len, prompts)),
            "scale": args.scale,
            "page_size": args.page_size,
            "repeats": args.repeats,
            "quick": args.quick,
            "dir": disk_fs,
        },
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "matches_past_tree": past_tree,
        "files_looked_for_per_round": looked,
        "us_per_match": us,
        "ratio": {
            "lone_over_no_disk": round(us["lone"] / us["no_disk"], 3),
            "shared_over_lone": round(us["shared"] / us["lone"], 3),
        },
        "lone_gate_us_per_match": round(statistics.median(gate) * 1e6, 3),
        "lone_gate_share_of_match": round(statistics.median(gate) * 1e6 / us["lone"], 4),
        "added_us_per_match_shared_over_lone": round(us["shared"] - us["lone"], 3),
        "added_us_per_file_looked_for": round((us["shared"] - us["lone"]) * n / max(1, looked["shared"]), 3),
        "samples_cpu_s": {side: [round(s, 5) for s in samples[side]] for side in SIDES},
        "note": "CPU time (thread_time) per TieredCache.match; the tree holds half of every prompt; nobody wrote the pages looked for",
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(
        json.dumps(
            {
                k: out[k]
                for k in (
                    "matches_past_tree",
                    "files_looked_for_per_round",
                    "us_per_match",
                    "ratio",
                    "lone_gate_us_per_match",
                    "added_us_per_match_shared_over_lone",
                    "added_us_per_file_looked_for",
                    "wall_s",
                )
            },
            indent=2,
        )
    )
    return out


if __name__ == "__main__":
    main()
