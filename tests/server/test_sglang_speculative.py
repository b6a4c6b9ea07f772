"""Speculative decoding (EAGLE, EAGLE3) with `--radix-cache-backend sgl_hicache`. (DeepSeek MTP / NextN on
the server: tests/server/test_sglang_mtp.py.)

1. On SGLang's REAL pool classes (CPU, no server): a target `MHATokenToKVPool` and an EAGLE draft pool
   beside it at the same token slots (as `Scheduler.init_memory_pools` builds them: one allocator). The
   backend keys the tree by bigrams, as SGLang's RadixCache does under `is_eagle`; both pools' rows
   round-trip device -> host -> disk -> other device slots bit for bit, and again after a restart;
   a layer-wise load makes the draft pool's reads wait for the draft's layers too.
2. The real SGLang 0.5.23 CPU server with `--speculative-algorithm EAGLE` and `EAGLE3` (a one-layer
   draft of the tiny Llama, `make_draft`, random weights of realistic scale; `--speculative-num-steps 1
   --speculative-eagle-topk 1 --speculative-num-draft-tokens 2`, what SGLang's CPU path runs on
   `torch_native` with the CPU test layer's patches,
   `scripts/cpu/layer/sglang_cpu_layer/speculative_patches.py`; EAGLE3's target captures its auxiliary
   hidden states on CPU as shipped): greedy outputs and logprobs of a prompt served from device, host
   and disk hits and after a restart equal those computed from scratch; a token changed in the last
   cached page moves the logprobs; the scheduler thread made no copy, wait, sleep or file write.
   The draft's KV shows only in how many of its proposals the target accepts (SGLang's
   `spec_num_correct_drafts`; the target's outputs never depend on it): equal from each tier's hit as
   from scratch, and moved after a restart whose page files had their draft rows negated
   (`tests/spec_walk.py`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
from servers import BackendServers

REPO = Path(__file__).resolve().parents[2]
PAGE, POOL_TOKENS, LAYERS, DRAFT_LAYERS = 4, 64, 2, 1


# ---- 1. real SGLang pools ---------------------------------------------------------------------------
def _pools(kind: str = "mha"):
    """A target pool and a draft pool at the same slots: MHA (EAGLE / EAGLE3 drafts of a Llama) or MLA
    (a DeepSeek NextN MTP layer's pool, SGLang's "packed" draft), with one allocator over the target's."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    def pool(layers):
        if kind == "mla":
            return MLATokenToKVPool(
                size=POOL_TOKENS,
                page_size=PAGE,
                dtype=torch.bfloat16,
                kv_lora_rank=32,
                qk_rope_head_dim=8,
                layer_num=layers,
                device="cpu",
                enable_memory_saver=False,
            )
        return MHATokenToKVPool(
            size=POOL_TOKENS,
            page_size=PAGE,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=8,
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )

    target, draft = pool(LAYERS), pool(DRAFT_LAYERS)
    return PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.bfloat16, "cpu", target, need_sort=False), draft


def _buffers(alloc, draft) -> list:
    t = alloc.get_kvcache()
    if hasattr(t, "kv_buffer"):
        return list(t.kv_buffer) + list(draft.kv_buffer)
    return list(t.k_buffer) + list(t.v_buffer) + list(draft.k_buffer) + list(draft.v_buffer)


def _cache(alloc, draft, disk_dir):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_hicache.client.backend_settings import BackendSettings
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.backend import TieredRadixCache

    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE, is_eagle=True
    )
    settings = BackendSettings(
        host_tokens=64, disk_dir=str(disk_dir), disk_tokens=1024, prefetch=True, eviction_demotes="all"
    )
    return TieredRadixCache(params, settings, draft_pools=(draft,), debug=DebugSettings(check_invariants=True))


