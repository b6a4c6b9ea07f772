"""The SGLang backend's parts against SGLang's real pool classes, without a server (fast)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
from conftest import SYNCHRONOUS
from queued_request import queued_request


def _pools(page_size: int, size: int = 256):
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    if page_size > 1:
        return PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", pool, need_sort=False)
    return TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool, need_sort=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_device_pool_round_trip_in_sglang_layout(page_size):
    import torch

    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    alloc = _pools(page_size)
    dev = SGLangDevicePool(alloc)
    assert dev.pool_pages == 256 // page_size and dev.free_pages == dev.pool_pages and dev.used_pages == 0
    h = dev.allocate([b"k"] * 3)
    assert len(h) == 3 and dev.used_pages == 3 and dev.free_pages == dev.pool_pages - 3
    data = torch.randn((3, *dev.page_shape)).to(torch.bfloat16)
    dev.write(h, data)
    assert torch.equal(dev.read(h), data)
    slots = dev.token_slots(h)  # the bytes sit where SGLang's attention reads them
    kv = alloc.get_kvcache()
    assert torch.equal(kv.v_buffer[1][slots].view(3, page_size, 2, 8), data[:, 1, 1])
    dev.free(h)
    assert dev.used_pages == 0 and dev.free_pages == dev.pool_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_deferred_frees_reach_the_allocator_once_and_count_as_free_meanwhile(page_size):
    """Inside `deferred_frees` an eviction's node-by-node frees are collected: `free_pages` counts
    them at once, the allocator gets them in one call at the end, and an allocation made meanwhile
    can use them (the collected pages are handed over first)."""
    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    alloc = _pools(page_size)
    dev = SGLangDevicePool(alloc)
    n = dev.pool_pages
    held = dev.allocate([b"k"] * n)
    assert held is not None and dev.free_pages == 0
    calls = []  # pages per allocator call (a plain allocator is given page ids: `free_page_ids`)
    real_free = alloc.free_page_ids
    alloc.free_page_ids = lambda ids: (calls.append(ids.numel()), real_free(ids))[1]
    with dev.deferred_frees():
        with dev.deferred_frees():  # re-entrant: the outer block gives them back
            for i in range(0, 6, 2):
                dev.free(held[i : i + 2])
        assert calls == [] and dev.free_pages == 6 and dev.used_pages == n - 6
        assert int(alloc.available_size()) == 0
        again = dev.allocate([b"k"] * 6)  # needs the collected pages: they go back first
        assert again is not None and sorted(again) == sorted(held[:6])
        assert calls == [6]
        dev.free(again[:3])
    assert calls == [6, 3] and dev.free_pages == 3
    dev.free(held[6:])
    assert dev.free_pages == n - 3 and len(calls) == 3  # outside the block: at once


def test_a_page_freed_twice_is_refused_inside_and_outside_deferred_frees():
    """A double free never reaches SGLang's allocator (its free list would hand the page out twice):
    outside the block at the call; inside it, over the whole batch when it is given back, so two
    frees of one page by different evictions of one scheduler call are caught too."""
    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    alloc = _pools(1)
    dev = SGLangDevicePool(alloc)
    held = dev.allocate([b"k"] * 4)
    assert held is not None
    before = int(alloc.available_size())
    with pytest.raises(KeyError, match="same page twice"):
        dev.free([held[0], held[0]])
    assert int(alloc.available_size()) == before

    def two_evictions_in_one_call() -> None:
        with dev.deferred_frees():
            dev.free(held[:2])
            dev.free(held[1:3])  # held[1] again, in another call

    with pytest.raises(KeyError, match="same page twice"):
        two_evictions_in_one_call()
    assert int(alloc.available_size()) == before and dev.used_pages == 4  # the batch was refused whole


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_demotes_and_loads_back_exact_kv(tmp_path, page_size):
    """insert -> evict (device -> host -> disk) -> match reports host+disk -> init_load_back queues the
    same bytes back into device slots, layer by layer, there once the counter says so."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    alloc = _pools(page_size, size=64)
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size
    )
    # eviction_demotes="all": this checks the synchronous demotion chain (the server default, "none",
    # never copies on eviction)
    settings = BackendSettings(
        host_tokens=64, disk_dir=str(tmp_path / "disk"), disk_tokens=1024, prefetch=True, eviction_demotes="all"
    )
    cache = TieredRadixCache(params, settings, debug=DebugSettings(check_invariants=True))
    try:
        tokens = array("q", range(100, 148))  # 48 tokens
        slots = alloc.alloc(48)
        kv = alloc.get_kvcache()
        for layer in range(2):
            kv.k_buffer[layer][slots] = torch.randn(48, 2, 8).to(torch.bfloat16)
            kv.v_buffer[layer][slots] = torch.randn(48, 2, 8).to(torch.bfloat16)
        before = [kv.k_buffer[1][slots].clone(), kv.v_buffer[0][slots].clone()]
        r = cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        assert r.prefix_len == 0 and cache.evictable_size() == 48 and cache.protected_size() == 0
        assert cache.evict(EvictParams(num_tokens=48)).num_tokens_evicted == 48
        # push its host copy to disk: fill the host tier with another sequence
        other = array("q", range(500, 532))
        s2 = alloc.alloc(32)
        cache.insert(InsertParams(key=RadixKey(other), value=s2))
        cache.evict(EvictParams(num_tokens=32))
        assert alloc.available_size() == 64 and cache.total_size() == 0
        req = queued_request("r1", tokens)
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
        assert m.device_prefix_len == 0 and m.host_hit_length == 48
        req.last_node = m.last_device_node
        loaded = None
        for _ in range(200):  # the disk part is being prefetched to host: "retry next round"
            loaded = cache.init_load_back(
                InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=48, req=req)
            )
            if loaded is not None:
                break
            import time

            time.sleep(0.01)
        assert loaded is not None and loaded[0] == 48
        assert req.storage_hit_length > 0 and req.storage_hit_start == 48 - req.storage_hit_length
        new_slots = cache.path_device_indices(loaded[1])
        assert len(new_slots) == 48
        assert (cache.layer_loads is not None and cache.layer_loads.inflight) or cache.layer_loads.loads == 1
        for layer in range(2):  # the layer-wise load: what SGLang's KV pool calls before reading a layer
            cache.layer_loads.wait_until(layer)
        assert torch.equal(kv.k_buffer[1][new_slots], before[0]) and torch.equal(kv.v_buffer[0][new_slots], before[1])
        acct = cache.pool_accounting()
        assert acct["check"] == "ok" and acct["request_held_tokens"] == 0, acct
    finally:
        cache.shutdown()


