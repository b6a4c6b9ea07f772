"""Every supported pool kind on SGLang's REAL pool classes (CPU, no server): fp8 MHA pools
(`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`) and MLA pools (`MLATokenToKVPool`, DeepSeek's latent + rope).

Each round trip goes through the real backend (`TieredRadixCache`) and its device-pool adapter:
bytes written into SGLang's own buffers -> evicted to host -> pushed to disk -> loaded back into
other device slots, bit for bit; then again from disk after a restart (a new pool and cache on the
same directory). MLA at --tp 2 is one copy for the group. The refusals of the kinds not served name the
kind and what to run instead.
"""

from __future__ import annotations

import time
from array import array
from types import SimpleNamespace

import pytest
from queued_request import queued_request

PAGE, POOL_TOKENS, LAYERS = 4, 64, 3
KINDS = ["mha-fp8_e4m3", "mha-fp8_e5m2", "mla-bf16", "mla-fp8_e4m3"]


def _pool(kind: str):
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    arch, dtype_name = kind.split("-")
    dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype_name]
    if arch == "mha":
        pool = MHATokenToKVPool(
            size=POOL_TOKENS,
            page_size=PAGE,
            dtype=dtype,
            head_num=2,
            head_dim=8,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
    else:  # DeepSeek-shaped: kv_lora_rank 512 / rope 64, scaled down
        pool = MLATokenToKVPool(
            size=POOL_TOKENS,
            page_size=PAGE,
            dtype=dtype,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
    return PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, dtype, "cpu", pool, need_sort=False)


def _raw_buffers(kvcache) -> list:
    """SGLang's own per-layer buffers, as stored (fp8 is stored as uint8)."""
    if hasattr(kvcache, "kv_buffer"):
        return list(kvcache.kv_buffer)
    return list(kvcache.k_buffer) + list(kvcache.v_buffer)


def _fill(alloc, n: int, seed: int):
    """Allocate `n` token slots and write random bytes into every buffer's rows there."""
    import torch

    slots = alloc.alloc(n)
    g = torch.Generator().manual_seed(seed)
    for buf in _raw_buffers(alloc.get_kvcache()):
        raw = buf.view(torch.uint8)
        raw[slots] = torch.randint(0, 256, (n, *raw.shape[1:]), generator=g, dtype=torch.uint8)
    return slots


def _bytes_at(alloc, slots):
    import torch

    return [buf.view(torch.uint8)[slots].clone() for buf in _raw_buffers(alloc.get_kvcache())]


def _cache(alloc, disk_dir):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE)
    settings = BackendSettings(
        host_tokens=64, disk_dir=str(disk_dir), disk_tokens=1024, prefetch=True, eviction_demotes="all"
    )
    return TieredRadixCache(params, settings, debug=DebugSettings(check_invariants=True))


