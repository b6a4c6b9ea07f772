"""The shared store tier end to end, against real stores: two caches ("servers"), each driven by the
one RequestController over the threaded executor (the SGLang backend's path), share one Mooncake
Store or redis-server. Pages one server wrote back are store hits on the other, arrive bit-exact,
and every fault (foreign or corrupt value, master killed, holder killed, store down, store full)
degrades to a counted miss while both keep serving.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

import pytest
import torch
import xxhash
from conftest import SMALL_LAYOUT, SYNCHRONOUS, assert_device_kv, kv_for

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.control.lifecycle import Admission, ControllerSettings, RequestController
from sgl_hicache.hashing import Namespace
from sgl_hicache.policy.predictor_factory import make_predictor
from sgl_hicache.tiers.base import DISK
from sgl_hicache.tiers.codec import FORMAT_VERSION, PageCodec
from sgl_hicache.tiers.disk import tensor_bytes
from sgl_hicache.tiers.shared_store import SharedStoreTier
from sgl_hicache.tiers.store_local import start_mooncake, start_redis
from sgl_hicache.transfer.engine import TransferEngine
from sgl_hicache.transfer.executors import ThreadExecutor

PS = 4


class Server:
    """One cache + controller + threaded executor, as `sglang/backend.py` wires them."""

    served = 0  # requests served by every Server of the test (each checked for exact device KV)

    def __init__(self, url: str, salt: str, min_hits: int = 0, layout: KVLayout = SMALL_LAYOUT) -> None:
        cfg = CacheConfig(
            layout,
            device_tokens=64 * PS,
            host_tokens=128 * PS,
            page_size=PS,
            tenant_salt=salt,
            store_url=url,
            store_min_hits=min_hits,
            **SYNCHRONOUS,
        )
        self.cache = TieredCache(cfg)
        self.engine = TransferEngine(self.cache, workers=2)
        self.ctrl = RequestController(
            self.cache,
            ThreadExecutor(self.cache, self.engine),
            make_predictor("none", PS, 0),
            ControllerSettings(
                device_writeback_clean_fraction=1.0, writeback_clean_fraction=1.0, writeback_interval_s=0.0
            ),
            clock=time.monotonic,
        )
        self.store: SharedStoreTier = self.cache.stores[DISK]  # type: ignore[assignment]
        self.store.backoff_s = self.store._next_backoff = 0.2  # tests wait for recovery in well under a second

    def request(self, tokens: list[int]) -> tuple[int, int, int]:
        """Serve one prompt: arrive, prefetch, admit (waiting), load, account, compute the rest, insert.
        Returns the (device, host, store) hit tokens."""
        ctrl, cache = self.ctrl, self.cache
        ticket, m = ctrl.arrive(tokens)
        ctrl.prefetch(ticket, m)
        deadline = time.monotonic() + 30
        while ctrl.admit(ticket, recompute_seconds=60.0)[0] is Admission.WAIT:
            assert time.monotonic() < deadline, "prefetch never finished"
            time.sleep(0.002)
        m = cache.match(tokens, touch=False)
        m2, _ = ctrl.load(tokens, m)
        hits = ctrl.account(ticket, len(tokens), m, hit_tokens=m2.device_tokens)
        ctrl.release(ticket)
        with cache._mutex:
            m3 = cache.match(tokens, touch=False)
            cache.lock(m3.last_node)
        try:
            need = len(tokens) // PS - len(m3.device_handles)
            fresh = cache.allocate_device(need)
            assert fresh is not None
            if fresh:
                cache.stores["device"].write(fresh, kv_for(cache, tokens)[len(m3.device_handles) :])
            r = cache.insert(tokens, m3.device_handles + fresh)
            cache.free_device(r.duplicates)
        finally:
            cache.unlock(m3.last_node)
        assert_device_kv(cache, tokens)  # never wrong KV, whatever the store did
        cache.check()
        Server.served += 1
        return hits

    def write_back(self, timeout: float = 30.0) -> None:
        """Run the paced background write-back until nothing more is planned."""
        deadline = time.monotonic() + timeout
        while self.ctrl.pump_writeback() or self.ctrl.writeback:
            assert time.monotonic() < deadline, "write-back did not settle"
            time.sleep(0.005)

    def close(self) -> None:
        self.ctrl.shutdown()
        self.engine.stop()
        self.store.close()


@pytest.fixture(autouse=True)
def _count_served():
    Server.served = 0


def _prompt(seed: int, pages: int) -> list[int]:
    return [seed * 1000 + i for i in range(pages * PS)]


_SALT = iter(range(10**6))


@pytest.fixture(params=["mooncake", "redis"])
def shared(request, mooncake_service, redis_service):
    """Two servers of one model (same namespace salt) on the same store, plus the store's processes."""
    service = mooncake_service if request.param == "mooncake" else redis_service
    salt = f"t{next(_SALT)}-{time.time_ns()}"  # a cold key space per test on the session's store
    a, b = Server(service.url, salt), Server(service.url, salt)
    yield a, b, service
    a.close()
    b.close()


