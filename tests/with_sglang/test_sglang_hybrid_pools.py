"""Hybrid models' pools on SGLang's REAL classes (CPU, no server): the sliding-window pool
(`SWAKVPool` + `SWATokenToKVPoolAllocator`: gpt-oss, Gemma 2/3) and the Mamba / linear-attention pool
(`HybridLinearKVPool` + `MambaPool`: Qwen3-Next, Nemotron-H).

- SWA: pages (every layer; the full-attention layers' bytes checked here, all layers in
  tests/server/test_sglang_swa.py) round-trip through the real backend (device -> host -> disk -> device,
  and from disk after a restart) bit for bit, and the window layers' rows, addressed through
  SGLang's full -> window slot mapping, round-trip through the host and disk stores.
- Mamba: the attention layers' pages round-trip through the real backend the same way, and each
  request slot's recurrent state round-trips as one snapshot (`MambaStateAdapter`) device -> host ->
  disk -> device (and from disk after a restart) into other slots, equal to SGLang's own
  `get_cpu_copy` of the original slots; the snapshot's size is SGLang's own `mamba_cache_per_req`.
SWA is served (tests/server/test_sglang_swa.py); Mamba stays refused (docs/sglang-backend.md, "Model
coverage": why).
"""

from __future__ import annotations

import math

import pytest
from test_sglang_pool_kinds import _load_back

TOKENS = 64  # pool size (tokens; page size 1: SGLang's SWA allocator allocates single tokens on CPU)


def _swa_alloc():
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    # gpt-oss-like: window and full layers alternate
    pool = SWAKVPool(
        size=TOKENS,
        size_swa=TOKENS,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    return SWATokenToKVPoolAllocator(TOKENS, TOKENS, 1, torch.bfloat16, "cpu", pool, need_sort=False)


def _mamba_params(layers):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16, state_size=8, conv_kernel=4
    )
    return Mamba2CacheParams(shape=shape, layers=layers)


def _mamba_alloc():
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    # Qwen3-Next-like: three linear-attention layers to one full-attention layer
    mamba = MambaPool(
        size=8, spec_state_size=0, cache_params=_mamba_params([0, 1, 2]), mamba_layer_ids=[0, 1, 2], device="cpu"
    )
    pool = HybridLinearKVPool(
        size=TOKENS,
        dtype=torch.bfloat16,
        page_size=1,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=[3],
        device="cpu",
        mamba_pool=mamba,
    )
    return TokenToKVPoolAllocator(TOKENS, torch.bfloat16, "cpu", pool, need_sort=False)


def _cache(alloc, disk_dir):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1)
    settings = BackendSettings(
        host_tokens=32, disk_dir=str(disk_dir), disk_tokens=1024, prefetch=True, eviction_demotes="all"
    )
    return TieredRadixCache(params, settings, debug=DebugSettings(check_invariants=True))