def test_plugin_registers_once():
    from sglang.srt.mem_cache import registry

    from sgl_hicache.sglang import plugin

    plugin.register()
    plugin.register()
    assert "sgl_hicache" in registry.registered_radix_cache_backends()
    assert plugin.register_backend() is False  # already there: no double registration


@pytest.mark.parametrize("page_size", [1, 16])
def test_layered_moves_on_the_real_pool_are_bit_exact(monkeypatch, page_size):
    """`layered_device_host` (the per-layer gather/scatter taken above 3 MiB per call) on SGLang's own
    MHATokenToKVPool: device pages -> scattered, shuffled host slots -> other scattered device pages,
    every bit where SGLang's attention reads it (its k_buffer / v_buffer rows), nothing else touched."""
    import random

    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_hicache.sglang.device_pool import SGLangDevicePool
    from sgl_hicache.tiers.base import DEVICE, HOST
    from sgl_hicache.tiers.memory import HostKVBuffer
    from sgl_hicache.transfer import handlers
    from sgl_hicache.transfer.ops import TransferOp
    from sgl_hicache.tree.node import TreeNode

    layers, heads, dim = 4, 8, 128  # 16 KiB of KV per token
    tokens, host_tokens, op_tokens = 2048, 1024, 320  # one op: 5 MiB
    pool = MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    alloc = SimpleNamespace(page_size=page_size, size=tokens, get_kvcache=lambda: pool, available_size=lambda: tokens)
    dev = SGLangDevicePool(alloc)
    host = HostKVBuffer(dev.layout, page_size, host_tokens // page_size)
    n = op_tokens // page_size
    assert n * dev.page_bytes > handlers._LAYERED_MIN_BYTES  # per call: the layered path, not the fallback

    generic_calls = []
    real_generic = handlers.copy_via_tensor

    def spying_generic(stores):
        inner = real_generic(stores)

        def handler(op, start, stop):
            generic_calls.append((op.src, start, stop))
            inner(op, start, stop)

        return handler

    monkeypatch.setattr(handlers, "copy_via_tensor", spying_generic)
    stores = {DEVICE: dev, HOST: host}
    to_host = handlers.layered_device_host(stores, DEVICE, HOST)
    to_device = handlers.layered_device_host(stores, HOST, DEVICE)

    def op(src, src_handles, dst_handles):
        return TransferOp(
            TreeNode(None, (), [], 0), src, HOST if src == DEVICE else DEVICE, src_handles, dst_handles, 0, "demote"
        )

    def rows(layer: int, kv: int, pages) -> torch.Tensor:
        """What SGLang's attention reads for `pages`: its own buffer rows, as (pages, page tokens, heads, dim) bits."""
        buf = (pool.k_buffer if kv == 0 else pool.v_buffer)[layer]
        return buf[dev.token_slots(pages)].view(torch.int16).view(len(pages), page_size, heads, dim)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.int16)

    rng = random.Random(page_size)
    pages = range(1, dev.pool_pages)  # SGLang's page 0 is its padding page
    d_pages = rng.sample(pages, n)  # scattered and shuffled
    h_pages = rng.sample(range(host.capacity_pages), n)
    back = rng.sample([p for p in pages if p not in set(d_pages)], n)
    g = torch.Generator().manual_seed(page_size)
    # random bit patterns (NaN payloads included): a copy that goes through arithmetic or drops a byte shows
    data = torch.randint(-(2**15), 2**15, (n, *dev.page_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)
    for layer in range(layers):  # fill SGLang's buffers, then put the data in through them
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buf.shape, dtype=torch.int16, generator=g))
        slots = dev.token_slots(d_pages)
        pool.k_buffer[layer][slots] = data[:, layer, 0].reshape(-1, heads, dim)
        pool.v_buffer[layer][slots] = data[:, layer, 1].reshape(-1, heads, dim)
    host.buffer.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, host.buffer.shape, dtype=torch.int16, generator=g)
    )
    host_before = bits(host.buffer).clone()
    device_before = [[bits(b).clone() for b in (pool.k_buffer[layer], pool.v_buffer[layer])] for layer in range(layers)]

    to_host(op(DEVICE, d_pages, h_pages), 0, n)
    assert torch.equal(bits(host.read(h_pages)), bits(data))
    untouched = sorted(set(range(host.capacity_pages)) - set(h_pages))
    assert torch.equal(bits(host.buffer)[untouched], host_before[untouched])

    to_device(op(HOST, h_pages, back), 0, n)
    for layer in range(layers):
        for kv in (0, 1):
            assert torch.equal(rows(layer, kv, back), bits(data[:, layer, kv])), (layer, kv)
            assert torch.equal(rows(layer, kv, d_pages), bits(data[:, layer, kv])), (
                layer,
                kv,
            )  # the source is only read
    touched = set(dev.token_slots(back).tolist())
    others = torch.tensor([s for s in range(pool.k_buffer[0].shape[0]) if s not in touched])
    for layer in range(layers):
        for kv in (0, 1):
            now = bits((pool.k_buffer if kv == 0 else pool.v_buffer)[layer])
            assert torch.equal(now[others], device_before[layer][kv][others]), (layer, kv)
    assert generic_calls == [], generic_calls  # every call above took the per-layer path