def test_turn_on_a_next_turn_on_b_hits_the_store(shared) -> None:
    a, b, _ = shared
    turn1 = _prompt(1, 6)
    assert a.request(turn1) == (0, 0, 0)
    a.write_back()
    assert a.store.counters["pages_written"] == 6
    turn2 = turn1 + _prompt(2, 3)
    dev, host, store = b.request(turn2)  # B never saw turn 1: its prefix comes from A through the store
    assert (dev, host, store) == (0, 0, 6 * PS)
    assert b.store.counters["pages_read"] == 6 and b.store.counters["exists_calls"] >= 1
    assert b.cache.stats.hit_tokens[DISK] == 6 * PS
    snap = b.cache.snapshot()
    assert snap["lower_tier"] == "store" and snap["store"]["pages_read"] == 6
    # another model (another namespace) sharing the store sees none of it
    other = Server(a.store.url, "another-model")
    try:
        assert other.request(turn2) == (0, 0, 0)
    finally:
        other.close()


def test_write_back_only_pages_worth_sharing(mooncake_service) -> None:
    a = Server(mooncake_service.url, f"hits-{time.time_ns()}", min_hits=1)
    try:
        p = _prompt(3, 4)
        a.request(p)
        a.write_back()
        assert a.store.counters["pages_written"] == 0  # computed once, never hit: not shared
        a.request(p + _prompt(4, 2))  # the 4 pages of p are hit now
        a.write_back()
        assert a.store.counters["pages_written"] == 4
    finally:
        a.close()


@pytest.mark.parametrize("damage", ["foreign", "corrupt", "truncated", "other_version"])
def test_bad_value_under_a_valid_key_is_a_counted_miss(shared, damage: str) -> None:
    a, b, _ = shared
    p = _prompt(5, 4)
    a.request(p)
    a.write_back()
    keys = [n.keys for n in a.cache.tree.nodes() if n.keys][0]
    key = keys[1]  # the second page of the node
    good = torch.zeros(a.store.page_shape, dtype=torch.bfloat16)
    if damage == "foreign":
        codec = PageCodec(
            Namespace.for_model(SMALL_LAYOUT, PS, "someone-else"),
            a.store.page_shape,
            SMALL_LAYOUT.dtype,
            a.store.page_bytes,
            "t",
        )
        value = codec.encode(key, tensor_bytes(good))
    else:
        value = bytearray(a.store.codec.encode(key, tensor_bytes(good)))
        if damage == "corrupt":
            value[-1] ^= 0xFF
        elif damage == "other_version":  # as a build of the next format version writes it
            struct.pack_into("<H", value, 8, FORMAT_VERSION + 1)
            struct.pack_into("<Q", value, 112, xxhash.xxh3_64_intdigest(bytes(value[:112])))
        else:
            value = value[:-7]
    assert a.store.backend.put([a.store.store_key(key)], [bytes(value)]) == [True]
    _dev, _host, store = b.request(p)
    assert store == 0  # the node holding the bad page (one transfer) and its suffix are recomputed
    c = b.store.counters
    expected = {"foreign": (1, 0, 0), "other_version": (0, 0, 1)}.get(damage, (0, 1, 0))
    assert (c["foreign_values"], c["corrupt_values"], c["version_skipped"]) == expected
    assert b.cache.stats.errors["corrupt_pages"] == 1


