"""DSA's indexer key cache on SGLang's REAL `DSATokenToKVPool` (CPU, no server): its pages round-trip
through the host and disk tiers (and a restart) into other pages bit for bit, sized as SGLang's own
per-page indexer bytes, and the backend still refuses the pool (docs/sglang-backend.md, "Model
coverage": SGLang's DSA attention needs GPU kernels, so no CPU server can prove serving it)."""

from __future__ import annotations

import pytest
from test_sglang_hybrid_pools import _host_disk_round_trip

PAGE = 64  # SGLang's DSA pool asserts 64-token pages on every platform but HIP / XPU
TOKENS = 4 * PAGE


def _dsa_pool(layers=2):
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    # index_buf_size given: the default reads the DCP width from a published parallel config
    return DSATokenToKVPool(
        size=TOKENS,
        page_size=PAGE,
        kv_lora_rank=32,
        dtype=torch.bfloat16,
        qk_rope_head_dim=16,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=48,
        index_buf_size=TOKENS,
    )


def test_indexer_pages_round_trip_through_host_and_disk_bit_for_bit(tmp_path):
    import torch

    from sgl_hicache.sglang.kinds.dsa_indexer import DSAIndexerAdapter

    pool = _dsa_pool()
    adapter = DSAIndexerAdapter(pool)
    bufs = pool.index_k_with_scale_buffer
    # SGLang's own size of an indexer page: 64 tokens x (128 fp8 key bytes + 4 scale bytes) per layer
    assert adapter.page_bytes == sum(b[0].nbytes for b in bufs) == 2 * PAGE * (128 + 4)
    assert adapter.layout.bytes_per_token * PAGE == adapter.page_bytes
    g = torch.Generator().manual_seed(7)
    for b in bufs:
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    src, dst = [1, 2], [3, 4]
    before = [b[src].clone() for b in bufs]
    back = _host_disk_round_trip(adapter.layout, PAGE, adapter.read(src), tmp_path / "indexer")
    fresh = _dsa_pool()  # the restarted server's pool
    DSAIndexerAdapter(fresh).write(dst, back)
    for b, x in zip(fresh.index_k_with_scale_buffer, before):
        assert torch.equal(b[dst], x), "indexer key bytes changed on the round trip"
        assert b[[0]].count_nonzero() == 0, "a page not written stays as it was"
    assert not torch.equal(bufs[0][[1]], bufs[0][[3]]), "not vacuous: pages differ"


def test_the_backend_refuses_a_dsa_pool():
    from sgl_hicache.sglang.coverage import REFUSED
    from sgl_hicache.sglang.kinds.pool_adapters import UnsupportedPool, adapter_for

    with pytest.raises(UnsupportedPool, match="DSA") as err:
        adapter_for(_dsa_pool(), "deepseek_v32")
    assert REFUSED["dsa"].why in str(err.value)