def test_layer_loads_through_sglangs_own_kv_pool_read_path():
    """`LayerLoads` registered as SGLang's layer transfer counter: `MHATokenToKVPool.get_key_buffer(i)`
    (what the attention backend calls) waits for layer i of the queued load, and sees the host bytes."""
    import torch

    from sgl_hicache.cache import TieredCache
    from sgl_hicache.config import CacheConfig
    from sgl_hicache.sglang.device_pool import SGLangDevicePool
    from sgl_hicache.sglang.layer_loads import LayerLoads
    from sgl_hicache.tiers.base import DEVICE, HOST

    ps = 16
    alloc = _pools(ps)
    dev = SGLangDevicePool(alloc)
    cache = TieredCache(
        CacheConfig(dev.layout, device_tokens=dev.pool_pages * ps, host_tokens=8 * ps, page_size=ps, **SYNCHRONOUS),
        device=dev,
    )
    loads = LayerLoads(cache)
    kv = alloc.get_kvcache()
    kv.register_layer_transfer_counter(loads)
    host = cache.stores[HOST]
    h_slots = host.allocate([b"a", b"b"])
    d_slots = dev.allocate([b"a", b"b"])
    data = torch.randn((2, *dev.page_shape)).to(torch.bfloat16)
    host.write(h_slots, data)
    from sgl_hicache.transfer.ops import TransferOp

    node = cache.tree.root  # any node: the lock is what LayerLoads takes (root locks are no-ops)
    op = TransferOp(node, HOST, DEVICE, list(h_slots), list(d_slots), 0, "demand")
    loads.queue([op])
    assert op.executed.is_set()
    loads.set_consumer(loads.batch_index())
    for layer in range(dev.layout.num_layers):
        k = kv.get_key_buffer(layer)  # waits for this layer only
        rows = dev.token_slots(d_slots)
        assert torch.equal(k[rows].view(torch.int16), data[:, layer, 0].reshape(-1, *k.shape[1:]).view(torch.int16))
    loads.finish_all()
    assert not loads.inflight


