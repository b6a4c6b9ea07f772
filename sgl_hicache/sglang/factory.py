"""The `sgl_hicache` radix-cache backend's factory, called by SGLang's `create_tree_cache(ctx)`.

`factory(ctx)` refuses the configurations we do not support with one clear error naming them all,
each with what to run instead (`coverage.REFUSED`): PP > 1, `--enable-hierarchical-cache` (SGLang's
own HiCache), DSA models, hybrid Mamba variants whose state is not one `MambaPool` slot per request. (Pool kinds without an adapter, sliding-window pools other than
`SWAKVPool` among them, are refused by `pool_adapters`, MLA at TP > 1 by `assembly`.) Speculative
decoding (EAGLE / EAGLE3 / MTP) gets bigram keys and the draft model's KV pools tiered with the target's
(`speculative.py`; `_draft_pools`). Then it reads the settings (SGLang's `--hicache-*` flags mapped onto
them, `hicache_flags.py`), finds the cache's place in SGLang's data parallelism
(`data_parallel.placement`: each attention-DP rank or replica is a tree of its own), sets up the
agreement over the cache group SGLang passes, builds the `TieredRadixCache` under a namespace salted by
the model (`model_salt`; with a draft, its path too), registers the layer-wise loads as SGLang's layer
transfer counter (and, per draft pool, a `DraftLayerCounter`), and starts it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..client.backend_settings import given_settings, load_settings, unknown_env
from ..client.debug_settings import DebugSettings
from .backend import TieredRadixCache
from .coverage import PREFIX as _REFUSAL
from .coverage import refusal
from .hicache_flags import apply_hicache_flags
from .kinds.mamba.mamba_calls import HybridLayerCounter, hybrid_state_of, unsupported_hybrid
from .kinds.speculative_decoding import DraftLayerCounter, draft_pools_of
from .parallel.data_parallel import group_consensus, placement

logger = logging.getLogger(__name__)


def model_salt(server_args: Any) -> str:
    """What, besides the KV layout, makes two servers' pages differ: the model folder (resolved) and
    revision, load format, quantisation, KV dtype when not the default."""
    path = str(getattr(server_args, "model_path", "") or "")
    if path and os.path.isdir(path):
        path = os.path.realpath(path)
    parts = [f"model={path}"]
    for name in ("revision", "load_format", "quantization", "kv_cache_dtype"):
        v = getattr(server_args, name, None)
        if v not in (None, "", "auto"):
            parts.append(f"{name}={v}")
    return ";".join(parts)


def unsupported(ctx: Any) -> list[str]:
    """What in SGLang's cache context we cannot serve, one message each naming the kind and what to
    run instead (`coverage.REFUSED`; empty: all supported)."""
    problems = []
    if ctx.enable_hierarchical_cache:
        problems.append(refusal("sglang_hicache"))
    if ctx.is_hybrid_ssm:
        pool = getattr(getattr(ctx, "params", None), "req_to_token_pool", None)
        why = unsupported_hybrid(pool) if hybrid_state_of(pool) is not None else "no MambaPool beside the request pool"
        if why is not None:
            problems.append(refusal("mamba", why))
    if getattr(ctx, "is_dsa", False):
        problems.append(refusal("dsa"))
    sa = ctx.server_args
    if (getattr(sa, "pp_size", 1) or 1) > 1:
        problems.append(refusal("pp", f"pp_size={sa.pp_size}"))
    return problems


def _architecture(ctx: Any) -> str:
    try:
        archs = getattr(ctx.model_config.hf_config, "architectures", None) or []
        if archs:
            return str(archs[0])
    except Exception:
        pass
    return "llama"


def _draft_pools(ctx: Any) -> tuple[Any, ...]:
    """EAGLE / MTP: the draft model's KV pools at the target's slots (recorded by `speculative.record_draft_pools`)."""
    if not getattr(ctx.params, "is_eagle", False):
        return ()
    pools = draft_pools_of(ctx.params.token_to_kv_pool_allocator)
    if pools is None:
        raise ValueError(
            f"{_REFUSAL}speculative decoding, but the draft model's KV pools were not recorded "
            "(the sgl_hicache plugin's hook on Scheduler.init_memory_pools did not run; see the log)"
        )
    return pools


def factory(ctx: Any) -> TieredRadixCache:
    """`register_radix_cache_backend` factory: validates what we support and builds the cache."""
    problems = unsupported(ctx)
    if problems:
        raise ValueError(_REFUSAL + "; ".join(problems))
    sa = ctx.server_args
    settings = apply_hicache_flags(load_settings(), sa, given_settings())
    debug = DebugSettings.from_env()
    where = placement(ctx)
    consensus = group_consensus(ctx, debug, where)
    for var in unknown_env():
        logger.warning("sgl_hicache: ignoring unknown environment variable %s", var)
    drafts = _draft_pools(ctx)
    salt = model_salt(sa)
    if getattr(ctx.params, "is_eagle", False):  # bigram keys; the pages carry the draft model's KV too
        draft = str(getattr(sa, "speculative_draft_model_path", "") or "")
        salt += f";keys=bigram;draft={os.path.realpath(draft) if os.path.isdir(draft) else draft}"
    cache = TieredRadixCache(
        ctx.params,
        settings,
        debug=debug,
        architecture=_architecture(ctx),
        model_salt=salt,
        server_port=getattr(sa, "port", None),
        consensus=consensus,
        placement=where,
        vocab_size=getattr(ctx.model_config, "vocab_size", None),
        draft_pools=drafts,
        model_config=getattr(ctx, "model_config", None),
    )
    if cache.layer_loads is not None:
        cache.layer_loads.forward_stream = getattr(getattr(ctx.tp_worker, "model_runner", None), "forward_stream", None)
        # SGLang's supported seam for layer-wise loads (mem_cache/registry.py does the same for its
        # unified-cache linker): the KV pool calls wait_until(layer) before reading a layer, and the
        # TP worker sets the consumer from batch.hicache_consumer_index (scheduler_hooks sets it)
        kvcache = ctx.params.token_to_kv_pool_allocator.get_kvcache()
        if hasattr(kvcache, "full_attention_layer_id_mapping"):  # hybrid Mamba: waits by model layer id
            kvcache.register_layer_transfer_counter(HybridLayerCounter(cache.layer_loads, kvcache))
        else:
            kvcache.register_layer_transfer_counter(cache.layer_loads)
        ctx.tp_worker.register_hicache_layer_transfer_counter(cache.layer_loads)
        adapter = cache.device_pool.adapter
        for pool, offset in zip(drafts, getattr(adapter, "draft_offsets", ())):
            # the draft's forward reads its layers through its own pool: it waits for them as well
            pool.register_layer_transfer_counter(DraftLayerCounter(cache.layer_loads, offset, int(pool.layer_num)))
    return cache.start()


__all__ = ["factory", "model_salt", "unsupported"]