def _report(fault: str, t_fault: float, a: Server, b: Server, attempts: int) -> None:
    """The figures docs/reliability.md quotes (run with -s to see them)."""
    ca, cb = a.store.counters, b.store.counters
    print(
        f"\n[store fault] {fault}: requests served {Server.served}, wrong KV 0 (each checked); "
        f"errors A/B {ca['errors']}/{cb['errors']}, read misses B {cb['read_misses']}, puts failed A {ca['puts_failed']}, "
        f"back after {time.monotonic() - t_fault:.1f} s ({attempts} tries), recoveries A/B {ca['recoveries']}/{cb['recoveries']}"
    )


def _comes_back(a: Server, b: Server, seed: int, timeout: float) -> int:
    """A serves and writes back a fresh prompt, B serves it, until B gets store hits (the tier is back
    for both). Returns the attempts it took."""
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        p = _prompt(seed + attempt, 3)
        a.request(p)
        a.write_back()
        if b.request(p)[2] == 3 * PS:
            return attempt
        assert time.monotonic() < deadline, "the store tier did not come back"
        time.sleep(0.3)


@contextlib.contextmanager
def _pair_with_a_shared_prompt(svc, seed: int) -> Iterator[tuple[Server, Server, list[int]]]:
    """Servers A and B on `svc`; A has served a prompt and written it back. Closes both after."""
    salt = f"fault-{seed}-{time.time_ns()}"
    a, b = Server(svc.url, salt), Server(svc.url, salt)
    try:
        p = _prompt(seed, 4)
        a.request(p)
        a.write_back()
        yield a, b, p
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("snapshot", [False, True], ids=["plain", "snapshot"])
def test_mooncake_master_killed(snapshot: bool, caplog) -> None:
    with start_mooncake(64, snapshot=snapshot) as svc, _pair_with_a_shared_prompt(svc, 6) as (a, b, p):
        if snapshot:
            time.sleep(4)  # one snapshot interval (3 s) has passed
        svc.kill("master")
        t_fault = time.monotonic()
        assert b.request(p) == (0, 0, 0)  # store down: served from local tiers (recomputed)
        assert b.store.counters["errors"] == 1 and not b.store.available
        assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
        q = _prompt(7, 4)
        assert b.request(q)[2] == 0  # while down: no lookup, no error storm
        svc.restart("master")
        _report(
            f"master killed ({'snapshot' if snapshot else 'plain'})", t_fault, a, b, _comes_back(a, b, 200, timeout=40)
        )
        c = Server(
            svc.url, a.cache.config.tenant_salt
        )  # a fresh server: were the objects written before the kill restored?
        try:
            print(
                f"[store fault] master killed ({'snapshot' if snapshot else 'plain'}): a fresh server's store hits on the "
                f"pre-kill prompt after the restart: {c.request(p)[2]} of {len(p)} tokens"
            )
        finally:
            c.close()
        # (in snapshot mode, reading a restored object failed with -800 in 1 of 4 runs:
        # a second outage on B, counted, nothing served)
        assert b.store.counters["recoveries"] >= 1 and b.store.available


def test_mooncake_holder_killed() -> None:
    with start_mooncake(64) as svc, _pair_with_a_shared_prompt(svc, 10) as (a, b, p):
        svc.kill("holder")  # the data dies with it; is_exist still says yes for ~10 s
        t_fault = time.monotonic()
        assert b.request(p)[2] == 0  # get_into's status code: nothing served that did not arrive
        assert b.store.counters["read_misses"] >= 1 and b.cache.stats.errors["corrupt_pages"] >= 1
        svc.restart("holder")
        _report("holder killed", t_fault, a, b, _comes_back(a, b, 300, timeout=40))


def test_redis_down_and_back() -> None:
    with start_redis(32) as svc, _pair_with_a_shared_prompt(svc, 13) as (a, b, p):
        svc.kill("redis")  # every object is lost with it
        t_fault = time.monotonic()
        assert b.request(p) == (0, 0, 0)
        assert b.store.counters["errors"] == 1
        svc.restart("redis")
        _report("redis killed", t_fault, a, b, _comes_back(a, b, 400, timeout=10))