def _admission_cache():
    """A backend with only what the admission hook reads: settings, counters, the deferred and held rids."""
    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.backend import BackendCounters, TieredRadixCache

    cache = object.__new__(TieredRadixCache)
    cache.settings, cache.counters, cache.deferred_rid, cache.held_rids = (
        BackendSettings(),
        BackendCounters(),
        None,
        set(),
    )
    return cache


def _waiting_request(prompt_tokens: int, max_new_tokens: int):
    """A waiting request as `add_one_req` sizes it: nothing cached, nothing decoded."""
    return SimpleNamespace(
        rid="r1",
        full_untruncated_fill_ids=list(range(prompt_tokens)),
        prefix_len=0,
        output_ids=[],
        sampling_params=SimpleNamespace(max_new_tokens=max_new_tokens),
    )


def test_admission_hook_skips_only_a_request_told_to_retry():
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.scheduler_hooks import keep_admitting

    cache = _admission_cache()
    adder = SimpleNamespace(tree_cache=cache, can_run_list=[])
    req = SimpleNamespace(rid="r1")

    def retry(adder, req, *a, **k):  # what add_one_req does when init_load_back answers None
        cache.deferred_rid = req.rid
        return AddReqResult.OTHER

    def full(adder, req, *a, **k):
        return AddReqResult.OTHER

    assert keep_admitting(retry, adder, req, False, None) == AddReqResult.CONTINUE
    assert cache.counters.admission_skips == 1 and cache.deferred_rid is None
    assert keep_admitting(full, adder, req, False, None) == AddReqResult.OTHER  # other reasons still stop
    cache.settings = BackendSettings(skip_waiting_admission=False)
    assert keep_admitting(retry, adder, req, False, None) == AddReqResult.OTHER
    other = SimpleNamespace(tree_cache=object(), can_run_list=[])  # another radix cache: untouched
    assert keep_admitting(retry, other, req, False, None) == AddReqResult.OTHER


