"""One disk directory shared by several processes at once (tiers/disk/ledger.py, DiskPageStore).

In-process tests open two stores on one directory (two owners, exactly as two processes would be:
each has its own owner lock and ledger slot). The multi-process tests run real OS processes
(multiprocessing, from a fork server) on real files: three caches writing, reading and evicting at once, and a
writer SIGKILLed mid-write again and again while another process keeps serving.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_device_kv, make_cache, serve
from test_disk_crash import LAYOUT, PAGE, CrashHelper, page_data

from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import DISK, PageCorruptError, PageGoneError
from sgl_hicache.tiers.disk import DiskPageStore
from sgl_hicache.tiers.disk.ledger import SHARED_DIR

NS = Namespace.for_model(LAYOUT, PAGE)


def key(i: int, ns: Namespace = NS) -> bytes:
    return page_key(ns.root, [i] * PAGE)


def open_store(d: Path, capacity: int = 64) -> DiskPageStore:
    return DiskPageStore(LAYOUT, PAGE, capacity, d, NS)


def put(store: DiskPageStore, keys: list[bytes]) -> None:
    assert store.allocate(keys) == keys
    store.write(keys, torch.stack([page_data(k) for k in keys]))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def page_files(d: Path) -> list[Path]:
    return list(d.glob("??/*.page"))


# ----------------------------------------------------------------------------- in-process
def test_live_owner_temp_files_are_kept_dead_owner_ones_removed(tmp_path: Path) -> None:
    a = open_store(tmp_path)
    k = key(1)
    sub = tmp_path / k.hex()[:2]
    sub.mkdir()
    tmp = sub / f".{k.hex()}.{a.owner}.0.tmp"  # a write of a's in flight
    tmp.write_bytes(b"half a page")
    probe = tmp_path / f".probe.{a.owner}.1.tmp"
    probe.write_bytes(b"probe")
    b = open_store(tmp_path)
    assert tmp.exists() and probe.exists()
    assert b.counters["peer_temp_kept"] == 1 and b.counters["partial_removed"] == 0
    a.close()  # a's owner is gone now: nobody will rename its temp file
    c = open_store(tmp_path)
    assert not tmp.exists() and not probe.exists()
    assert c.counters["partial_removed"] == 1
    assert not (tmp_path / SHARED_DIR / "owners" / f"{a.owner}.lock").exists()


def test_capacity_is_one_for_the_directory(tmp_path: Path) -> None:
    a, b = open_store(tmp_path, 10), open_store(tmp_path, 10)
    put(a, [key(i) for i in range(6)])
    assert b.free_pages == 4 and a.free_pages == 4
    assert b.allocate([key(100 + i) for i in range(5)]) is None  # all or nothing
    got = b.allocate([key(100 + i) for i in range(4)])
    assert got is not None and a.free_pages == 0  # b's reservations count for a too
    assert a.allocate([key(50)]) is None
    a.free([key(0), key(1)])
    assert b.free_pages == 2
    b.free(got)
    b.close()
    assert a.free_pages == 6  # b's slot (and any reservation) went with it


def test_a_peer_page_is_discovered_and_read_bit_exact(tmp_path: Path) -> None:
    a, b = open_store(tmp_path), open_store(tmp_path)
    # nobody else has written: a lone store never looks at files its index does not know
    planted = key(7)
    sub = tmp_path / planted.hex()[:2]
    sub.mkdir(exist_ok=True)
    assert not b.peers_wrote and not b.discover(planted)
    ks = [key(i) for i in range(3)]
    put(a, ks)
    assert not a.peers_wrote  # its own writes do not open the gate
    assert b.peers_wrote and not b.contains(ks[0])
    assert all(b.discover(k) for k in ks) and b.counters["pages_discovered"] == 3
    assert same(b.read(ks), torch.stack([page_data(k) for k in ks]))
    assert not b.discover(key(99))  # absent: a miss, nothing counted
    assert b.counters["corrupt_removed"] == 0 and b.stored_pages == 3


def test_a_page_a_peer_evicts_is_a_gone_miss_never_corrupt(tmp_path: Path) -> None:
    a, b = open_store(tmp_path), open_store(tmp_path)
    ks = [key(i) for i in range(2)]
    put(a, ks)
    assert all(b.discover(k) for k in ks)
    a.free([ks[0]])  # a's eviction
    with pytest.raises(PageGoneError) as info:
        b.read([ks[0]])
    assert not isinstance(info.value, PageCorruptError)
    assert b.counters["pages_gone"] == 1 and b.counters["corrupt_removed"] == 0 and not b.contains(ks[0])
    assert a.free_pages == 63  # counted once, by the process that deleted it
    b.free([ks[1]])  # b evicts a page a wrote: a's read is a miss the same way
    with pytest.raises(PageGoneError):
        a.read([ks[1]])
    assert a.free_pages == b.free_pages == 64 and page_files(tmp_path) == []


def test_two_writers_of_one_page_count_it_once(tmp_path: Path) -> None:
    a, b = open_store(tmp_path), open_store(tmp_path)
    k = key(5)
    assert a.allocate([k]) and b.allocate([k])  # both computed the same prefix
    a.write([k], page_data(k)[None])
    b.write([k], page_data(k)[None])
    assert len(page_files(tmp_path)) == 1 and a.free_pages == 63
    assert same(a.read([k])[0], page_data(k)) and same(b.read([k])[0], page_data(k))
    a.free([k])
    assert b.free_pages == 64


def test_a_freed_reservation_raced_by_its_write_leaves_nothing(tmp_path: Path) -> None:
    a = open_store(tmp_path)
    k = key(3)
    a.allocate([k])
    real = a._write_file

    def write_then_free(path, buffers):  # the cache frees the key while the write is in flight
        real(path, buffers)
        a.free([k])

    a._write_file = write_then_free  # type: ignore[method-assign]
    a.write([k], page_data(k)[None])
    assert page_files(tmp_path) == [] and list(tmp_path.rglob("*.tmp")) == [] and a.free_pages == 64


def _a_served(tmp_path: Path):
    """Caches a and b on one directory (write-through to disk); a has served six 4-page prompts."""
    kw = dict(device=4, host=4, disk=64, write_policy="write_through", disk_write_policy="write_through")
    a, b = make_cache(tmp_path, **kw), make_cache(tmp_path, **kw)
    prompts = [list(range(1000 * i, 1000 * i + 16)) for i in range(6)]
    for p in prompts:
        serve(a, p)
    return a, b, prompts


def test_two_caches_serve_each_others_pages(tmp_path: Path) -> None:
    _, b, prompts = _a_served(tmp_path)
    for p in prompts:  # b never computed them: every token it reuses comes from a's files
        m = b.match(p)
        assert m.disk_tokens == 16, p[:1]
        serve(b, p)
        assert assert_device_kv(b, p) == 16
        b.check()
    assert b.stores[DISK].counters["pages_discovered"] == 24
    assert b.snapshot()["errors"].get("corrupt_pages", 0) == 0


def test_a_cache_whose_disk_pages_a_peer_evicted_recomputes(tmp_path: Path) -> None:
    a, b, prompts = _a_served(tmp_path)
    m = b.match(prompts[0])
    assert m.disk_tokens == 16
    a.evict(DISK, 64)  # a evicts every page b has just adopted
    got = b.promote(m)
    assert got.device_tokens == 0  # a miss ...
    errors = b.snapshot()["errors"]
    assert errors.get("vanished_pages") == 1 and errors.get("corrupt_pages", 0) == 0  # ... not corruption
    serve(b, prompts[0])  # recomputed, inserted, written again
    assert assert_device_kv(b, prompts[0]) == 16
    b.check()
    a.check()


# ----------------------------------------------------------------------------- real processes
def _processes() -> mp.context.BaseContext:
    """Worker processes forked from one fork server that imported torch once (a spawn per worker
    costs a torch import each: seconds on this machine); clean, unlike a fork of the test process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sgl_hicache.cache", "sgl_hicache.tiers.disk"])
    return ctx