def test_store_full_puts_counted_as_failed() -> None:
    with start_redis(1, policy="noeviction") as svc:  # 1 MiB, refuses writes when full
        a = Server(svc.url, f"full-{time.time_ns()}")
        try:
            for i in range(24):  # 24 x 32 pages x 640 B ~ 0.5 MB of values, plus overhead, over 1 MiB
                a.request(_prompt(100 + i, 32))
                a.write_back()
            c = a.store.counters
            assert c["puts_failed"] > 0 and c["pages_written"] > 0
            assert a.store.available  # a full store is not an outage
            print(
                f"\n[store fault] redis full (1 MiB, noeviction): pages written {c['pages_written']}, puts failed {c['puts_failed']}, "
                f"errors {c['errors']}, requests served {Server.served}"
            )
            assert a.request(_prompt(100, 32))[0] >= 0  # still serving
        finally:
            a.close()


BIG_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="bfloat16")  # 64 KiB pages of PS tokens


def test_mooncake_full_puts_counted_as_dropped() -> None:
    """A full Mooncake Store refuses puts for lack of space (and its master evicts objects in the
    background at 90 % full): refused puts are counted, the tier stays available, and a second server
    gets what survived, bit-exact, and misses the rest."""
    with start_mooncake(16) as svc:  # 16 MiB, the smallest segment a holder accepts: 256 pages of 64 KiB
        salt = f"mc-full-{time.time_ns()}"
        a, b = Server(svc.url, salt, layout=BIG_LAYOUT), Server(svc.url, salt, layout=BIG_LAYOUT)
        try:
            prompts = [_prompt(600 + i, 16) for i in range(24)]  # 384 pages: 1.5x what the store holds
            for p in prompts:
                a.request(p)
                a.write_back()
            c = a.store.counters
            master = svc.master_metrics()
            assert c["puts_failed"] > 0 and c["pages_written"] > 0, c
            assert c["errors"] == 0 and a.store.available  # a full store is not an outage
            # the store's own count of refused objects agrees with ours
            assert master["master_batch_put_start_failed_items_total"] == c["puts_failed"], master
            hits = [b.request(p)[2] for p in prompts]  # every request checks its device KV bit for bit
            cb = b.store.counters
            assert 0 < sum(hits) < 16 * PS * len(prompts), hits
            assert cb["corrupt_values"] == cb["foreign_values"] == cb["errors"] == 0, cb
            print(
                f"\n[store fault] mooncake full (16 MiB holder, 384 pages of 64 KiB offered): pages written "
                f"{c['pages_written']}, puts failed (dropped) {c['puts_failed']}, master evicted "
                f"{master.get('master_evicted_key_count', 0):.0f} objects, errors {c['errors']}; B's store hits "
                f"{sum(hits)} of {16 * PS * len(prompts)} tokens, read misses {cb['read_misses']}; requests served "
                f"{Server.served}, wrong KV 0"
            )
        finally:
            a.close()
            b.close()


def test_insert_beside_a_node_being_written_to_the_lower_tier_splits_it(tmp_path) -> None:
    """A write-back copy into the lower tier (the store's or the disk's place) pins its node; a request
    diverging inside that node splits it (found by the fleet what-if, whose store write-back copies
    nodes in use: the walk used to stop there and the request's pages all became duplicates). The
    write lands on both parts, under each part's own keys."""
    from conftest import make_cache

    cache = make_cache(tmp_path, device=16, host=16, page_size=PS)
    a = list(range(4 * PS))
    handles = cache.allocate_device(4)
    cache.insert(a, handles)
    node = cache.match(a).last_node
    assert cache.copy_now(node, "host", kind="backup", may_evict=False)
    op = cache.prepare(node, DISK, kind="backup", may_evict=False)
    assert op is not None
    b = a[: 2 * PS] + [999] * (2 * PS)  # diverges inside the node being written
    m = cache.match(b, touch=False)
    fresh = cache.allocate_device(2)
    r = cache.insert(b, m.device_handles + fresh)
    assert len(r.duplicates) == 0 and r.adopted_pages == 2
    upper = node.parent
    assert upper.num_pages == node.num_pages == 2 and DISK in upper.incoming
    from sgl_hicache.transfer.handlers import execute

    execute(op, cache.handlers)
    assert cache.complete(op)
    assert upper.disk is not None and node.disk is not None and not upper.pins and not node.pins
    assert all(cache.lower.holds(k) for k in upper.keys + node.keys)
    cache.check()