def test_admission_hook_yields_prefetch_locks_to_a_request_short_of_room_and_retries_it():
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sgl_hicache.sglang.scheduler_hooks import keep_admitting

    cache = _admission_cache()
    asked = []
    cache.yield_to_demand = lambda req, short: asked.append(short) or (1 if short > 0 else 0)
    adder = SimpleNamespace(
        tree_cache=cache, can_run_list=[], rem_total_tokens=100, per_req_token_overhead=0, page_size=1
    )
    req = _waiting_request(300, max_new_tokens=10)
    calls = []

    def no_room_then_fits(adder, req, *a, **k):
        calls.append(1)
        return AddReqResult.NO_TOKEN if len(calls) == 1 else AddReqResult.CONTINUE

    assert keep_admitting(no_room_then_fits, adder, req, False, None) == AddReqResult.CONTINUE
    assert asked == [300 + 10 + 1 - 100] and len(calls) == 2  # the controller was asked for the shortfall, then a retry
    calls.clear()
    adder.rem_total_tokens = 1000  # refused for another reason: nothing yielded, no retry
    assert keep_admitting(no_room_then_fits, adder, req, False, None) == AddReqResult.NO_TOKEN and len(calls) == 1


def test_admission_hook_never_retries_a_request_already_committed():
    # add_one_req answers NO_TOKEN after committing a request when the budget left is too small for
    # the next candidate: the request holds a tree lock now. A retry would commit it again and take
    # a second lock that nothing releases (its pages protected for good: on a small device pool no
    # later request fits, and admission stalls)
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sgl_hicache.sglang.scheduler_hooks import keep_admitting

    cache = _admission_cache()
    asked = []
    cache.yield_to_demand = lambda req, short: asked.append(short) or 1
    adder = SimpleNamespace(
        tree_cache=cache, can_run_list=[], rem_total_tokens=0, per_req_token_overhead=0, page_size=1
    )
    req = _waiting_request(300, max_new_tokens=10)
    locks = []

    def commit_then_budget_full(adder, req, *a, **k):
        locks.append(req.rid)  # `_commit_prefill_admission`: req.lock = tree_cache.lock(req.last_node)
        adder.can_run_list.append(req)
        return AddReqResult.NO_TOKEN

    assert keep_admitting(commit_then_budget_full, adder, req, False, None) == AddReqResult.NO_TOKEN
    assert locks == ["r1"] and adder.can_run_list == [req] and asked == []  # one commit, one lock


@pytest.mark.parametrize(
    "change, words",
    [
        ({"pp_size": 2}, ("pipeline parallelism", "pp_size=2", "Instead: --pp-size 1")),
        ({"pp_size": 2, "enable_dp_attention": True, "dp_size": 2}, ("pipeline parallelism", "pp_size=2")),
    ],
)
def test_factory_refuses_pp_with_a_clear_message(change, words):
    from sgl_hicache.sglang.factory import factory

    sa = SimpleNamespace(enable_dp_attention=False, dp_size=1, pp_size=1)
    for k, v in change.items():
        setattr(sa, k, v)
    ctx = SimpleNamespace(
        enable_hierarchical_cache=False,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        is_dsa=False,
        tp_size=2,
        tp_rank=0,
        server_args=sa,
    )
    with pytest.raises(ValueError, match="--radix-cache-backend sgl_hicache") as e:
        factory(ctx)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "DP" not in str(e.value) and "dp_size" not in str(e.value), str(e.value)  # DP is served


