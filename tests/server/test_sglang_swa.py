"""End to end with a hybrid sliding-window pool: the real SGLang 0.5.23 CPU server, a tiny Granite SWA
config (`scripts/cpu/tiny-granite-swa`: 3 layers, window, full, window; a 64-token window; attention
sinks in every layer), random weights of realistic scale. SGLang builds an `SWAKVPool` (the full
layer's KV in one sub-pool, the window layers' in another, reached through SGLang's full -> window
slot mapping); the CPU test layer's reference attention (`scripts/cpu/layer/sglang_cpu_layer/reference_attention.py`) gives
`torch_native` the sinks and the window-layer reads it lacks (its greedy output on these weights
equals transformers' own GraniteSWA forward in bf16, checked by hand).

The backend tiers every layer of a page, the window layers' rows with the full layers' (pages of
`SWAPoolAdapter`), so every page in every tier is complete and a hit anywhere restores the window
before the hit point. Proven here:
- accounting: a page's bytes are SGLang's two sub-pools' bytes per token, and the host and disk
  tiers size their pages and budgets at that (no server);
- every layer, window rows included, round-trips device -> host -> disk -> device at page 16
  through the real backend with layer-wise loads, and after a restart, bit for bit (no server);
- the real server: a 320-token prompt (five windows) gives the same greedy tokens and logprobs from
  scratch and from a device, a host and a disk hit of 304 tokens, and after a restart; the tail's
  window layers read the hit's last 63 tokens, so wrong window rows would move them; a token changed
  in the last cached page moves them; the scheduler thread made no copy, disk write, sleep or wait.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from servers import BackendServers

REPO = Path(__file__).resolve().parents[2]
TINY_SWA = REPO / "scripts" / "cpu" / "tiny-granite-swa"
PAGE, HIT, VOCAB = 16, 304, 1024


def make_swa_model(dst: Path, seed: int = 0) -> Path:
    """The tiny Granite SWA config with N(0, ~1/sqrt(fan_in)) weights and N(0, 1) sinks, bf16 safetensors."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((TINY_SWA / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, inter, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(out_f, in_f, gain=1.0):
        return (torch.randn(out_f, in_f, generator=g) * gain / in_f**0.5).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {
        "model.embed_tokens.weight": torch.randn(V, h, generator=g).to(torch.bfloat16),
        "model.norm.weight": ones(h),
        "lm_head.weight": w(V, h),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(nh * hd, h, 2.0)
        t[p + "self_attn.k_proj.weight"] = w(nkv * hd, h, 2.0)
        t[p + "self_attn.v_proj.weight"] = w(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        t[p + "self_attn.sinks"] = torch.randn(nh, generator=g).to(torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def _swa_alloc(page: int = PAGE, full_tokens: int = 256, window_tokens: int = 192):
    """SGLang's own SWAKVPool and paged SWATokenToKVPoolAllocator: window layers 0 and 2, full 1 and 3."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(
        size=full_tokens,
        size_swa=window_tokens,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    return SWATokenToKVPoolAllocator(full_tokens, window_tokens, page, torch.bfloat16, "cpu", pool, need_sort=False)


def _cache(alloc, disk_dir, host_tokens: int = 64):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE)
    settings = BackendSettings(
        host_tokens=host_tokens, disk_dir=str(disk_dir), disk_tokens=4096, prefetch=True, eviction_demotes="all"
    )
    return TieredRadixCache(params, settings, debug=DebugSettings(check_invariants=True))


def test_swa_pages_are_charged_every_layer_at_sglangs_own_sizes(tmp_path):
    """A tiered page of an SWAKVPool holds the full and the window layers' KV: its bytes per token are
    the sum of SGLang's two sub-pools' (their `get_kv_size_bytes` over their rows), and the host and
    disk tiers size their pages, and so count their budgets, at that."""
    from sgl_hicache.tiers.base import DISK, HOST

    alloc = _swa_alloc()
    kv = alloc.get_kvcache()
    per_token = sum(sum(sub.get_kv_size_bytes()) // (sub.size + PAGE) for sub in (kv.full_kv_pool, kv.swa_kv_pool))
    full_only = sum(kv.full_kv_pool.get_kv_size_bytes()) // (kv.full_kv_pool.size + PAGE)
    cache = _cache(alloc, tmp_path / "disk")
    try:
        layout = cache.device_pool.layout
        assert layout.bytes_per_token == per_token == 2 * full_only, (layout, per_token, full_only)
        host, disk = cache.cache.stores[HOST], cache.cache.stores[DISK]
        assert host.page_bytes == disk.page_bytes == PAGE * per_token
        assert host.buffer.numel() * host.buffer.element_size() == host.capacity_pages * PAGE * per_token
        # the device tier's capacity is what both sub-pools can hold (SGLang's allocator: the smaller)
        assert cache.device_pool.pool_pages * PAGE == alloc.size == 192
    finally:
        cache.shutdown()


def test_swa_layered_device_host_moves_follow_each_layers_index_space(monkeypatch):
    """The per-layer device <-> host moves (`layered_device_host`) address a window layer's pages in
    the window sub-pool: pages written through the pool's own read / write path come back bit for bit
    into other pages whose window rows are not their full slots."""
    import random

    import torch

    from sgl_hicache.sglang.device_pool import SGLangDevicePool
    from sgl_hicache.sglang.kinds.pool_adapters import SWAPoolAdapter
    from sgl_hicache.tiers.base import DEVICE, HOST
    from sgl_hicache.tiers.memory import HostKVBuffer
    from sgl_hicache.transfer import handlers
    from sgl_hicache.transfer.ops import TransferOp
    from sgl_hicache.tree.node import TreeNode

    monkeypatch.setattr(handlers, "_LAYERED_MIN_BYTES", 0)
    alloc = _swa_alloc()
    dev = SGLangDevicePool(alloc)
    assert [dev.layer_space(layer) for layer in range(4)] == [1, 0, 1, 0]
    host = HostKVBuffer(dev.layout, PAGE, 8)
    stores = {DEVICE: dev, HOST: host}
    hold = alloc.swa_attn_allocator.alloc(3 * PAGE)
    d_pages = dev.pages_of(SWAPoolAdapter.alloc(alloc, 4 * PAGE))
    back = dev.pages_of(SWAPoolAdapter.alloc(alloc, 4 * PAGE))
    alloc.swa_attn_allocator.free(hold)
    assert dev.space_pages(1, torch.tensor(back)).tolist() != back
    data = torch.randn(4, *dev.page_shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dev.write(d_pages, data)

    def op(src, src_h, dst_h):
        return TransferOp(TreeNode(None, (), [], 0), src, HOST if src == DEVICE else DEVICE, src_h, dst_h, 0, "demote")

    h_pages = random.Random(1).sample(range(8), 4)
    handlers.layered_device_host(stores, DEVICE, HOST)(op(DEVICE, d_pages, h_pages), 0, 4)
    assert torch.equal(host.read(h_pages), data)
    handlers.layered_device_host(stores, HOST, DEVICE)(op(HOST, h_pages, back), 0, 4)
    assert torch.equal(dev.read(back), data)


def test_the_engines_gpt_oss_preset_costs_what_sglangs_pool_of_its_shape_tiers():
    """The embedded engine and the replay size gpt-oss-120b's tiers at the bytes per token the backend
    tiers for SGLang's SWAKVPool of its shape (18 window and 18 full layers, 8 KV heads x 64, bf16)."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from sgl_hicache.sglang.device_pool import SGLangDevicePool
    from sgl_hicache.sim.presets import get_model

    m = get_model("gpt-oss-120b")
    pool = SWAKVPool(
        size=64,
        size_swa=32,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=m.num_kv_heads,
        head_dim=m.head_dim,
        swa_attention_layer_ids=list(range(0, 36, 2)),
        full_attention_layer_ids=list(range(1, 36, 2)),
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    alloc = SWATokenToKVPoolAllocator(64, 32, PAGE, torch.bfloat16, "cpu", pool, need_sort=False)
    sglang_per_token = sum(
        sum(sub.get_kv_size_bytes()) // (sub.size + PAGE) for sub in (pool.full_kv_pool, pool.swa_kv_pool)
    )
    assert SGLangDevicePool(alloc).layout.bytes_per_token == sglang_per_token == m.kv_bytes_per_token == 72 * 1024


def test_swa_window_and_full_layers_round_trip_through_the_backend_at_page_16(tmp_path):
    """Every layer of a 16-token-page SWAKVPool, the window layers' rows through SGLang's full -> window
    mapping, goes device -> host -> disk -> device through the real backend (layer-wise loads) and
    comes back bit for bit into other full and window slots; again from disk after a restart."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from test_sglang_pool_kinds import _load_back

    from sgl_hicache.sglang.kinds.pool_adapters import SWAPoolAdapter
    from sgl_hicache.tiers.base import DISK

    def layer_rows(alloc, slots):
        """Each layer's stored bytes at token `slots` (window layers through the mapping)."""
        kv = alloc.get_kvcache()
        window = kv.translate_loc_from_full_to_swa(slots)
        out = []
        for layer in range(4):
            index, windowed = kv.layers_mapping[layer]
            sub = kv.swa_kv_pool if windowed else kv.full_kv_pool
            rows = window if windowed else slots
            out += [sub.k_buffer[index].view(torch.uint8)[rows], sub.v_buffer[index].view(torch.uint8)[rows]]
        return out

    def fill(alloc, slots, seed):
        kv = alloc.get_kvcache()
        g = torch.Generator().manual_seed(seed)
        window = kv.translate_loc_from_full_to_swa(slots)
        for sub, rows in ((kv.full_kv_pool, slots), (kv.swa_kv_pool, window)):
            for buf in list(sub.k_buffer) + list(sub.v_buffer):
                raw = buf.view(torch.uint8)
                raw[rows] = torch.randint(0, 256, (len(rows), *raw.shape[1:]), generator=g, dtype=torch.uint8)

    n = 2 * PAGE
    tokens = array("q", range(100, 100 + n))
    alloc = _swa_alloc()
    cache = _cache(alloc, tmp_path / "disk", host_tokens=n)
    try:
        hold = alloc.swa_attn_allocator.alloc(2 * PAGE)  # so that window rows are not the full slots
        slots = SWAPoolAdapter.alloc(alloc, n)
        assert not torch.equal(alloc.translate_loc_from_full_to_swa(slots), slots)
        fill(alloc, slots, seed=1)
        before = [r.clone() for r in layer_rows(alloc, slots)]
        cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        assert cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted == n  # -> host
        other = SWAPoolAdapter.alloc(alloc, n)
        alloc.swa_attn_allocator.free(hold)
        fill(alloc, other, seed=2)
        cache.insert(InsertParams(key=RadixKey(array("q", range(500, 500 + n))), value=other))
        cache.evict(EvictParams(swa_num_tokens=n))  # a window shortfall evicts as much; the first prompt -> disk
        assert cache.cache.stores[DISK].used_pages >= 2
        for sub in (alloc.get_kvcache().full_kv_pool, alloc.get_kvcache().swa_kv_pool):
            for buf in list(sub.k_buffer) + list(sub.v_buffer):
                buf.zero_()
        req, new_slots = _load_back(cache, tokens, n, 4)
        assert req.storage_hit_length > 0
        got = layer_rows(alloc, new_slots)
        assert all(torch.equal(a, b) for a, b in zip(got, before)), "KV bytes changed on the round trip"
        assert not torch.equal(got[0], torch.zeros_like(got[0]))
    finally:
        cache.shutdown()
    alloc2 = _swa_alloc()
    cache2 = _cache(alloc2, tmp_path / "disk", host_tokens=n)
    try:
        req, new_slots = _load_back(cache2, tokens, n, 4)
        assert req.storage_hit_length == n
        assert all(torch.equal(a, b) for a, b in zip(layer_rows(alloc2, new_slots), before)), (
            "changed across the restart"
        )
    finally:
        cache2.shutdown()


def test_reference_attention_matches_sdpa_and_sinks_only_add_to_the_denominator():
    """The CPU test layer's attention (`reference_attention.attend`): without sinks, torch's SDPA with the
    same causal / window mask (GQA, a query offset as in an extend); a sink adds `exp(sink)` to each
    row's softmax denominator and nothing to its numerator."""
    import torch
    import torch.nn.functional as F

    from sglang_cpu_layer.reference_attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, 8, generator=g) for t, h in ((5, 4), (12, 2), (12, 2)))
    for window in (-1, 3):
        q_pos, k_pos = torch.arange(7, 12).unsqueeze(1), torch.arange(12).unsqueeze(0)
        mask = (k_pos <= q_pos) & ((k_pos >= q_pos - window) if window > -1 else True)
        ref = F.scaled_dot_product_attention(
            q.movedim(0, 1), k.movedim(0, 1), v.movedim(0, 1), attn_mask=mask, scale=0.3, enable_gqa=True
        ).movedim(1, 0)
        got = attend(q, k, v, scale=0.3, q_offset=7, window=window, sinks=None)
        assert torch.allclose(got, ref, atol=1e-5), (window, (got - ref).abs().max())
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    plain = attend(q, k, v, scale=0.3, q_offset=7, window=3, sinks=None)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * 0.3
    q_pos, k_pos = torch.arange(7, 12).unsqueeze(1), torch.arange(12).unsqueeze(0)
    scores = scores.masked_fill(~((k_pos <= q_pos) & (k_pos >= q_pos - 3)), float("-inf"))
    denom = torch.logsumexp(scores, -1)  # [h, q]
    share = torch.sigmoid(denom - sinks.view(4, 1)).movedim(0, 1).unsqueeze(-1)  # Z / (Z + exp(sink))
    got = attend(q, k, v, scale=0.3, q_offset=7, window=3, sinks=sinks)
    assert torch.allclose(got, plain * share, atol=1e-5), (got - plain * share).abs().max()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_swa")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(workdir):
    servers = BackendServers(make_swa_model(workdir / "model"), workdir, page=PAGE, host_tokens=2048)
    yield servers.start
    servers.close()


def test_swa_server_outputs_equal_from_scratch_and_from_every_tier_and_after_a_restart(start_server, workdir):
    """A 320-token prompt (five windows) from scratch, then from a device, a host and a disk hit of
    its first 304 tokens, then from disk after a restart: the same greedy tokens and logprobs. A
    token changed inside the last window before the hit point moves them (the window layers' KV of
    the hit is what the tail reads)."""
    from test_sglang_e2e import _prompt, _settled_pool
    from tier_walk import (
        assert_a_changed_cached_page_moves,
        assert_restart_serves_from_disk,
        assert_settled_and_clean,
        assert_tiers_equal,
        walk_tiers,
    )

    disk = workdir / "disk"
    srv = start_server("first", disk)
    cfg = _settled_pool(srv)["config"]
    assert cfg["pool_kind"] == "swa" and "window_layers=0,2" in cfg["namespace"], cfg
    walk = walk_tiers(srv, _prompt(1, HIT + 16), HIT, disk_flood=10)
    assert_tiers_equal(walk, "scratch", "SWA")
    assert_a_changed_cached_page_moves(srv, walk, "scratch")
    assert_settled_and_clean(srv)
    srv.stop()
    assert_restart_serves_from_disk(start_server("restart", disk), walk, "scratch")
