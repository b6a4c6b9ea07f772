"""DSA pages on SGLang's REAL `DSATokenToKVPool` (CPU, no server): the MLA latent rows and the indexer
key pages of a tree page are one page (one key, one host slot, one page file; `DSAPoolAdapter`), which
goes device -> host -> disk -> device through the real backend into other allocator pages bit for bit
(latent and indexer), and from disk after a restart; a page file whose indexer bytes were changed
(checksums rewritten) brings the change back. Packed index layouts are refused, and the factory still
refuses to serve DSA (docs/coverage.md, "DSA": what stops a server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from page_files import rewrite_payloads
from test_sglang_pool_kinds import _load_back

PAGE = 64  # SGLang's DSA pool asserts 64-token physical pages on every platform but HIP / XPU
POOL_TOKENS = 8 * PAGE
PROMPT = 2 * PAGE
LAYERS, SKIP = 3, [False, True, False]  # the middle layer shares its top-k: a 0-row indexer placeholder


def _dsa_pool(**extra):
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    # index_buf_size given: the default reads the DCP width from a published parallel config
    args = dict(
        size=POOL_TOKENS,
        page_size=PAGE,
        kv_lora_rank=32,
        dtype=torch.bfloat16,
        qk_rope_head_dim=16,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=48,
        index_buf_size=POOL_TOKENS,
        skip_topk_layers=SKIP,
    )
    return DSATokenToKVPool(**{**args, **extra})


def _dsa_alloc():
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.bfloat16, "cpu", _dsa_pool(), need_sort=False)


def _cache(alloc, disk_dir):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE)
    settings = BackendSettings(
        host_tokens=PROMPT, disk_dir=str(disk_dir), disk_tokens=16 * PAGE, prefetch=True, eviction_demotes="all"
    )
    return TieredRadixCache(params, settings, debug=DebugSettings(check_invariants=True), architecture="dsv32")


def _latent(pool, slots):
    import torch

    return [b.view(torch.uint8)[slots].clone() for b in pool.kv_buffer]


def _indexer(pool, slots):
    pages = slots[::PAGE] // PAGE
    return [b[pages].clone() for b in pool.index_k_with_scale_buffer if b.shape[0]]


def _fill(pool, slots, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    for b in pool.kv_buffer:
        raw = b.view(torch.uint8)
        raw[slots] = torch.randint(0, 256, (len(slots), *raw.shape[1:]), generator=g, dtype=torch.uint8)
    pages = slots[::PAGE] // PAGE
    for b in pool.index_k_with_scale_buffer:
        if b.shape[0]:
            b[pages] = torch.randint(0, 256, (len(pages), b.shape[1]), generator=g, dtype=torch.uint8)


def _zero(pool):
    for b in list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer):
        b.zero_()


def _to_disk(cache, alloc, tokens, seed):
    """Write a prompt's pages (random latent and indexer bytes), evict them to host, then push them on to
    disk by filling the host with another prompt's. Returns the slots and their bytes."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.tiers.base import DISK

    pool = alloc.get_kvcache()
    slots = alloc.alloc(PROMPT)
    _fill(pool, slots, seed)
    before = _latent(pool, slots), _indexer(pool, slots)
    cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
    assert cache.evict(EvictParams(num_tokens=PROMPT)).num_tokens_evicted == PROMPT  # -> host
    other = alloc.alloc(PROMPT)
    _fill(pool, other, seed + 1)
    cache.insert(InsertParams(key=RadixKey(array("q", range(9000, 9000 + PROMPT))), value=other))
    cache.evict(EvictParams(num_tokens=PROMPT))  # fills host: the first prompt's pages go on to disk
    assert cache.cache.stores[DISK].used_pages >= PROMPT // PAGE
    return slots, before


def _hold(alloc, slots) -> None:
    """Keep the allocator from handing out `slots` again (the load back then lands in other pages)."""
    import torch

    held = alloc.alloc(alloc.available_size())
    alloc.free(held[~torch.isin(held, slots)])


def _after_restart(disk_dir, tokens):
    """A restarted server's pool and cache on `disk_dir`: the prompt loaded whole from disk. Returns the
    latent and indexer bytes it restored."""
    alloc = _dsa_alloc()
    cache = _cache(alloc, disk_dir)
    try:
        req, slots = _load_back(cache, tokens, PROMPT)
        assert req.storage_hit_length == PROMPT
        return _latent(alloc.get_kvcache(), slots), _indexer(alloc.get_kvcache(), slots)
    finally:
        cache.shutdown()