def test_hint_api_demotes_and_pins_through_the_scheduler_step(tmp_path):
    """POST /hints on the backend's hint API: the hints are applied on the scheduler's step
    (`before_batch_formed`), not on the listener's thread; a demoted prefix is evicted first, a
    pinned one is not evicted until its pin ends; a token outside the vocabulary is refused."""
    import json
    import urllib.error
    import urllib.request

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    alloc = _pools(16, size=128)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=16)
    cache = TieredRadixCache(
        params, BackendSettings(host_tokens=256, disk_tokens=0, hint_port=0), vocab_size=1000
    ).start()

    def post(hints):
        req = urllib.request.Request(
            f"http://127.0.0.1:{cache.hint_listener.port}/hints",
            method="POST",
            data=json.dumps({"hints": hints}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def device_tokens(seq):
        req = SimpleNamespace(
            rid="m",
            prefix_len=0,
            full_untruncated_fill_ids=seq + array("q", [7]),
            last_node=None,
            storage_hit_length=0,
            storage_hit_start=None,
        )
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(seq), req=req)).device_prefix_len

    try:
        old, new, third = array("q", range(100, 132)), array("q", range(200, 232)), array("q", range(300, 332))
        for seq in (old, third, new):  # `new` is the most recent: LRU alone would evict `third` first
            cache.insert(InsertParams(key=RadixKey(seq), value=alloc.alloc(32)))
        assert post(
            [{"action": "demote", "input_ids": list(new)}, {"action": "pin", "input_ids": list(old), "ttl_s": 60}]
        ) == (202, {"queued": 2})
        assert cache.controller.hints.counts["demote"] == 0  # nothing applied on the listener's thread
        cache.before_batch_formed()
        assert cache.controller.hints.counts == {"prefetch": 0, "pin": 1, "retain": 0, "demote": 1}
        assert cache.evict(EvictParams(num_tokens=32)).num_tokens_evicted == 32
        # the demoted prefix went first although it is the most recent (`old`, the oldest, is retained)
        assert device_tokens(new) == 0 and device_tokens(old) == 32 and device_tokens(third) == 32
        cache.evict(EvictParams(num_tokens=32))
        assert device_tokens(old) == 32 and device_tokens(third) == 0  # retained: kept over an older one
        code, out = post([{"action": "retain", "input_ids": [5, 1000]}])
        assert code == 400 and "outside the vocabulary" in out["error"]
        with urllib.request.urlopen(f"http://127.0.0.1:{cache.hint_listener.port}/hints", timeout=5) as r:
            status = json.loads(r.read())
        assert status["applied"]["pin"] == 1 and status["pins"] == 1 and status["pinned_tokens"] == 32
        # past the retention book's size a pin is refused when applied: counted once, reason kept
        from sgl_hicache.policy.hint_rules import HintLimits

        cache.controller.hints.limits = HintLimits(max_retained=2)
        assert post([{"action": "pin", "input_ids": list(old), "ttl_s": 60}] * 2)[0] == 202
        cache.before_batch_formed()
        with urllib.request.urlopen(f"http://127.0.0.1:{cache.hint_listener.port}/hints", timeout=5) as r:
            status = json.loads(r.read())
        assert (
            status["applied"]["pin"] == 2 and status["rejected"] == 1 and "retained already" in status["last_error"]
        ), status
    finally:
        cache.shutdown()
    assert cache.hint_listener is None


def test_hint_api_is_refused_at_tp_above_one():
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_pools(16, size=64), page_size=16
    )
    with pytest.raises(ValueError, match=r"hint API .* not supported with --tp > 1"):
        TieredRadixCache(params, BackendSettings(host_tokens=64, disk_tokens=0, hint_port=0), consensus=object())


