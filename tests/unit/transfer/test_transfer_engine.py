"""The asynchronous transfer engine: concurrency, cancellation, failing handlers, priorities, parallel reads.

Every test ends with the engine stopped, every job released and `cache.check()` holding (tree
invariants plus every store's used pages equal to what the tree holds: nothing leaked).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from conftest import assert_device_kv, make_cache, serve

from sgl_hicache.cache import TieredCache
from sgl_hicache.tiers.base import DEVICE, DISK, HOST
from sgl_hicache.transfer.engine import TransferEngine
from sgl_hicache.transfer.ops import Cancelled


def seq(start: int, pages: int, page_size: int = 4) -> list[int]:
    return list(range(start, start + pages * page_size))


def finish(engine: TransferEngine, job, timeout: float = 30.0) -> bool:
    """Wait for a job; a stage that waits on another job's copy finishes once that job applies it."""
    deadline = time.monotonic() + timeout
    while not (engine.wait(job, timeout=max(0.0, deadline - time.monotonic())) and engine.links.advance(job)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll `condition` until it holds; the generous timeout only fails a hang (never a slow machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.001)


def assert_quiescent(cache: TieredCache) -> None:
    """No lock, no pin and no transfer left anywhere; accounting exact."""
    cache.check()
    for node in cache.tree.nodes():
        assert node.lock_ref == 0 and node.pins == 0 and not node.incoming, node
    assert cache.outstanding_device_pages == 0


def to_disk(cache: TieredCache, prompt, fillers) -> None:
    """Serve `prompt`, then enough `fillers` to push it down to the disk tier."""
    serve(cache, prompt)
    for f in fillers:
        serve(cache, f)
    m = cache.match(prompt, touch=False)
    assert m.disk_tokens == len(prompt) and m.device_tokens == m.host_tokens == 0, m


class Gate:
    """Wraps every handler: records (thread, kind, link) of each call an engine worker makes, and holds
    those calls while closed."""

    def __init__(self, cache: TieredCache, closed: bool = False, delay: float = 0.0) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.open = threading.Event()
        self.entered = threading.Event()
        if not closed:
            self.open.set()
        self.delay = delay
        self._lock = threading.Lock()
        for pair, h in list(cache.handlers.items()):
            cache.handlers[pair] = self._wrap(h)

    def _wrap(self, inner):
        def handler(op, start, stop):
            if not threading.current_thread().name.startswith("sgl-hicache-transfer"):
                return inner(op, start, stop)  # inline copies (synchronous demotions) pass untouched
            with self._lock:
                self.calls.append((threading.current_thread().name, op.kind, op.link))
            self.entered.set()
            assert self.open.wait(30), "gate never opened"
            if self.delay:
                threading.Event().wait(self.delay)
            inner(op, start, stop)

        return handler


# ---- concurrency ----------------------------------------------------------------------------


def test_concurrent_promotions_serving_and_eviction(tmp_path):
    ps = 4
    cache = make_cache(tmp_path, device=16, host=12, disk=64, page_size=ps)
    rng = random.Random(7)
    shared = seq(90_000, 1)
    # 20 prompts, some sharing a first page: more than device + host hold, so they spill to disk
    prompts = [(shared if i % 3 == 0 else []) + seq(1000 * (i + 1), rng.randint(1, 3)) for i in range(20)]
    for p in prompts:
        serve(cache, p)
    cache.check()
    assert cache.tree.pages[DISK] > 0

    engine = TransferEngine(cache, workers=3, chunk_pages=1).start()
    errors: list[BaseException] = []
    promoted = {"tokens": 0, "jobs": 0}
    count_lock = threading.Lock()

    def promoter(seed: int, kind: str, target: str) -> None:
        r = random.Random(seed)
        try:
            for _ in range(40):
                p = r.choice(prompts)
                job = cache.plan_promotion(cache.match(p), kind, target=target)
                if job is None:
                    continue
                engine.submit(job)
                assert finish(engine, job)
                # the path stays locked until release: what was promoted is on its tier, bit-identical
                if target == DEVICE:
                    checked = assert_device_kv(cache, p)
                    with count_lock:
                        promoted["tokens"] += checked
                with count_lock:
                    promoted["jobs"] += 1
                cache.release(job)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def server(seed: int) -> None:
        r = random.Random(seed)
        try:
            for i in range(40):
                if r.random() < 0.5:
                    serve(cache, r.choice(prompts))  # synchronous promotion + insert
                else:
                    serve(cache, seq(200_000 + 1000 * (seed * 100 + i), r.randint(1, 3)))  # new prompt: evicts, demotes
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=promoter, args=(1, "demand", DEVICE)),
        threading.Thread(target=promoter, args=(2, "prefetch", DEVICE)),
        threading.Thread(target=promoter, args=(3, "prefetch", HOST)),
        threading.Thread(target=server, args=(4,)),
        threading.Thread(target=server, args=(5,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a worker thread hung"
    engine.stop()
    assert not errors, errors[0]
    assert promoted["jobs"] > 0 and promoted["tokens"] > 0
    assert not cache.stats.errors
    assert_quiescent(cache)
    # everything the tree still holds comes back bit-identical, whatever tier it was left in
    for p in prompts:
        m = cache.promote(cache.match(p))
        assert_device_kv(cache, p)
        assert m.device_tokens == m.tokens
    assert_quiescent(cache)


def test_predicted_promotions_concurrent_with_demand(tmp_path):
    cache = make_cache(tmp_path, device=12, host=8, disk=64)
    prompts = [seq(1000 * (i + 1), 2) for i in range(12)]
    for p in prompts:
        serve(cache, p)
    engine = TransferEngine(cache, workers=2, chunk_pages=1).start()
    jobs = []
    for i, p in enumerate(prompts):
        kind = "predict" if i % 2 else "demand"
        job = cache.plan_promotion(
            cache.match(p), kind, target=DEVICE if kind == "demand" else HOST, evict=kind != "predict"
        )
        if job is not None:
            jobs.append(engine.submit(job))
    for job in jobs:
        (engine.wait(job, timeout=30) and engine.links.advance(job))
        cache.release(job)
    engine.stop()
    assert_quiescent(cache)


# ---- cancellation -----------------------------------------------------------------------


def test_cancel_a_job_whose_ops_are_queued(tmp_path):
    cache = make_cache(tmp_path, device=8, host=4, disk=64)
    a, b = seq(0, 2), seq(500, 2)
    serve(cache, b)
    to_disk(cache, a, [seq(1000 * i, 2) for i in range(1, 7)])
    assert cache.match(a, touch=False).disk_tokens == 8
    assert cache.match(b, touch=False).disk_tokens == 8
    gate = Gate(cache, closed=True)
    engine = TransferEngine(cache, workers=1, chunk_pages=1).start()
    job_a = engine.submit(cache.plan_promotion(cache.match(a), "demand"))
    assert gate.entered.wait(10)  # the only worker is inside job a's first copy
    job_b = engine.submit(cache.plan_promotion(cache.match(b), "demand"))
    assert engine.queued() > 0
    # cancel marks job b's first op (its disk->host copy) cancelled, then waits for it to end: it is
    # queued behind job a's held copy, so open the gate once it is marked (opening it earlier could
    # let the worker run it); its successor ends with it
    canceller = threading.Thread(target=cache.cancel, args=(job_b,))
    canceller.start()
    wait_until(lambda: job_b.ops()[0].cancelled, "cancel() to mark job b's queued copy")
    assert canceller.is_alive()  # still waiting: job b's ops sit behind the held copy
    gate.open.set()
    canceller.join(60)
    assert not canceller.is_alive(), "cancel() hung"
    assert job_b.failed and job_b.finished
    for op in job_b.ops():
        assert op.executed.is_set() and op.applied and isinstance(op.error, Cancelled)
    assert all(kind == "demand" for _, kind, _ in gate.calls)
    assert (engine.wait(job_a, timeout=30) and engine.links.advance(job_a)) and not job_a.failed
    cache.release(job_b)
    cache.release(job_a)
    engine.stop()
    assert cache.match(a, touch=False).device_tokens == 8  # a came up
    assert cache.match(b, touch=False).disk_tokens == 8  # b stays where it was
    assert_device_kv(cache, a)
    assert not cache.stats.errors  # a cancellation is not an error
    assert_quiescent(cache)


def test_engine_cancel_drops_queued_backups_at_once(tmp_path):
    """`TransferEngine.cancel`: a queued background copy ends at once (no worker touches it), the one
    a worker is in finishes first; both complete in the cache as cancelled, nothing leaks."""
    cache = make_cache(tmp_path, device=16, host=16, disk=64)
    prompts = [seq(100 * i, 2) for i in range(1, 4)]
    for p in prompts:
        serve(cache, p)
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=6, max_pages=6)
    assert len(ops) == 3
    gate = Gate(cache, closed=True)
    engine = TransferEngine(cache, workers=1, chunk_pages=1).start()
    engine.submit_ops(ops[:1])
    assert gate.entered.wait(10)  # the only worker is inside the first copy
    engine.submit_ops(ops[1:2])  # queued behind it; ops[2] is prepared but never submitted
    engine.cancel(ops)
    for op in ops[1:]:  # never started (or never submitted): over without the worker
        assert op.executed.is_set() and isinstance(op.error, Cancelled)
    assert not ops[0].executed.is_set()  # its copy is still running
    gate.open.set()
    assert ops[0].executed.wait(10) and isinstance(ops[0].error, Cancelled)
    assert [link for _, _, link in gate.calls] == ["device->host"]  # one chunk ran, then it stopped
    for op in ops:
        assert not cache.complete(op)
    engine.stop()
    assert all(cache.match(p, touch=False).path[-1].host is None for p in prompts)
    assert not cache.stats.errors
    assert_quiescent(cache)


def test_stop_with_queued_ops_cancels_them(tmp_path):
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    a, b = seq(0, 2), seq(500, 2)
    fillers = [seq(1000 * i, 2) for i in range(1, 9)]
    serve(cache, b)
    to_disk(cache, a, fillers)
    assert cache.match(b, touch=False).disk_tokens == 8
    gate = Gate(cache, closed=True)
    engine = TransferEngine(cache, workers=1, chunk_pages=4).start()
    # a: disk->host (one chunk) then host->device; the worker is held inside the disk->host copy, so
    # when it ends stop() has already begun: its successor must still end (cancelled), not hang
    job_a = engine.submit(cache.plan_promotion(cache.match(a), "demand"))
    assert gate.entered.wait(10)
    job_b = engine.submit(cache.plan_promotion(cache.match(b), "prefetch"))
    assert engine.queued() > 0  # job b's ops (and the rest of a) wait behind the held copy
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    # stop() has taken the queue (to cancel it) and is now waiting for the worker
    wait_until(lambda: engine.queued() == 0, "stop() to take the queue")
    assert stopper.is_alive()
    gate.open.set()
    stopper.join(30)
    assert not stopper.is_alive()
    for job in (job_a, job_b):
        # every op ended: executed, and those that did not run carry Cancelled
        for op in job.ops():
            assert op.executed.wait(5), f"{op.link} never ended after stop()"
    assert any(isinstance(op.error, Cancelled) for op in job_a.ops())
    assert all(isinstance(op.error, Cancelled) for op in job_b.ops())
    assert len(gate.calls) == 1
    for job in (job_a, job_b):
        cache.advance(job)
        cache.release(job)
        assert job.failed
    assert not cache.stats.errors
    assert_quiescent(cache)
    assert cache.match(a, touch=False).device_tokens == 0
    # the cache still works synchronously after the engine is gone, and the bytes are intact
    assert cache.promote(cache.match(a)).device_tokens == 8
    assert_device_kv(cache, a)
    assert_quiescent(cache)


def test_engine_restarts_after_stop(tmp_path):
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    a = seq(0, 2)
    to_disk(cache, a, [seq(1000 * i, 2) for i in range(1, 9)])
    cache.evict(HOST, 8)  # room on host: a prediction only fills free pages
    engine = TransferEngine(cache, workers=2, chunk_pages=1)
    engine.start()
    engine.stop()
    engine.start()
    job = engine.submit(cache.plan_promotion(cache.match(a), "predict", target=HOST, evict=False))
    assert (
        engine.wait(job, timeout=10) and engine.links.advance(job)
    ) and not job.failed  # a predicted op still runs after a restart
    cache.release(job)
    engine.stop()
    assert cache.match(a, touch=False).host_tokens == 8
    assert_quiescent(cache)


# ---- failing handler --------------------------------------------------------------------


@pytest.mark.parametrize("use_engine", [True, False])
def test_failing_disk_read_is_a_counted_miss(tmp_path, use_engine):
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    a = seq(0, 2) + seq(300, 2)
    serve(cache, seq(0, 2))  # a's first node is its own node
    to_disk(cache, a, [seq(1000 * i, 2) for i in range(1, 9)])
    calls = []

    def broken(op, start, stop):
        calls.append(op.node)
        raise OSError(5, "injected I/O error")

    cache.handlers[(DISK, HOST)] = broken
    m = cache.match(a)
    assert m.disk_tokens == 16
    if use_engine:
        engine = TransferEngine(cache, workers=2, chunk_pages=1).start()
        job = engine.submit(cache.plan_promotion(m, "demand"))
        assert engine.wait(job, timeout=10) and engine.links.advance(job)
        assert job.failed
        cache.release(job)
        engine.stop()
        m2 = cache.match(a)
    else:
        m2 = cache.promote(m)
    assert calls
    assert m2.device_tokens < len(a)  # the request sees a miss, not wrong KV
    assert m2.device_tokens == 0
    assert sum(cache.stats.errors.values()) >= 1
    assert cache.stats.errors.get("disk->host_errors", 0) >= 1
    assert cache.snapshot()["errors"]
    assert_quiescent(cache)
    # an I/O error is not corruption: the disk copy stays and serves once the medium recovers
    assert cache.match(a, touch=False).disk_tokens == 16
    from sgl_hicache.transfer.handlers import default_handlers

    cache.handlers = default_handlers(cache.stores)
    assert cache.promote(cache.match(a)).device_tokens == 16
    assert_device_kv(cache, a)
    assert_quiescent(cache)


def test_corrupt_pages_in_chunks_read_at_once_are_each_counted(tmp_path):
    """One node's pages read by two workers at once (one chunk each), both pages corrupt: the store
    drops both, and the cache counts two corrupt pages, not one per transfer (the stats must agree
    with the store's `corrupt_removed`); the node is a miss, never served."""
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    a = seq(0, 2)
    to_disk(cache, a, [seq(1000 * i, 2) for i in range(1, 9)])
    disk = cache.stores[DISK]
    for key in cache.match(a, touch=False).path[0].keys:
        path = disk.page_path(key)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    both_in = threading.Barrier(2, timeout=30)  # both chunks enter the read before either fails
    inner = cache.handlers[(DISK, HOST)]

    def handler(op, start, stop):
        both_in.wait()
        inner(op, start, stop)

    cache.handlers[(DISK, HOST)] = handler
    engine = TransferEngine(cache, workers=2, chunk_pages=1).start()
    job = engine.submit(cache.plan_promotion(cache.match(a), "demand"))
    assert finish(engine, job)
    assert job.failed
    cache.release(job)
    engine.stop()
    assert disk.counters["corrupt_removed"] == 2
    assert cache.snapshot()["errors"].get("corrupt_pages") == 2
    assert cache.match(a, touch=False).tokens == 0
    assert_quiescent(cache)


def test_a_failed_stage_never_waits_for_the_copies_still_running(tmp_path):
    """A stage of a promotion fails while a worker still copies a later stage: `advance` (on the
    scheduling thread) ends the job at once and leaves the running copy as an orphan, whose pages are
    freed when it ends (`reap_orphans`); nothing leaks, nothing is served from the failed path."""
    cache = make_cache(tmp_path, device=8, host=8, disk=64)
    first, a = seq(0, 2), seq(0, 2) + seq(300, 2)
    serve(cache, first)  # a's first node is its own node
    to_disk(cache, a, [seq(1000 * i, 2) for i in range(1, 9)])
    second_entered, second_go = threading.Event(), threading.Event()
    inner = cache.handlers[(DISK, HOST)]

    def handler(op, start, stop):
        if op.node.parent is cache.tree.root:
            raise OSError(5, "injected I/O error")
        second_entered.set()
        assert second_go.wait(30), "the test never released the second copy"
        inner(op, start, stop)

    cache.handlers[(DISK, HOST)] = handler
    engine = TransferEngine(cache, workers=2, chunk_pages=2).start()
    job = engine.submit(cache.plan_promotion(cache.match(a), "demand"))
    assert second_entered.wait(10)
    failed_op = job.stages[0].ops[0]
    assert failed_op.executed.wait(10) and failed_op.error is not None
    assert cache.advance(job) and job.failed
    running = job.stages[1].ops[0]
    # it did not wait for the held copy: that copy is still blocked on second_go, and is left as an orphan
    assert not running.executed.is_set() and running in cache.orphans
    cache.release(job)
    second_go.set()
    assert running.executed.wait(10)
    cache.reap_orphans()
    assert not cache.orphans and running.applied and isinstance(running.error, Cancelled)
    engine.stop()
    assert cache.match(a, touch=False).device_tokens == 0  # a miss, not wrong KV
    assert cache.stats.errors.get("disk->host_errors", 0) == 1
    assert_quiescent(cache)


def test_failing_host_to_device_is_a_miss(tmp_path):
    cache = make_cache(None, device=8, host=8)
    a = seq(0, 2)
    serve(cache, a)
    for i in range(1, 5):
        serve(cache, seq(1000 * i, 2))
    assert cache.match(a, touch=False).host_tokens == 8

    def broken(op, start, stop):
        raise OSError("injected")

    cache.handlers[(HOST, DEVICE)] = broken
    engine = TransferEngine(cache, workers=1).start()
    job = engine.submit(cache.plan_promotion(cache.match(a), "demand"))
    (engine.wait(job, timeout=10) and engine.links.advance(job))
    cache.release(job)
    engine.stop()
    assert job.failed
    assert cache.stats.errors["host->device_errors"] == 1
    assert cache.match(a, touch=False).host_tokens == 8 and cache.match(a, touch=False).device_tokens == 0
    assert_quiescent(cache)


# ---- priorities and parallel reads ---------------------------------------------------------


def test_predicted_ops_wait_while_demand_ops_are_queued(tmp_path):
    cache = make_cache(tmp_path, device=16, host=16, disk=64)
    blocker = seq(0, 1)
    preds = [seq(100 * (i + 1), 2) for i in range(3)]
    demands = [seq(50_000 + 100 * (i + 1), 2) for i in range(3)]
    for p in [blocker, *preds, *demands]:
        serve(cache, p)
    # push everything off the device and host tiers
    for i in range(1, 17):
        serve(cache, seq(900_000 + 1000 * i, 2))
    for p in [blocker, *preds, *demands]:
        assert cache.match(p, touch=False).disk_tokens == len(p)
    cache.evict(HOST, 16)  # free host pages: predictions only fill free space
    gate = Gate(cache, closed=True)
    engine = TransferEngine(cache, workers=1, chunk_pages=1).start()
    jobs = [engine.submit(cache.plan_promotion(cache.match(blocker), "demand", target=HOST))]
    assert gate.entered.wait(10)
    # predictions are submitted first, demands after: demands must still run first
    for p in preds:
        jobs.append(engine.submit(cache.plan_promotion(cache.match(p), "predict", target=HOST, evict=False)))
    for p in demands:
        jobs.append(engine.submit(cache.plan_promotion(cache.match(p), "demand", target=HOST)))
    gate.open.set()
    for job in jobs:
        assert (engine.wait(job, timeout=30) and engine.links.advance(job)) and not job.failed
        cache.release(job)
    engine.stop()
    kinds = [kind for _, kind, _ in gate.calls]
    assert kinds[0] == "demand"
    last_demand = max(i for i, k in enumerate(kinds) if k == "demand")
    first_predict = min(i for i, k in enumerate(kinds) if k == "predict")
    assert last_demand < first_predict, kinds
    assert kinds.count("predict") == 6 and kinds.count("demand") == 1 + 6
    assert_quiescent(cache)


def test_one_big_disk_read_is_spread_over_workers(tmp_path):
    cache = make_cache(tmp_path, device=16, host=16, disk=64)
    big = seq(0, 12)
    to_disk(cache, big, [seq(1000 * (i + 1), 4) for i in range(8)])
    assert len(cache.match(big, touch=False).path) == 1  # one node, one disk->host op of 12 pages
    gate = Gate(cache, delay=0.02)
    engine = TransferEngine(cache, workers=4, chunk_pages=1).start()
    job = engine.submit(cache.plan_promotion(cache.match(big), "demand"))
    assert len(job.ops()) == 2 and job.ops()[0].link == "disk->host"
    assert (engine.wait(job, timeout=30) and engine.links.advance(job)) and not job.failed
    cache.release(job)
    engine.stop()
    readers = {name for name, _, link in gate.calls if link == "disk->host"}
    assert sum(1 for *_, link in gate.calls if link == "disk->host") == 12  # one call per chunk
    assert len(readers) >= 2, readers
    assert cache.match(big, touch=False).device_tokens == len(big)
    assert_device_kv(cache, big)
    assert_quiescent(cache)


@pytest.mark.parametrize("memory_chunk_bytes, host_to_device_calls", [(64 << 20, 1), (0, 12)])
def test_a_copy_between_memories_is_cut_only_by_its_byte_size(tmp_path, memory_chunk_bytes, host_to_device_calls):
    """Disk reads are cut into `chunk_pages` for parallel reads; a host -> device copy is one torch
    call, so it is cut only every `memory_chunk_bytes` (0: every `chunk_pages`, as a disk read)."""
    cache = make_cache(tmp_path, device=16, host=16, disk=64)
    big = seq(0, 12)
    to_disk(cache, big, [seq(1000 * (i + 1), 4) for i in range(8)])
    gate = Gate(cache)
    engine = TransferEngine(cache, workers=4, chunk_pages=1, memory_chunk_bytes=memory_chunk_bytes).start()
    job = engine.submit(cache.plan_promotion(cache.match(big), "demand"))
    assert finish(engine, job) and not job.failed
    cache.release(job)
    engine.stop()
    links = [link for *_, link in gate.calls]
    assert links.count("disk->host") == 12
    assert links.count("host->device") == host_to_device_calls
    assert_device_kv(cache, big)
    assert_quiescent(cache)


def test_engine_rejects_bad_arguments():
    cache = make_cache(None)
    with pytest.raises(ValueError, match="workers"):
        TransferEngine(cache, workers=0)
    with pytest.raises(ValueError, match="chunk_pages"):
        TransferEngine(cache, chunk_pages=0)
    with pytest.raises(ValueError, match="memory_chunk_bytes"):
        TransferEngine(cache, memory_chunk_bytes=-1)


def test_speculative_pacer_keeps_predictions_to_their_share_of_the_link():
    from sgl_hicache.transfer.bandwidth import BandwidthMeter, SpeculativePacer

    now = [0.0]
    meter = BandwidthMeter(priors={"disk->host": 1000.0})  # 1000 B/s measured
    pacer = SpeculativePacer(meter, share=0.5, burst_s=1.0, clock=lambda: now[0])  # 500 B/s, 500 B burst
    assert pacer.try_take("disk->host", 400)
    assert not pacer.try_take("disk->host", 400)  # 100 B left
    now[0] += 0.5  # +250 B
    assert not pacer.try_take("disk->host", 400)
    now[0] += 0.2  # +100 B: 450
    assert pacer.try_take("disk->host", 400)
    now[0] += 10
    assert pacer.try_take("disk->host", 5000)  # larger than the bucket: passes when it is full...
    assert not pacer.try_take("disk->host", 1)  # ...and leaves a debt of 4,500 B
    now[0] += 2
    assert not pacer.try_take("disk->host", 2000)  # 1000 B s of refill do not pay it off
    meter.record("disk->host", 10_000, 1.0)  # the link measured faster: so does the pace (5000 B/s)
    now[0] += 1
    assert not pacer.try_take("disk->host", 2000)  # -3500 + 5000
    now[0] += 0.2
    assert pacer.try_take("disk->host", 2000)  # + 1000


def test_done_flag_wakes_every_waiter_whenever_it_is_set():
    """`DoneFlag` (an op's `executed`): a wait returns True for a set made before it, during it (from
    another thread, many waiters at once) and False only on a timeout with no set."""
    from sgl_hicache.transfer.ops import DoneFlag

    early = DoneFlag()
    early.set()
    assert early.is_set() and early.wait(0)
    assert DoneFlag().wait(0.01) is False
    for _ in range(200):  # set races the waiters' first look and the event's birth
        flag = DoneFlag()
        got: list[bool] = []
        waiters = [threading.Thread(target=lambda flag=flag, got=got: got.append(flag.wait(10))) for _ in range(3)]
        for t in waiters:
            t.start()
        flag.set()
        for t in waiters:
            t.join(15)
        assert got == [True, True, True]
