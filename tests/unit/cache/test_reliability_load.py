"""Concurrency and load: six threads serve, match, prefetch through a started transfer
engine, promote on demand, evict every tier and (one of them) attack the disk tier -- flipping bits
in page files and making writes fail with ENOSPC -- all at once on one cache, for a bounded time.

What must hold: no thread raises; every device KV read back for a locked prompt equals the KV
computed for its tokens (a corrupt page is a miss, never wrong KV); after draining, `check()` holds
(tree invariants and every allocator's used pages equal to what the tree holds), nothing is locked,
pinned, in flight, reserved or outstanding, and every prompt still in the tree comes back exact.

The existing tests/unit/transfer/test_transfer_engine.py::test_concurrent_promotions_serving_and_eviction runs a
fixed count of operations on a healthy medium; this one is bounded by time and adds explicit
evictions, check() under load, corruption and disk faults.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

from conftest import SMALL_LAYOUT, SYNCHRONOUS, assert_device_kv, serve

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig
from sgl_hicache.hashing import Namespace
from sgl_hicache.tiers.base import DEVICE, DISK, HOST, PageCorruptError
from sgl_hicache.tiers.disk import HEADER_SIZE, DiskPageStore
from sgl_hicache.transfer.engine import TransferEngine

PS = 4
SECONDS = 4.0  # the storm runs this long once every thread has made MIN_OPS operations
MIN_OPS = 50  # per thread, however slow the machine: the counts asserted below do not depend on its speed
MAX_OPS = 400  # per thread, whichever comes first
SEED = 7_000_007


def build(tmp_path: Path) -> TieredCache:
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=24 * PS,
        host_tokens=16 * PS,
        disk_tokens=48 * PS,
        page_size=PS,
        disk_dir=tmp_path / "tier",
        **{**SYNCHRONOUS, "disk_write_policy": "write_through"},
    )
    store = DiskPageStore(
        SMALL_LAYOUT, PS, cfg.disk_pages, cfg.disk_dir, Namespace.for_model(SMALL_LAYOUT, PS), retry_interval_s=0.05
    )
    return TieredCache(cfg, disk=store)


def prompts_for(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes at several depths (matches split nodes), more than device + host hold."""
    heads = [list(range(100_000 * h, 100_000 * h + PS * rng.randint(1, 3))) for h in range(4)]
    out = []
    for i in range(36):
        head = heads[i % 4] if i % 3 else []
        out.append(head + list(range(1_000 * (i + 1), 1_000 * (i + 1) + PS * rng.randint(1, 3))))
    return out


def check_under_load(cache: TieredCache) -> None:
    """`check()` with transfers in flight: `cache.check()` is exact only when none is (a prepared
    op's destination pages are allocated but not yet in the tree; the SGLang backend skips it then),
    so count those pages as the tree's here. A leaked page still fails."""
    with cache._mutex:
        cache.tree.check()
        inflight = {DEVICE: 0, HOST: 0}
        reading_disk = 0  # a read that finds a corrupt file drops it from the store at once; the tree
        # forgets it when the transfer completes, under the cache lock: allow those pages meanwhile
        for node in cache.tree.nodes():
            for tier, op in node.incoming.items():
                if tier in inflight:
                    inflight[tier] += len(op.dst_handles)
                if op.src == DISK:
                    reading_disk += len(op.src_handles)
        dev = cache.stores[DEVICE].used_pages
        assert dev == cache.tree.pages[DEVICE] + cache.outstanding_device_pages + inflight[DEVICE], (
            dev,
            cache.tree.pages[DEVICE],
            cache.outstanding_device_pages,
            inflight,
        )
        assert cache.stores[HOST].used_pages == cache.tree.pages[HOST] + inflight[HOST], (
            cache.stores[HOST].used_pages,
            cache.tree.pages[HOST],
            inflight,
        )
        assert cache.stores[DISK].used_pages + reading_disk >= cache.tree.pages[DISK]