def _fill(bufs, slots, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    for buf in bufs:
        raw = buf.view(torch.uint8)
        raw[slots] = torch.randint(0, 256, (len(slots), *raw.shape[1:]), generator=g, dtype=torch.uint8)


def _full_buffers(kvcache):
    """The attention layers' buffers as stored bytes (random bytes include NaNs: compare bits)."""
    import torch

    full = kvcache.full_kv_pool
    return [b.view(torch.uint8) for b in list(full.k_buffer) + list(full.v_buffer)]


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_attention_layers_pages_round_trip_through_the_backend_bit_for_bit(tmp_path, kind):
    """The pages the adapter tiers (the full-attention layers') go device -> host -> disk -> device
    through the real backend and come back bit for bit; again from disk after a restart."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.tiers.base import DISK

    make = _swa_alloc if kind == "swa" else _mamba_alloc
    alloc = make()
    cache = _cache(alloc, tmp_path / "disk")
    assert cache.device_pool.adapter.kind == kind and cache.device_pool.layout.num_layers == (4 if kind == "swa" else 1)
    tokens = array("q", range(100, 124))
    try:
        slots = alloc.alloc(24)
        bufs = _full_buffers(alloc.get_kvcache())
        _fill(bufs, slots, seed=1)
        before = [b[slots].clone() for b in bufs]
        cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        assert cache.evict(EvictParams(num_tokens=24)).num_tokens_evicted == 24  # -> host
        other = alloc.alloc(24)
        cache.insert(InsertParams(key=RadixKey(array("q", range(500, 524))), value=other))
        cache.evict(EvictParams(num_tokens=24))  # fills host: the first prompt's pages go on to disk
        assert cache.cache.stores[DISK].used_pages >= 1
        for b in bufs:
            b.zero_()
        req, new_slots = _load_back(cache, tokens, 24, cache.device_pool.layout.num_layers)
        assert req.storage_hit_length > 0
        assert all(torch.equal(b[new_slots], x) for b, x in zip(bufs, before)), "KV bytes changed on the round trip"
    finally:
        cache.shutdown()
    alloc2 = make()
    cache2 = _cache(alloc2, tmp_path / "disk")
    try:
        req, new_slots = _load_back(cache2, tokens, 24, cache2.device_pool.layout.num_layers)
        assert req.storage_hit_length == 24
        bufs2 = _full_buffers(alloc2.get_kvcache())
        assert all(torch.equal(b[new_slots], x) for b, x in zip(bufs2, before)), "KV bytes changed across the restart"
    finally:
        cache2.shutdown()


def _host_disk_round_trip(layout, page_size, pages, disk_dir):
    """pages -> host -> disk; then a fresh disk store on the same directory (a restart) reads them."""
    from sgl_hicache.hashing import Namespace, page_key
    from sgl_hicache.tiers.disk import DiskPageStore
    from sgl_hicache.tiers.memory import HostKVBuffer

    ns = Namespace.for_model(layout, page_size)
    keys = [page_key(ns.root, [i] * page_size) for i in range(len(pages))]
    host = HostKVBuffer(layout, page_size, len(pages), pin_memory=False)
    slots = host.allocate(keys)
    host.write(slots, pages)
    disk = DiskPageStore(layout, page_size, 64, disk_dir, ns)
    disk.allocate(keys)
    disk.write_from(keys, [host.page_view(s) for s in slots])
    disk.close()
    again = DiskPageStore(layout, page_size, 64, disk_dir, ns)
    try:
        return again.read(keys)
    finally:
        again.close()


def test_swa_window_rows_round_trip_through_the_slot_mapping(tmp_path):
    """The window layers' rows of a request's tokens, found through SGLang's full -> window mapping,
    go device -> host -> disk -> (restart) -> device into other window rows, bit for bit."""
    import torch

    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    alloc = _swa_alloc()
    adapter = SGLangDevicePool(alloc).adapter
    full_slots = alloc.alloc(8)
    window_rows = adapter.window_slots(full_slots)
    window = SGLangDevicePool(alloc.swa_attn_allocator)  # the window sub-pool, through its own adapter
    assert window.adapter.kvcache is alloc.get_kvcache().swa_kv_pool and window.layout.num_layers == 2
    swa = alloc.get_kvcache().swa_kv_pool
    _fill(list(swa.k_buffer) + list(swa.v_buffer), window_rows, seed=3)
    pages = window.read(window_rows.tolist())
    back = _host_disk_round_trip(window.layout, 1, pages, tmp_path / "window")
    others = alloc.alloc(8)
    target = adapter.window_slots(others)
    window.write(target.tolist(), back)
    for buf in list(swa.k_buffer) + list(swa.v_buffer):
        assert torch.equal(buf.view(torch.uint8)[target], buf.view(torch.uint8)[window_rows])


def test_mamba_state_snapshots_round_trip_and_are_charged_their_size(tmp_path):
    """Each slot's recurrent state as one snapshot: device -> host -> disk -> (restart) -> other
    slots, equal to SGLang's own copy of the originals; its size is SGLang's `mamba_cache_per_req`."""
    import torch

    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    alloc = _mamba_alloc()
    adapter = SGLangDevicePool(alloc).adapter
    state = adapter.state
    mamba = alloc.get_kvcache().mamba_pool
    assert state.state_bytes == _mamba_params([0, 1, 2]).mamba_cache_per_req
    g = torch.Generator().manual_seed(5)
    for t in state.tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    src, dst = [1, 2, 3], [5, 6, 7]
    ref = mamba.get_cpu_copy(torch.tensor(src))
    back = _host_disk_round_trip(state.layout, 1, state.read(src), tmp_path / "state")
    state.write(dst, back)
    got = mamba.get_cpu_copy(torch.tensor(dst))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref[0], got[0]))
    assert torch.equal(ref[1].view(torch.uint8), got[1].view(torch.uint8))
    # not vacuous: another slot's state differs
    assert not torch.equal(mamba.get_cpu_copy(torch.tensor([4]))[1], ref[1][:, :1])
    # the charge against a host budget in tokens: a snapshot costs this many tokens of the attention KV
    kv = adapter.layout
    assert state.tokens_of_kv(kv) == math.ceil(state.snapshot_bytes / kv.bytes_per_token)


def test_a_qwen3_next_sized_snapshot_costs_thousands_of_tokens_of_kv():
    """Qwen3-Next-80B-A3B at TP 1 (SGLang's own state shape: 36 linear-attention layers, conv 8192 x 3
    bf16, temporal 32 x 128 x 128 fp32; 12 attention layers of 2 KV heads x 256, bf16): one state
    snapshot is ~75 MiB, as much host memory as ~3,000 tokens of its KV. A tier that kept one per
    tree node would spend most of the host budget on states (sglang #24561)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    from sgl_hicache.config import KVLayout

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=4096, n_groups=16, num_heads=32, head_dim=128, state_size=128, conv_kernel=4
    )
    state = Mamba2CacheParams(shape=shape, layers=list(range(36))).mamba_cache_per_req
    kv = KVLayout(num_layers=12, num_kv_heads=2, head_dim=256, dtype="bfloat16")
    tokens = math.ceil(state / kv.bytes_per_token)
    print(f"\nQwen3-Next snapshot {state / 2**20:.1f} MiB = {tokens} tokens of KV ({kv.bytes_per_token} B/token)")
    assert 70 * 2**20 < state < 80 * 2**20 and 2900 < tokens < 3300