def _match_and_load(cache, tokens, n: int):
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    req = SimpleNamespace(
        rid=f"r{time.monotonic_ns()}",
        prefix_len=0,
        full_untruncated_fill_ids=tokens,
        last_node=None,
        storage_hit_length=0,
        storage_hit_start=None,
    )
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
    assert m.device_prefix_len == 0 and m.host_hit_length == n, (m.device_prefix_len, m.host_hit_length)
    req.last_node = m.last_device_node
    loaded = None
    for _ in range(500):
        loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=n, req=req))
        if loaded is not None:
            break
        time.sleep(0.01)
    assert loaded is not None and loaded[0] == n
    return req, cache.path_device_indices(loaded[1])


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_eagle_keys_by_bigrams_and_round_trips_the_draft_kv_with_the_target_kv(tmp_path, kind):
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.sglang.kinds.speculative_decoding import DraftLayerCounter
    from sgl_hicache.tiers.base import DISK

    alloc, draft = _pools(kind)
    cache = _cache(alloc, draft, tmp_path / "disk")
    adapter = cache.device_pool.adapter
    assert adapter.kind == "draft" and adapter.draft_offsets == [LAYERS]
    assert cache.device_pool.layout.num_layers == LAYERS + DRAFT_LAYERS
    # 49 tokens: 48 bigram positions = 12 whole pages; the KV of positions 0..47
    tokens = array("q", range(100, 149))
    try:
        slots = alloc.alloc(48)
        g = torch.Generator().manual_seed(1)
        for buf in _buffers(alloc, draft):
            buf[slots] = torch.randn((48, *buf.shape[1:]), generator=g).to(buf.dtype)
        before = [buf[slots].clone() for buf in _buffers(alloc, draft)]
        r = cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        assert r.total_len == 48  # bigrams: one position fewer than tokens
        # a prompt that shares the 48 tokens but not the 49th matches one page less (the last
        # position's draft KV was computed with token 49), exactly as SGLang's RadixCache under is_eagle
        other = array("q", list(tokens[:48]) + [7])
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(other))).device_prefix_len == 44
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_prefix_len == 48
        assert cache.evict(EvictParams(num_tokens=48)).num_tokens_evicted == 48  # -> host
        filler = alloc.alloc(32)
        cache.insert(InsertParams(key=RadixKey(array("q", range(500, 533))), value=filler))
        cache.evict(EvictParams(num_tokens=32))  # fills host: the first prompt's pages -> disk
        assert alloc.available_size() == POOL_TOKENS and cache.cache.stores[DISK].used_pages >= 1
        for buf in _buffers(alloc, draft):
            buf.zero_()  # nothing left on the device to mistake for a load
        counter = DraftLayerCounter(cache.layer_loads, adapter.draft_offsets[0], DRAFT_LAYERS)
        draft.register_layer_transfer_counter(counter)
        req, new_slots = _match_and_load(cache, tokens, 48)
        assert req.storage_hit_length > 0
        draft.get_key_buffer(0)  # SGLang's draft pool waits through the counter for the draft's layer
        for layer in range(LAYERS):
            cache.layer_loads.wait_until(layer)
        after = [buf[new_slots].clone() for buf in _buffers(alloc, draft)]
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(after, before)), (
            "target or draft KV bytes changed on the round trip"
        )
        disk_pages = cache.cache.stores[DISK].used_pages
    finally:
        cache.shutdown()
    alloc2, draft2 = _pools(kind)  # a restart: both pools' rows come back from disk alone
    cache2 = _cache(alloc2, draft2, tmp_path / "disk")
    try:
        assert cache2.cache.stores[DISK].used_pages == disk_pages
        req, new_slots = _match_and_load(cache2, tokens, 48)
        assert req.storage_hit_length == 48
        for layer in range(LAYERS + DRAFT_LAYERS):
            cache2.layer_loads.wait_until(layer)
        after = [buf[new_slots].clone() for buf in _buffers(alloc2, draft2)]
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(after, before))
    finally:
        cache2.shutdown()


def test_a_draft_of_another_page_layout_is_refused_naming_both():
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_hicache.sglang.device_pool import SGLangDevicePool
    from sgl_hicache.sglang.kinds.pool_adapters import UnsupportedPool

    alloc, _ = _pools()
    wide = MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=4,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    with pytest.raises(
        UnsupportedPool, match=r"draft model whose KV page layout differs.*4 heads x 8.*target 2 x 2 x 8.*Instead: "
    ):
        SGLangDevicePool(alloc, draft_pools=(wide,))