def _load_back(cache, tokens, n: int, layers: int = LAYERS):
    """match -> init_load_back (retrying while the disk part is prefetched) -> wait for every layer:
    the device slots the tree now holds the prompt's pages in."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    req = queued_request(f"r{time.monotonic_ns()}", tokens)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
    assert m.device_prefix_len == 0 and m.host_hit_length == n
    req.last_node = m.last_device_node
    loaded = None
    for _ in range(500):
        loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=n, req=req))
        if loaded is not None:
            break
        time.sleep(0.01)
    assert loaded is not None and loaded[0] == n
    if cache.layer_loads is not None:
        for layer in range(layers):
            cache.layer_loads.wait_until(layer)
    return req, cache.path_device_indices(loaded[1])


@pytest.mark.parametrize("kind", KINDS)
def test_real_pool_round_trips_device_host_disk_device_bit_for_bit(tmp_path, kind):
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.tiers.base import DISK

    alloc = _pool(kind)
    cache = _cache(alloc, tmp_path / "disk")
    arch, dtype_name = kind.split("-")
    layout = cache.device_pool.layout
    assert cache.device_pool.adapter.kind == arch
    assert layout.kv_planes == (1 if arch == "mla" else 2)
    assert layout.dtype == {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[dtype_name]
    try:
        tokens = array("q", range(100, 148))  # 12 pages
        slots = _fill(alloc, 48, seed=1)
        before = _bytes_at(alloc, slots)
        cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        assert cache.evict(EvictParams(num_tokens=48)).num_tokens_evicted == 48  # -> host
        other = array("q", range(500, 532))
        cache.insert(InsertParams(key=RadixKey(other), value=_fill(alloc, 32, seed=2)))
        cache.evict(EvictParams(num_tokens=32))  # fills host: the first prompt's pages -> disk
        assert alloc.available_size() == POOL_TOKENS and cache.total_size() == 0
        assert cache.cache.stores[DISK].used_pages >= 1
        for buf in _raw_buffers(alloc.get_kvcache()):  # nothing left on the device to mistake for a load
            buf.zero_()
        req, new_slots = _load_back(cache, tokens, 48)
        assert req.storage_hit_length > 0  # part of it came from disk
        after = _bytes_at(alloc, new_slots)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), "KV bytes changed on the round trip"
        disk_pages = cache.cache.stores[DISK].used_pages
    finally:
        cache.shutdown()
    # a restart: a fresh pool and cache over the same directory serve the prompt from disk alone
    alloc2 = _pool(kind)
    cache2 = _cache(alloc2, tmp_path / "disk")
    try:
        assert cache2.cache.stores[DISK].used_pages == disk_pages
        req, new_slots = _load_back(cache2, tokens, 48)
        assert req.storage_hit_length == 48
        after = _bytes_at(alloc2, new_slots)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), "KV bytes changed across the restart"
    finally:
        cache2.shutdown()


def test_pages_of_another_kv_dtype_are_never_found(tmp_path):
    """fp8_e4m3 and fp8_e5m2 pages have the same size: the namespace (and so every key) differs by the
    dtype, so a server of the other dtype on the same directory finds none of them."""
    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.sglang.assembly import cache_config
    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    s = BackendSettings(host_tokens=64, disk_dir=str(tmp_path), disk_tokens=1024)
    a = cache_config(s, SGLangDevicePool(_pool("mha-fp8_e4m3")), PAGE)
    b = cache_config(s, SGLangDevicePool(_pool("mha-fp8_e5m2")), PAGE)
    assert a.layout.bytes_per_token == b.layout.bytes_per_token
    assert a.tenant_salt == b.tenant_salt
    from sgl_hicache.hashing import Namespace

    assert Namespace.for_model(a.layout, PAGE).root != Namespace.for_model(b.layout, PAGE).root


def test_mla_is_one_plane_of_the_latent_width_and_half_an_mha_page_per_head():
    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    dev = SGLangDevicePool(_pool("mla-bf16"))
    assert dev.page_shape == (LAYERS, 1, PAGE, 1, 40)  # 32 latent + 8 rope
    assert dev.layout.bytes_per_token == LAYERS * 40 * 2
    assert dev.adapter.replicated_across_tp


def test_refusals_name_the_kind_and_what_to_run_instead():
    from sgl_hicache.sglang.coverage import REFUSED
    from sgl_hicache.sglang.factory import unsupported

    sa = SimpleNamespace(enable_dp_attention=True, dp_size=2, pp_size=2)  # DP is served: only PP is refused
    ctx = SimpleNamespace(
        enable_hierarchical_cache=True, is_hybrid_swa=True, is_hybrid_ssm=True, is_dsa=True, server_args=sa
    )
    problems = unsupported(ctx)
    assert not any("DP" in p or "dp_size" in p for p in problems), problems
    for kind in ("sglang_hicache", "mamba", "dsa", "pp"):
        r = REFUSED[kind]
        assert any(r.what in p and "Instead: " + r.instead in p for p in problems), (kind, problems)
    assert (
        unsupported(
            SimpleNamespace(
                enable_hierarchical_cache=False, is_hybrid_swa=True, is_hybrid_ssm=False, server_args=SimpleNamespace()
            )
        )
        == []
    )  # SWAKVPool: served


def test_a_pool_with_a_kv_quant_method_is_refused_naming_it():
    """SGLang's CPU fp8 pool (`CPUFP8KVCacheMethod`, what `--kv-cache-dtype fp8_e4m3` builds on a CPU
    with AMX) quantises through a method of its own: refused, naming the method and what to run."""
    import torch
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import CPUFP8KVCacheMethod
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_hicache.sglang.kinds.pool_adapters import UnsupportedPool, adapter_for

    pool = MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE,
        dtype=torch.float8_e4m3fn,
        head_num=2,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
        quant_method=CPUFP8KVCacheMethod(),
    )
    with pytest.raises(UnsupportedPool, match=r"CPUFP8KVCacheMethod.*Instead: on a GPU --kv-cache-dtype fp8_e4m3"):
        adapter_for(pool)


def test_mla_at_tp2_is_one_copy_for_the_group_with_rank_free_keys(tmp_path):
    """MLA's latent is the same on every TP rank: at --tp 2 the page keys carry no rank and no TP size
    (the namespace equals TP=1's), the ranks share one directory, and the host budget is the group's
    (not multiplied by the TP size). An MHA shard keeps its rank's directory and the tp salt. The two
    ranks serving: tests/server/test_sglang_e2e_mla.py::test_mla_tp2_one_rank_writes_both_read."""
    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.hashing import Namespace
    from sgl_hicache.sglang.assembly import cache_config
    from sgl_hicache.sglang.device_pool import SGLangDevicePool
    from sgl_hicache.sglang.parallel.rank_consensus import RankConsensus

    s = BackendSettings(host_tokens=64, disk_dir=str(tmp_path / "disk"), disk_tokens=1024)
    mla = SGLangDevicePool(_pool("mla-bf16"))
    one = cache_config(s, mla, PAGE)
    for rank in (0, 1):
        rc = RankConsensus(None, rank, 2)  # (no collective is made here)
        rc.replicate()
        two = cache_config(s, mla, PAGE, consensus=rc)
        assert (
            Namespace.for_model(two.layout, PAGE, two.tenant_salt).root
            == Namespace.for_model(one.layout, PAGE, one.tenant_salt).root
        )
        assert two.disk_dir == tmp_path / "disk" / "tp2-shared" and two.host_tokens == one.host_tokens
        assert rc.counts.role == ("leader" if rank == 0 else "follower")
    shard = cache_config(s, SGLangDevicePool(_pool("mha-fp8_e4m3")), PAGE, consensus=RankConsensus(None, 1, 2))
    assert shard.disk_dir == tmp_path / "disk" / "tp2-rank1" and "tp=2" in shard.tenant_salt