def test_storm_of_threads_with_a_failing_disk_keeps_every_invariant(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    cache = build(tmp_path)
    disk: DiskPageStore = cache.stores[DISK]  # type: ignore[assignment]
    prompts = prompts_for(rng)
    for p in prompts[:12]:
        serve(cache, p)
    cache.check()

    counts = dict.fromkeys(
        (
            "served",
            "checked_tokens",
            "prefetch_jobs",
            "matches",
            "checks",
            "evicted",
            "flips",
            "faults",
            "enospc_raised",
            "targeted_flips",
            "targeted_detected",
        ),
        0,
    )
    count_lock = threading.Lock()

    def bump(name: str, n: int = 1) -> None:
        with count_lock:
            counts[name] += n

    # the fault switch: while set, every disk write (and probe) fails with ENOSPC
    enospc = threading.Event()
    real_write_fd = disk._write_fd

    enospc_hit = threading.Event()  # a write failed since the switch was last set

    def write_fd(fd, buffers):
        if enospc.is_set():
            bump("enospc_raised")
            enospc_hit.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_fd(fd, buffers)

    disk._write_fd = write_fd  # type: ignore[method-assign]

    engine = TransferEngine(cache, workers=3, chunk_pages=1).start()
    deadline = time.monotonic() + SECONDS
    errors: list[BaseException] = []

    def loop(body, seed: int) -> None:
        r = random.Random(seed)
        try:
            for i in range(MAX_OPS):
                if i >= MIN_OPS and time.monotonic() > deadline:
                    return
                body(r)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def server(r: random.Random) -> None:
        if r.random() < 0.7:
            p = r.choice(prompts)
        else:  # a new prompt: evicts and demotes
            start = r.randrange(10**6, 10**7)
            p = list(range(start, start + PS * r.randint(1, 3)))
        serve(cache, p)
        bump("served")
        bump("checked_tokens", assert_device_kv(cache, p))

    def prefetcher(r: random.Random) -> None:
        p = r.choice(prompts)
        target = HOST if r.random() < 0.6 else DEVICE
        job = cache.plan_promotion(cache.match(p), "prefetch", target=target)
        if job is None:
            return
        try:
            engine.submit(job)
            end = time.monotonic() + 30
            while not (engine.wait(job, timeout=1.0) and engine.links.advance(job)):
                assert time.monotonic() < end, "a prefetch job never finished"
            if target == DEVICE and not job.failed:
                bump("checked_tokens", assert_device_kv(cache, p))
        finally:
            cache.release(job)
        bump("prefetch_jobs")

    def matcher(r: random.Random) -> None:
        cache.match(r.choice(prompts), touch=r.random() < 0.5)
        bump("matches")
        if r.random() < 0.1:
            check_under_load(cache)
            bump("checks")

    def evictor(r: random.Random) -> None:
        bump("evicted", cache.evict(r.choice([DEVICE, HOST, DISK]), r.randint(1, 4)))
        time.sleep(0.001)

    def flip_bit(path: Path, r: random.Random) -> bool:
        try:
            with open(path, "r+b") as f:  # a bit flip in the payload, in place
                f.seek(HEADER_SIZE + r.randrange(disk.page_bytes))
                b = f.read(1)
                if b:
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([b[0] ^ (1 << r.randrange(8))]))
                    return True
        except OSError:
            pass  # evicted meanwhile
        return False

    def targeted_flip(r: random.Random) -> None:
        """Flip a bit in a page only the disk holds, then prefetch it: the read must find it corrupt
        (random flips may hit pages nobody reads again; this one is read for sure)."""
        with cache._mutex:  # choose, plan (locks the path: the page stays on disk) and flip as one step
            for p in r.sample(prompts, len(prompts)):
                job = cache.plan_promotion(cache.match(p), "prefetch", target=HOST)
                op = next((op for op in job.ops() if op.src == DISK), None) if job is not None else None
                if op is not None:
                    break
                if job is not None:
                    cache.release(job)
            else:
                return
            key = op.src_handles[0]
            if not flip_bit(disk.page_path(key), r):
                cache.release(job)
                return
            bump("targeted_flips")
        try:
            engine.submit(job)
            end = time.monotonic() + 60
            while not (engine.wait(job, timeout=1.0) and engine.links.advance(job)):
                assert time.monotonic() < end, "a prefetch job never finished"
            assert isinstance(op.error, PageCorruptError), f"a flipped page was read without error: {op.error!r}"
            assert not disk.contains(key), "the corrupt page is still in the store"
            bump("targeted_detected")
        finally:
            cache.release(job)

    def chaos(r: random.Random) -> None:
        if r.random() < 0.15:
            if not enospc.is_set():
                enospc_hit.clear()
                enospc.set()
                bump("faults")
            elif enospc_hit.is_set():  # off again only once a write has met it
                enospc.clear()
        if counts["targeted_flips"] == 0 or (counts["targeted_flips"] < 3 and r.random() < 0.05):
            targeted_flip(r)
        keys = list(disk.keys())
        if keys and r.random() < 0.3:
            if flip_bit(disk.page_path(r.choice(keys)), r):
                bump("flips")
        time.sleep(0.005)

    roles = [server, server, prefetcher, matcher, evictor, chaos]
    threads = [
        threading.Thread(target=loop, args=(role, SEED + i), name=f"storm-{role.__name__}-{i}")
        for i, role in enumerate(roles)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 300)
        assert not t.is_alive(), f"{t.name} hung"
    engine.stop()
    enospc.clear()
    disk._write_fd = real_write_fd  # type: ignore[method-assign]
    assert not errors, repr(errors[0])

    # drained: accounting exact, nothing held anywhere
    cache.check()
    for node in cache.tree.nodes():
        assert node.lock_ref == 0 and node.pins == 0 and not node.incoming, node
    assert cache.outstanding_device_pages == 0
    assert disk._n_reserved == 0 and disk.used_pages == len(list(disk.keys()))
    assert not list((tmp_path / "tier").rglob("*.tmp"))
    for tier in (DEVICE, HOST):
        assert cache.stores[tier].used_pages == cache.tree.pages[tier]
    assert counts["served"] > 10 and counts["prefetch_jobs"] > 0 and counts["matches"] > 0 and counts["checks"] > 0
    assert counts["checked_tokens"] > 0

    # the injected faults happened, and the cache's error counters saw them
    err_counts = cache.snapshot()["errors"]
    assert counts["faults"] > 0 and counts["enospc_raised"] > 0, str(counts)
    # every failed page write is counted by the store and reported by the cache as a failed transfer
    # (the rest of the ENOSPCs hit the store's probe writes while writes were disabled)
    disk_write_errors = sum(n for name, n in err_counts.items() if name.endswith("->disk_errors"))
    assert 0 < disk.counters["write_errors"] <= counts["enospc_raised"], (disk.counters["write_errors"], counts)
    assert disk_write_errors == disk.counters["write_errors"], (err_counts, disk.counters["write_errors"])
    assert counts["flips"] > 0 and counts["targeted_flips"] > 0, str(counts)
    assert counts["targeted_detected"] == counts["targeted_flips"], counts
    # each page the store dropped as corrupt was a failed read the cache counted
    assert err_counts.get("corrupt_pages", 0) == disk.counters["corrupt_removed"] >= counts["targeted_detected"], (
        err_counts,
        disk.counters,
    )
    corrupt_in_storm = disk.counters["corrupt_removed"]

    # every prompt still in the tree comes back bit-identical (corrupt pages are misses, recomputed)
    for p in prompts:
        serve(cache, p)
        assert assert_device_kv(cache, p) == len(p) - len(p) % PS
    cache.check()
    snap = cache.snapshot()
    assert snap["errors"]["corrupt_pages"] == disk.counters["corrupt_removed"] >= corrupt_in_storm
    print(
        f"\nstorm: {counts}, errors {dict(snap['errors'])}, corrupt_removed {disk.counters['corrupt_removed']}, write_errors {disk.counters['write_errors']}"
    )