# ---- 2. the real server -----------------------------------------------------------------------------
sys.path.insert(0, str(REPO / "scripts" / "cpu"))
from realistic_weights import TINY, make_model  # noqa: E402
from spec_walk import SPEC_CHAIN_ARGS, walk_speculative_tiers  # noqa: E402
from test_sglang_e2e import _prompt  # noqa: E402

SERVER_PAGE, HIT, VOCAB = 16, 304, 1024
TARGET_LAYERS = json.loads((TINY / "config.json").read_text())["num_hidden_layers"]  # then the draft's layer
SPEC_TOKENS = 16
# EAGLE3's draft reads the target's hidden states captured at these layers' outputs (-1: the embedding);
# SGLang captures the input of layer id + 1, and the tiny Llama has two layers
EAGLE3_AUX_LAYERS = [-1, 0]


def make_draft(target: Path, dst: Path, algorithm: str) -> Path:
    """A one-layer draft of the tiny Llama whose layer is the target's first layer, fed the next token's
    embedding alone (the target's hidden states are ignored), so it proposes roughly what the target's
    first layer predicts and some proposals are accepted.
    `EAGLE` (`LlamaForCausalLMEagle`): its `fc` passes the embedding through; the target's embedding and
    LM head are shared (SGLang's EAGLE worker sets them). `EAGLE3` (`LlamaForCausalLMEagle3`): its
    attention reads [normed embedding, normed hidden] (the hidden half's projections zero) and its `fc`
    maps the captured hidden states (`EAGLE3_AUX_LAYERS`) to zero; its LM head is a copy of the
    target's (`draft_vocab_size`: the whole vocabulary, no token map)."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((TINY / "config.json").read_text())
    h = cfg["hidden_size"]
    w = load_file(str(target / "model.safetensors"))
    layer0 = {name[len("model.") :]: v.clone() for name, v in w.items() if name.startswith("model.layers.0.")}
    if algorithm == "EAGLE":
        cfg.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
        t = {
            "fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1).to(torch.bfloat16),
            "fc.bias": torch.zeros(h, dtype=torch.bfloat16),
        }
        # without its input norm (EAGLE's first layer has none)
        t.update((n, v) for n, v in layer0.items() if "input_layernorm" not in n)
    else:
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            num_hidden_layers=1,
            draft_vocab_size=cfg["vocab_size"],
            eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS},
        )
        t = {
            "fc.weight": torch.zeros(h, len(EAGLE3_AUX_LAYERS) * h, dtype=torch.bfloat16),
            "layers.0.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "norm.weight": w["model.norm.weight"].clone(),
            "lm_head.weight": w["lm_head.weight"].clone(),
        }
        for n, v in layer0.items():
            projects_input = any(f"self_attn.{x}_proj" in n for x in "qkv")
            t[n] = torch.cat([v, torch.zeros_like(v)], 1) if projects_input else v
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_spec")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def target(workdir):
    return make_model(workdir / "target")


@pytest.fixture(params=["EAGLE", "EAGLE3"])
def algorithm(request):
    return request.param


@pytest.fixture
def start_server(workdir, target, algorithm):
    draft = make_draft(target, workdir / f"draft-{algorithm}", algorithm)
    args = ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft), *SPEC_CHAIN_ARGS)
    servers = BackendServers(target, workdir / algorithm, page=SERVER_PAGE, host_tokens=4096, args=args)
    yield servers.start
    servers.close()


def test_eagle_server_outputs_equal_from_scratch_and_from_every_tier_and_after_a_restart(
    start_server, workdir, algorithm
):
    # 320 bigram positions: HIT cached (whole pages), the last page's tail computed; SPEC_TOKENS output
    # tokens, so the draft proposes often enough for its acceptance to show what KV it read; the
    # reference is the scratch run (the walk: tests/spec_walk.py)
    walk_speculative_tiers(
        start_server,
        workdir / algorithm / "disk",
        _prompt(1, HIT + 17),
        HIT,
        n=SPEC_TOKENS,
        page=SERVER_PAGE,
        target_layers=TARGET_LAYERS,
        where="input",
        label=algorithm,
    )