WORKERS = 3
PROMPTS = 24  # per worker and phase
PROMPT_PAGES = 4
DISK_PAGES = 160  # below what the workers write together (3 x 48 prompts x 4 pages): evictions happen


def _prompt(worker: int, phase: int, i: int) -> list[int]:
    base = 1_000_000 * (worker + 1) + 100_000 * phase + 1000 * i
    return list(range(base, base + PROMPT_PAGES * 4))


def _cache_worker(worker: int, directory: str, barrier, results) -> None:
    """One process: write its first slice, then read the others' slices while writing a second
    slice of its own, all under a disk capacity smaller than the total (so everyone evicts)."""
    torch.set_num_threads(1)
    cache = make_cache(
        Path(directory),
        device=8,
        host=8,
        disk=DISK_PAGES,
        write_policy="write_through",
        disk_write_policy="write_through",
    )
    store = cache.stores[DISK]
    # per key: when its latest acknowledged write started, when its latest free ended (CLOCK_MONOTONIC
    # is one clock for every process of the machine)
    acked: dict[bytes, float] = {}
    deleted: dict[bytes, float] = {}
    write, write_from, free = store.write, store.write_from, store.free

    def logged(real):  # `write` and `write_from` (host -> disk writes from the host's page views)
        def logged_write(handles, data):
            t = time.monotonic()
            real(handles, data)
            acked.update(dict.fromkeys(handles, t))

        return logged_write

    def logged_free(handles):
        free(handles)
        deleted.update(dict.fromkeys(handles, time.monotonic()))

    store.write, store.write_from, store.free = logged(write), logged(write_from), logged_free  # type: ignore[method-assign]
    out = dict(peer_prompts_hit=0, peer_tokens_hit=0, peer_prompts_tried=0, verified_tokens=0)
    for i in range(PROMPTS):
        serve(cache, _prompt(worker, 0, i))
    barrier.wait(timeout=120)
    rng = random.Random(worker)
    others = [(w, i) for w in range(WORKERS) if w != worker for i in range(PROMPTS)]
    rng.shuffle(others)
    for j, (w, i) in enumerate(others):
        p = _prompt(w, 0, i)
        m, _ = serve(cache, p)  # first sight of a peer's prompt: any hit is a peer's page file
        out["peer_prompts_tried"] += 1
        if m.disk_tokens:
            out["peer_prompts_hit"] += 1
            out["peer_tokens_hit"] += m.disk_tokens
        out["verified_tokens"] += assert_device_kv(cache, p)
        serve(cache, _prompt(worker, 1, j % PROMPTS))  # keep writing (and evicting) meanwhile
        cache.check()
    barrier.wait(timeout=120)  # every process ran its whole read phase while the others were alive
    snap = cache.snapshot()
    out.update(
        corrupt_pages=snap["errors"].get("corrupt_pages", 0),
        vanished_pages=snap["errors"].get("vanished_pages", 0),
        write_errors=store.counters["write_errors"],
        corrupt_removed=store.counters["corrupt_removed"],
        pages_discovered=store.counters["pages_discovered"],
        pages_gone=store.counters["pages_gone"],
        pages_written=store.counters["pages_written"],
        evicted_disk=snap["evicted_tokens"].get(DISK, 0) // 4,
        acked=acked,
        deleted=deleted,
    )
    store.close()
    results.put((worker, out))


