"""Speculative decoding (EAGLE, EAGLE3, MTP / NextN) with the tiered cache: bigram keys and the draft
model's KV.

Bigram keys. With EAGLE SGLang keys its radix tree by token bigrams (`CacheInitParams.is_eagle`,
`RadixKey.maybe_to_bigram_view`, `mem_cache/radix_cache.py:401-491`): KV position i is stored under
(t[i], t[i+1]), because the draft model's KV at i is computed from the target's hidden state at i and
the embedding of t[i+1]. A prefix of n positions is then reused only when the n + 1 tokens that made it
match. `bigram_keys(tokens)` gives the tree that key, one int64 per position, `(t[i] << 32) | t[i+1]`
(token ids are below 2**31, so the packing is exact and the keys never equal a plain token's): every
layer of the tree, the page hashes and the disk files work on them unchanged.

The draft model's KV. EAGLE's draft model has its own KV pool (one per draft runner) indexed by the
target's token slots: the draft runners share the target's `req_to_token_pool` and allocator
(`Scheduler.init_memory_pools`). A page of the tree therefore holds the draft's rows at the same slots;
SGLang's HiCache moves them with the target's (`HiCacheDraftPlan`, `speculative/base_spec_worker.py:343`:
"sidecar" for EAGLE / EAGLE3, "packed" for NextN MTP). SGLang builds that plan only for its own HiCache
(it is empty for a registered radix-cache backend), so `record_draft_pools` (an AFTER hook on
`Scheduler.init_memory_pools`) records the draft runners' pools by the allocator they share, and the
factory hands them to the device tier (`pool_adapters.DraftPoolsAdapter`): the draft's layers are
tiered as layers of the same page, device -> host -> disk and back. `DraftLayerCounter` is what the
draft pool waits on before reading a layer, so a layer-wise load completes the draft's layers too.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from ..layer_loads import MappedLayerCounter

logger = logging.getLogger(__name__)

SCHEDULER_INIT_MEMORY_POOLS = "sglang.srt.managers.scheduler.Scheduler.init_memory_pools"

# the draft runners' KV pools of each scheduler in this process, by id() of the allocator they share
_DRAFT_POOLS: dict[int, tuple[Any, ...]] = {}


def bigram_keys(tokens: Sequence[int]) -> array:
    """The tree's key of `tokens` under EAGLE: one int64 per bigram, `(t[i] << 32) | t[i + 1]`
    (`len(tokens) - 1` of them; none for fewer than 2 tokens)."""
    raw = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    n = len(raw) - 1
    out = array("q", bytes(8 * max(n, 0)))
    if n > 0:
        t = torch.frombuffer(raw, dtype=torch.int64)
        torch.bitwise_or(t[:-1] << 32, t[1:], out=torch.frombuffer(out, dtype=torch.int64))
    return out


def record_draft_pools(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `Scheduler.init_memory_pools`: remember the draft runners' KV pools (module docstring)."""
    try:
        spec = getattr(scheduler, "draft_worker", None)
        runners = spec._draft_model_runners() if spec is not None and hasattr(spec, "_draft_model_runners") else ()
        target_pool = scheduler.tp_worker.model_runner.token_to_kv_pool
        pools = tuple(
            p for p in (getattr(r, "token_to_kv_pool", None) for r in runners) if p is not None and p is not target_pool
        )  # none: the draft reads the target's KV (frozen-KV MTP)
        _, allocator = scheduler.tp_worker.get_memory_pool()
        _DRAFT_POOLS[id(allocator)] = pools
    except Exception:  # never break SGLang's start; the factory refuses EAGLE without the pools
        logger.exception("sgl_hicache: recording the draft model's KV pools failed")
    return result


def draft_pools_of(allocator: Any) -> tuple[Any, ...] | None:
    """The draft runners' KV pools recorded for the scheduler whose allocator is `allocator` (empty: the
    draft keeps no KV of its own; None: nothing was recorded)."""
    return _DRAFT_POOLS.get(id(allocator))


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_INIT_MEMORY_POOLS, record_draft_pools, HookType.AFTER)


class DraftLayerCounter(MappedLayerCounter):
    """SGLang's layer transfer counter for one draft KV pool: its layer `i` is layer `offset + i` of
    the tiered page, so `wait_until(i)` waits for that layer of the queued loads (`LayerLoads`; the
    consumer index is the target's: the draft's forward reads the batch the target's forward read)."""

    def __init__(self, loads: Any, offset: int, num_layers: int) -> None:
        super().__init__(loads)
        self.offset = offset
        self.num_layers = num_layers

    def page_layer(self, layer: int) -> int | None:
        return self.offset + layer


__all__ = ["DraftLayerCounter", "bigram_keys", "draft_pools_of", "record_draft_pools", "register_hooks"]