def test_a_formed_batch_admits_its_requests_once(tmp_path):
    """AFTER `get_new_batch_prefill`: the batch's requests left the queue, so the controller measures
    each one's queueing delay (first match -> batch) once; the predictor's lead test reads it."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache
    from sgl_hicache.sglang.scheduler_hooks import set_consumer_index

    alloc = _pools(16, size=64)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=16)
    cache = TieredRadixCache(params, BackendSettings(host_tokens=64), debug=DebugSettings(check_invariants=True))
    try:
        clock = [10.0]
        cache.controller.clock = lambda: clock[0]
        tokens = array("q", range(100, 132))
        req = SimpleNamespace(rid="r1", prefix_len=0, full_untruncated_fill_ids=tokens, last_node=None)
        cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))  # its first match: the ticket
        clock[0] = 12.5
        plan = SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[req]))
        scheduler = SimpleNamespace(tree_cache=cache)
        assert set_consumer_index(plan, scheduler) is plan
        assert cache.controller.queue_delay.samples == 1 and cache.controller.queue_delay.seconds == 2.5
        clock[0] = 20.0
        set_consumer_index(plan, scheduler)  # a chunked request in the next batch too: not again
        set_consumer_index(SimpleNamespace(batch_to_run=None), scheduler)  # a step with no prefill batch
        assert cache.controller.queue_delay.samples == 1
    finally:
        cache.shutdown()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_queued_request_starts_its_disk_read_at_arrival(tmp_path, prefetch):
    """The hook after `Scheduler._prefetch_kvcache` makes a new request's first match when SGLang
    queues it: its disk-only pages start coming up to host then, before any batch is formed. With
    prefetch off nothing is matched (nothing would bring them up)."""
    from types import SimpleNamespace as NS

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.backend import TieredRadixCache
    from sgl_hicache.sglang.scheduler_hooks import match_on_arrival

    alloc = _pools(16, size=64)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=16)
    settings = BackendSettings(
        host_tokens=64, disk_dir=str(tmp_path / "disk"), disk_tokens=1024, prefetch=prefetch, eviction_demotes="all"
    )
    cache = TieredRadixCache(params, settings)
    try:
        tokens = array("q", range(100, 148))
        cache.insert(InsertParams(key=RadixKey(tokens), value=alloc.alloc(48)))
        cache.evict(EvictParams(num_tokens=48))
        other = array("q", range(500, 564))  # fills the host tier: the first sequence goes to disk only
        cache.insert(InsertParams(key=RadixKey(other), value=alloc.alloc(64)))
        cache.evict(EvictParams(num_tokens=64))
        probe = cache.cache.match(tokens, touch=False)
        assert probe.disk_tokens == 48 and probe.host_tokens == 0 and probe.device_tokens == 0
        req = Req("arrival", "", tokens + array("q", [7]), SamplingParams(max_new_tokens=1))
        scheduler = NS(tree_cache=cache)
        assert match_on_arrival("kept", scheduler, req) == "kept"
        state = cache.req_states.get("arrival")
        if prefetch:
            assert state is not None and state.ticket is not None and state.ticket.job is not None
            assert req.host_hit_length == 48  # SGLang's own fields, set by the match
        else:
            assert state is None and cache.counters.matches == 0
        assert match_on_arrival("kept", NS(tree_cache=object()), req) == "kept"  # another tree cache: untouched
    finally:
        cache.shutdown()


def test_disk_pages_are_promised_only_while_a_prefetch_brings_them_up(tmp_path):
    """A match promises disk-only pages to SGLang only while a prefetch is bringing them to host (the
    job keeps the path locked until the load). When the guard refuses the prefetch, the promise stops
    at the host part, and `init_load_back` loads that part instead of declining the whole hit."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    alloc = _pools(16, size=64)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=16)
    settings = BackendSettings(
        host_tokens=64, disk_dir=str(tmp_path / "disk"), disk_tokens=1024, prefetch=True, eviction_demotes="all"
    )
    cache = TieredRadixCache(params, settings, debug=DebugSettings(check_invariants=True))
    try:
        tokens = array("q", range(100, 148))  # 48 tokens in two nodes: a 16-token head, a 32-token tail
        cache.insert(InsertParams(key=RadixKey(tokens[:16]), value=alloc.alloc(16)))
        cache.insert(InsertParams(key=RadixKey(tokens), value=alloc.alloc(48)))
        cache.evict(EvictParams(num_tokens=64))  # both to host (48 of its 64 tokens)
        other = array("q", range(500, 532))  # needs 32 host tokens: the tail leaf goes down to disk
        cache.insert(InsertParams(key=RadixKey(other), value=alloc.alloc(32)))
        cache.evict(EvictParams(num_tokens=32))
        probe = cache.cache.match(tokens, touch=False)
        assert (probe.device_tokens, probe.host_tokens, probe.disk_tokens) == (0, 16, 32)
        cache.controller.speculation.guard.prefetch_fits = lambda *a, **k: False  # the policy's answer
        req = queued_request("r1", tokens)
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
        assert cache.controller.prefetch_skipped == 1 and cache.counters.prefetch_jobs == 0
        assert m.device_prefix_len == 0 and m.host_hit_length == 16  # nothing brings the disk part up
        req.last_node = m.last_device_node
        loaded = cache.init_load_back(
            InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=16, req=req)
        )
        assert loaded is not None and loaded[0] == 16 and len(cache.path_device_indices(loaded[1])) == 16
        assert cache.counters.load_back_declined == 0, cache.counters.extra
    finally:
        cache.shutdown()