def _equal(got, want) -> bool:
    import torch

    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_page_holds_the_latent_and_the_indexer_at_sglangs_sizes():
    """One page: the latent's layers, then the indexer pages as tail layers, sized at SGLang's own
    bytes (the tail rounded up to whole layers); the namespace differs from an MLA page's."""
    from sgl_hicache.config import KVLayout
    from sgl_hicache.hashing import Namespace
    from sgl_hicache.sglang.device_pool import SGLangDevicePool

    device = SGLangDevicePool(_dsa_alloc(), "dsv32")
    adapter, layout = device.adapter, device.layout
    pool = adapter.kvcache
    assert adapter.kind == "dsa" and adapter.view_layers == LAYERS and not device.views_every_layer
    latent_page = sum(b[:PAGE].nbytes for b in pool.kv_buffer)  # SGLang's own sizes
    indexer_page = sum(b[0].nbytes for b in pool.index_k_with_scale_buffer if b.shape[0])
    assert indexer_page == 2 * PAGE * (128 + 4)
    tail = -(-indexer_page // (latent_page // LAYERS))
    assert layout.num_layers == LAYERS + tail == 6
    assert layout.bytes_per_token * PAGE == latent_page + tail * latent_page // LAYERS >= latent_page + indexer_page
    mla = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=48, dtype="bfloat16", architecture="dsv32", kv_planes=1)
    assert Namespace.for_model(layout, PAGE).root != Namespace.for_model(mla, PAGE).root


def test_latent_and_indexer_round_trip_through_the_backend_and_a_restart(tmp_path):
    """device -> host -> disk -> other device pages through the real backend, latent and indexer bit for
    bit; again from disk alone after a restart (a new pool and cache on the same directory)."""
    from array import array

    import torch

    tokens = array("q", range(100, 100 + PROMPT))
    alloc = _dsa_alloc()
    cache = _cache(alloc, tmp_path / "disk")
    try:
        assert cache.layer_loads is None  # a page with a tail loads whole
        slots, (latent, indexer) = _to_disk(cache, alloc, tokens, seed=1)
        pool = alloc.get_kvcache()
        _zero(pool)
        _hold(alloc, slots)
        req, new_slots = _load_back(cache, tokens, PROMPT)
        assert req.storage_hit_length > 0, "not vacuous: part of the hit came from disk"
        assert not torch.isin(new_slots, slots).any(), "loaded into other allocator pages"
        assert _equal(_latent(pool, new_slots), latent), "latent bytes changed on the round trip"
        assert _equal(_indexer(pool, new_slots), indexer), "indexer bytes changed on the round trip"
    finally:
        cache.shutdown()
    got_latent, got_indexer = _after_restart(tmp_path / "disk", tokens)
    assert _equal(got_latent, latent), "latent bytes changed across the restart"
    assert _equal(got_indexer, indexer), "indexer bytes changed across the restart"


def test_a_changed_indexer_byte_in_a_page_file_comes_back_changed(tmp_path):
    """The indexer bytes are really carried: a page file whose first tail element was changed (checksums
    rewritten, so it loads as a valid page) restores an indexer page changed there, latent unchanged."""
    from array import array

    import torch

    from sgl_hicache.tiers.codec import PAGE_SUFFIX

    tokens = array("q", range(100, 100 + PROMPT))
    alloc = _dsa_alloc()
    cache = _cache(alloc, tmp_path / "disk")
    try:
        _, (latent, indexer) = _to_disk(cache, alloc, tokens, seed=2)
    finally:
        cache.shutdown()

    def flip(page):  # the first tail layer's first element: the first indexer layer's first key bytes
        page[LAYERS, 0, 0, 0, 0] = -page[LAYERS, 0, 0, 0, 0] if page[LAYERS, 0, 0, 0, 0] != 0 else 1.0

    files = sorted((tmp_path / "disk").rglob("*" + PAGE_SUFFIX))
    assert rewrite_payloads(files, flip) == len(files) >= PROMPT // PAGE
    got_latent, got = _after_restart(tmp_path / "disk", tokens)
    assert _equal(got_latent, latent), "the latent did not change"
    for page in range(PROMPT // PAGE):
        diff = (got[0][page] != indexer[0][page]).nonzero().flatten().tolist()
        assert diff and set(diff) <= {0, 1}, f"page {page}: changed indexer bytes at {diff}"
    assert torch.equal(got[1], indexer[1]), "the second indexer layer did not change"


@pytest.mark.parametrize(
    "extra",
    [
        dict(page_size=2 * PAGE, index_kpool=2),
        dict(page_size=2 * PAGE, index_kpool=2, index_kpool_compress=True, max_running_requests=4),
    ],
    ids=["kpool2", "kpool2-compress"],
)
def test_packed_index_layouts_are_refused_naming_them(extra):
    from sgl_hicache.sglang.kinds.pool_adapters import UnsupportedPool, adapter_for

    pool = _dsa_pool(**extra)
    with pytest.raises(UnsupportedPool, match=r"packed index layout \(index_kpool=2") as err:
        adapter_for(pool, "dsv32")
    assert "index_kpool=1 without compression" in str(err.value)


def test_the_factory_still_refuses_to_serve_dsa():
    from sgl_hicache.sglang.coverage import REFUSED
    from sgl_hicache.sglang.factory import unsupported

    ctx = SimpleNamespace(
        enable_hierarchical_cache=False, is_hybrid_ssm=False, is_dsa=True, server_args=SimpleNamespace(pp_size=1)
    )
    assert any(REFUSED["dsa"].why in p for p in unsupported(ctx))