def _count_under_lock(directory: Path, ledger: Path) -> tuple[int, int] | None:
    """(page files, the ledger's count) taken under the ledger's lock: every rename into and unlink
    of a page path happens under it, so the two must be equal. None while the first process has
    created the file but not sized it yet (it sizes it before taking the lock)."""
    fd = os.open(ledger, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            files = len(page_files(directory))
            head = os.pread(fd, 8, 16)
            if len(head) < 8:
                return None
            (counted,) = struct.unpack("<q", head)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return files, counted


def test_processes_write_read_and_evict_one_directory_at_once(tmp_path: Path) -> None:
    ctx = _processes()
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_cache_worker, args=(w, str(tmp_path), barrier, results)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    disk = tmp_path / "disk"
    ns = make_cache(None).namespace  # the workers' namespace (same layout and page size)
    ledger = disk / SHARED_DIR / f"{ns.root.hex()}.ledger"
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            if ledger.exists() and (sample := _count_under_lock(disk, ledger)) is not None:
                samples.append(sample)
            time.sleep(0.01)

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    got: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 300
        while len(got) < WORKERS:
            w, out = results.get(timeout=max(1, deadline - time.monotonic()))
            got[w] = out
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        stop.set()
        watcher.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
    totals = {k: sum(o[k] for o in got.values()) for k in got[0] if not isinstance(got[0][k], dict)}
    acked: dict[bytes, float] = {}
    deleted: dict[bytes, float] = {}
    for o in got.values():
        for k, t in o["acked"].items():
            acked[k] = max(t, acked.get(k, t))
        for k, t in o["deleted"].items():
            deleted[k] = max(t, deleted.get(k, t))
    # a page must be there unless some process deleted it after its latest write began
    must_survive = [k for k, t in acked.items() if deleted.get(k, float("-inf")) < t]
    print(
        f"\nshared disk, {WORKERS} processes: {totals}; pages acked {len(acked)}, deleted {len(deleted)}, "
        f"acked with no later delete {len(must_survive)}, samples {len(samples)}, max files {max(f for f, _ in samples)}"
    )
    for w, o in got.items():  # each found the others' pages while they ran
        assert o["peer_prompts_hit"] > 0 and o["pages_discovered"] > 0, (w, o)
    assert totals["corrupt_pages"] == 0 and totals["corrupt_removed"] == 0 and totals["write_errors"] == 0
    assert totals["evicted_disk"] > 0  # capacity was tight: pages were evicted under readers
    assert samples and max(f for f, _ in samples) <= DISK_PAGES  # within capacity at every sample
    assert all(f == c for f, c in samples), [s for s in samples if s[0] != s[1]][:3]  # exact accounting
    after = DiskPageStore(make_cache(None).config.layout, 4, DISK_PAGES, disk, ns)  # a restart, alone
    assert must_survive  # the check below checks something
    lost = [k.hex() for k in must_survive if not after.contains(k)]
    assert not lost, f"{len(lost)} acknowledged pages that nobody deleted since are missing: {lost[:3]}"
    assert after.verify_all() == [] and after.counters["corrupt_removed"] == 0
    assert after.stored_pages <= DISK_PAGES and after.free_pages == DISK_PAGES - after.stored_pages
    assert list(disk.rglob("*.tmp")) == []


SERVER_CAPACITY = 1 << 20


def _serving_worker(directory: str, stop, ready, results) -> None:
    """Keeps writing and reading its own pages (bit-exact) until told to stop."""
    torch.set_num_threads(1)
    store = DiskPageStore(LAYOUT, PAGE, SERVER_CAPACITY, directory, NS)
    out = dict(written=0, read=0, bad_reads=0, write_failures=0, disabled=0)
    mine: list[bytes] = []
    i = 0
    ready.set()
    rng = random.Random(1)
    while not stop.is_set():
        k = page_key(NS.root, [-1, i] + [0] * (PAGE - 2))
        i += 1
        if store.allocate([k]) is None:
            out["write_failures"] += 1
            continue
        try:
            store.write([k], page_data(k)[None])
            out["written"] += 1
            mine.append(k)
        except OSError:
            out["write_failures"] += 1
            store.free([k])
        out["disabled"] += store.write_disabled
        for r in rng.sample(mine, min(3, len(mine))):
            if same(store.read([r])[0], page_data(r)):
                out["read"] += 1
            else:
                out["bad_reads"] += 1
        if len(mine) > 200:
            store.free(mine[:100])
            del mine[:100]
    out.update(
        corrupt_removed=store.counters["corrupt_removed"],
        write_errors=store.counters["write_errors"],
        owner=store.owner,
    )
    store.close()
    results.put(out)


KILLS = 12


def test_sigkill_a_writer_while_another_process_serves(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    directory = tmp_path / "tier"
    ctx = _processes()
    stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=_serving_worker, args=(str(directory), stop, ready, results))
    server.start()
    helper = CrashHelper(directory)
    expected: dict[bytes, None] = {}
    totals = dict(kills=0, acked=0, dead_temps_removed=0, live_temps_kept=0, verified=0)
    try:
        assert ready.wait(timeout=120), "the serving process did not start"
        for rnd in range(KILLS):
            pid, acked = helper.kill_round(rnd, rng.uniform(0.02, 0.15), timeout_s=60)
            totals["kills"] += 1
            totals["acked"] += len(acked)
            expected.update(dict.fromkeys(acked))
            assert server.is_alive(), "the serving process died"
            store = DiskPageStore(LAYOUT, PAGE, 1 << 30, directory, NS)  # the killed writer restarts
            totals["dead_temps_removed"] += store.counters["partial_removed"]
            totals["live_temps_kept"] += store.counters["peer_temp_kept"]
            assert store.counters["corrupt_removed"] == 0
            dead = [p for p in directory.rglob("*.tmp") if f".{pid}-" in p.name]
            assert dead == [], f"temp files of the killed writer survived its restart: {dead[:2]}"
            missing = [k.hex() for k in expected if not store.contains(k)]
            assert not missing, f"round {rnd}: acknowledged pages lost: {missing[:3]}"
            for k in expected:
                assert same(store.read([k])[0], page_data(k))
                totals["verified"] += 1
            drop = list(expected)[: max(0, len(expected) - 200)]
            for k in drop:
                del expected[k]
            store.free(drop)
            store.close()
        stop.set()
        out = results.get(timeout=60)
        server.join(timeout=60)
        assert server.exitcode == 0
    finally:
        stop.set()
        helper.close()
        if server.is_alive():
            server.kill()
    print(f"\nshared disk, SIGKILL while another serves: {totals}; server {out}")
    # the serving process never noticed: no failed write, never disabled, every read bit-exact
    assert out["written"] > 0 and out["read"] > 0
    assert out["bad_reads"] == 0 and out["write_failures"] == 0 and out["disabled"] == 0
    assert out["write_errors"] == 0 and out["corrupt_removed"] == 0
    assert totals["kills"] == KILLS and totals["acked"] > 0
    # everyone has left: a last start is alone, recounts, and finds every slot of the dead reclaimed
    last = DiskPageStore(LAYOUT, PAGE, 1 << 30, directory, NS)
    ledger = last._ledger
    assert ledger.reserved == 0 and ledger.files == len(page_files(directory))
    assert not ledger.others_alive()
    assert list(directory.rglob("*.tmp")) == []
    assert [p.name for p in (directory / SHARED_DIR / "owners").iterdir()] == [f"{last.owner}.lock"]


def test_a_process_locked_out_by_a_peers_pages_reclaims_the_oldest(tmp_path: Path) -> None:
    kw = dict(device=4, host=4, disk=24, write_policy="write_through", disk_write_policy="write_through")
    b = make_cache(tmp_path, **kw)  # opened first: it indexes none of a's pages
    a = make_cache(tmp_path, **kw)
    prompts = [list(range(1000 * i, 1000 * i + 16)) for i in range(8)]
    for p in prompts[:6]:
        serve(a, p)  # a fills the whole directory (6 x 4 pages)
        time.sleep(0.02)  # file times here have a few ms of resolution: keep the order visible
    assert b.stores[DISK].free_pages == 0 and b.tree.pages[DISK] == 0
    serve(b, prompts[7])  # b's own prompt: no room, nothing of b's own to evict
    assert b.tree.pages[DISK] == 4  # it got its pages onto disk ...
    assert b.stores[DISK].counters["peer_pages_evicted"] == 4  # ... by deleting 4 of a's, oldest first
    oldest = a.match(prompts[0], touch=False)
    assert oldest.disk_tokens == 16  # a's tree still claims them
    assert not any(a.stores[DISK].page_path(k).exists() for k in oldest.path[0].keys)
    assert len(page_files(tmp_path / "disk")) == 24
    assert a.promote(a.match(prompts[0])).device_tokens == 0  # so a misses ...
    errors = a.snapshot()["errors"]
    assert errors.get("vanished_pages") == 1 and errors.get("corrupt_pages", 0) == 0  # ... and is not corrupt
    assert len(page_files(tmp_path / "disk")) <= 24


def test_a_collected_store_never_waits_on_a_ledger_lock_its_own_thread_holds(tmp_path: Path) -> None:
    """Garbage collection can finalize a dropped store in whatever thread allocates -- also one
    inside a live store's critical section on the same directory's ledger. flock is per open file,
    so a blocking release would wait on its own thread forever (a hung test run). The release is
    deferred instead, and the dropped store's reservations are freed once the section ends."""
    from sgl_hicache.tiers.disk.ledger import DirectoryLedger

    dropped, live = DirectoryLedger(tmp_path, NS.root), DirectoryLedger(tmp_path, NS.root)
    assert dropped.reserve(3, capacity=10) and live.reserve(2, capacity=10)
    released = threading.Event()

    def collect_inside_the_section() -> None:
        with live.locked():
            dropped.close()  # what the finalizer runs on collection
            released.set()
            assert live.used == 5  # the drop waits for the section to end

    t = threading.Thread(target=collect_inside_the_section, daemon=True)
    t.start()
    t.join(20)
    assert released.is_set(), "releasing a store blocked on a ledger lock its own thread held"
    deadline = time.monotonic() + 20
    # the helper thread drops the slot, then the owner lock: wait for both
    while (live.used != 2 or live.is_alive(dropped.owner)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.used == 2 and not live.is_alive(dropped.owner)
    live.close()


def test_a_lone_start_puts_a_drifted_reservation_total_right(tmp_path: Path) -> None:
    """Giving a reservation back updates the owner's slot, then the total: two writes. A SIGKILL
    between them leaves the total too high for good (reclaiming the dead slot subtracts only what
    the slot says), and the directory's capacity shrinks by it. The next start with no other owner
    alive recomputes the total from the slots, as it recounts the files. (The suspected cause of
    `test_sigkill_a_writer_while_another_process_serves` failing its final `reserved == 0` twice in
    ~30 runs.)"""
    import struct as _struct

    from sgl_hicache.tiers.disk import ledger as sh

    a = open_store(tmp_path, 10)
    keys = [key(i) for i in range(3)]
    assert a.allocate(keys) == keys
    a.free(keys)  # the reservation given back: slot -3, then total -3
    ledger = a._ledger
    with ledger.locked():  # the slot was written, the total was not: what a kill there leaves
        ledger._write(sh._RESERVED_AT, _struct.pack("<q", ledger.reserved + 3))
    assert ledger.reserved == 3
    a.close()
    b = open_store(tmp_path, 10)
    assert b._ledger.reserved == 0 and b.free_pages == 10
    c = open_store(tmp_path, 10)  # not alone: nothing is recounted, and nothing needs to be
    assert c._ledger.reserved == 0
    b.close()
    c.close()
