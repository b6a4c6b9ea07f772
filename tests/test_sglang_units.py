"""The SGLang backend's parts against SGLang's real pool classes, without a server (fast)."""

from __future__ import annotations

import importlib.util
from array import array
from types import SimpleNamespace

import pytest

_missing = importlib.util.find_spec("sglang") is None
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(_missing, reason="sglang is not installed (scripts/install_sglang_cpu.sh)")]


def _pools(page_size: int, size: int = 256):
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=2,
                            device="cpu", enable_memory_saver=False, enable_alt_stream=False)
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
def test_backend_demotes_and_loads_back_exact_kv(tmp_path, page_size):
    """insert -> evict (device -> host -> disk) -> match reports host+disk -> init_load_back puts the
    same bytes back into device slots before it returns."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.sglang.backend import TieredRadixCache
    from sgl_hicache.sglang.settings import BackendSettings

    alloc = _pools(page_size, size=64)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size)
    settings = BackendSettings(host_tokens=64, disk_dir=str(tmp_path / "disk"), disk_tokens=1024, check_invariants=True, prefetch=True)
    cache = TieredRadixCache(params, settings)
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
        req = SimpleNamespace(rid="r1", prefix_len=0, full_untruncated_fill_ids=tokens + array("q", [7]), last_node=None,
                              storage_hit_length=0, storage_hit_start=None)
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
        assert m.device_prefix_len == 0 and m.host_hit_length == 48
        req.last_node = m.last_device_node
        loaded = None
        for _ in range(200):  # the disk part is being prefetched to host: "retry next round"
            loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=48, req=req))
            if loaded is not None:
                break
            import time

            time.sleep(0.01)
        assert loaded is not None and loaded[0] == 48
        assert req.storage_hit_length > 0 and req.storage_hit_start == 48 - req.storage_hit_length
        new_slots = cache.path_device_indices(loaded[1])
        assert len(new_slots) == 48
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
