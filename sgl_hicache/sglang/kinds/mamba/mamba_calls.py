"""SGLang's hybrid Mamba / linear-attention calls of `TieredRadixCache` (the `MambaCalls` mixin).

A hybrid model (`HybridLinearKVPool` + `MambaPool`, SGLang's `HybridReqToTokenPool`) resumes a prefix
only from the recurrent state at the hit point. The attention layers' KV pages are tiered as any
model's; beside them `SnapshotTiers` (mamba_snapshots.py) keeps state snapshots keyed by the chained
page key at their depth. This mixin:
- `_snapshot_depth`: cuts a match to the deepest point whose snapshot some tier holds (0: a miss);
- `_mamba_gate`: at admission, whether that snapshot can be restored now, or its disk read (started
  at the match, on the transfer engine) is still landing: the request then waits a round, as for
  its pages' prefetch;
- `_mamba_restore`: copies that snapshot into the request's own mamba slot (allocating one, evicting
  snapshots under slot pressure), SGLang's copy-on-write (`cow_mamba`);
- `_mamba_commit`: at a request's commit, takes the slot its strategy offers (state_sources.py: a
  finished request's own slot at its end under `no_buffer`; under `extra_buffer` the ping-pong slot
  its forward tracked at a chunk-aligned point, finished or running) as the snapshot of that depth;
- `_mamba_release`: frees the slots a request still holds when it is released;
- `mamba_evictable_size` / `all_mamba_values_flatten` / `evict(mamba_num=...)`: the tree's device
  slots, as SGLang's pool accounting and its slot-shortage eviction (`allocation.ensure_mamba_capacity`)
  read them (a slot a background copy still reads is protected, not evictable); eviction frees the
  slots whose state already landed in host / disk first, and never copies.

`build_snapshots` refuses the hybrid variants whose state lives elsewhere (extra_buffer_lazy's
on-demand track slots, ReplaySSM rings, int8 checkpoint pools, the unified hybrid pool's virtual
slots).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult

from ....cache import PrefixMatch
from ....policy.snapshots import SnapshotCosts
from ....transfer.ops import TransferOp
from ....tree.node import TreeNode
from ...coverage import PREFIX, refusal
from ...layer_loads import MappedLayerCounter
from .mamba_snapshots import READY, SnapshotTiers
from .state_sources import NoBuffer, state_source


def hybrid_state_of(req_to_token_pool: Any) -> Any | None:
    """SGLang's `MambaPool` when `req_to_token_pool` is a hybrid one (it has a mamba allocator)."""
    if getattr(req_to_token_pool, "mamba_allocator", None) is None:
        return None
    return getattr(req_to_token_pool, "mamba_pool", None)


def unsupported_hybrid(req_to_token_pool: Any) -> str | None:
    """Why this hybrid pool is not served (its state is not all in one `MambaPool` slot per request),
    or None."""
    pool = req_to_token_pool.mamba_pool
    if getattr(req_to_token_pool, "enable_mamba_extra_buffer_lazy", False):
        return "--mamba-radix-cache-strategy extra_buffer_lazy"
    if getattr(pool, "replayssm_write_pos", None) is not None:
        return "ReplaySSM linear attention"
    if getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None:
        return "int8 mamba checkpoints"
    if getattr(req_to_token_pool, "mamba_v2p_table", None) is not None:
        return "the unified hybrid memory pool"
    return None


def model_costs(state_bytes: int, model_config: Any, attention_layers: int) -> SnapshotCosts:
    """The policy's costs of one model (policy/snapshots.py): ~2 FLOPs per parameter of a layer's
    projections and MLP per token (estimated from the config's sizes), and 4 x attention layers x
    query heads x head dim per context token."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    hidden = int(getattr(hf, "hidden_size", 0) or 0)
    layers = int(getattr(hf, "num_hidden_layers", 0) or 0)
    inter = int(getattr(hf, "intermediate_size", 0) or 0) or 4 * hidden
    heads = int(getattr(hf, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(hf, "head_dim", 0) or 0) or (hidden // heads if heads else 0)
    per_token = 2.0 * layers * (4 * hidden * hidden + 3 * hidden * inter)
    return SnapshotCosts(state_bytes, max(1.0, per_token), 4.0 * attention_layers * heads * head_dim)


def build_snapshots(
    req_to_token_pool: Any,
    state: Any,
    costs: SnapshotCosts,
    *,
    host_bytes: int,
    disk_dir: Path | None,
    disk_bytes: int,
    handlers: dict,
    submit: Callable[[Sequence[TransferOp], str], None],
) -> SnapshotTiers:
    """The snapshot tiers of a hybrid model, or ValueError naming the hybrid variant not served. Its
    copies run through `handlers` (the cache's) on the executor `submit` queues them on."""
    why = unsupported_hybrid(req_to_token_pool)
    if why is not None:
        raise ValueError(PREFIX + refusal("mamba", why))
    return SnapshotTiers(
        state,
        req_to_token_pool.mamba_pool,
        req_to_token_pool.mamba_allocator,
        costs,
        host_bytes=host_bytes,
        disk_dir=disk_dir,
        disk_bytes=disk_bytes,
        handlers=handlers,
        submit=submit,
    )


def snapshots_for(req_to_token_pool: Any, adapter: Any, model_config: Any, parts: Any) -> SnapshotTiers | None:
    """The snapshot tiers of the backend whose request pool is `req_to_token_pool` (None: not a hybrid
    model), over its KV `adapter`'s `state`, with the budgets `parts` (`assembly.Assembly`) set aside."""
    if hybrid_state_of(req_to_token_pool) is None:
        return None
    state = getattr(adapter, "state", None)
    if state is None:
        raise ValueError(f"{PREFIX}a hybrid Mamba pool beside a {adapter.kind} KV pool: not covered")
    costs = model_costs(state.snapshot_bytes, model_config, int(adapter.layout.num_layers))
    return build_snapshots(
        req_to_token_pool,
        state,
        costs,
        host_bytes=parts.snapshot_budgets[0],
        disk_dir=parts.config.disk_dir,
        disk_bytes=parts.snapshot_budgets[1],
        handlers=parts.cache.handlers,
        submit=parts.controller.executor.submit_ops,
    )


class HybridLayerCounter(MappedLayerCounter):
    """SGLang's layer transfer counter for a `HybridLinearKVPool`: the pool waits with its model layer
    ids (`wait_until(layer_id - start_layer)`), the tiered page holds only the attention layers, in
    the order of the pool's `full_attention_layer_id_mapping`. A linear-attention layer reads no
    page: it waits for nothing (its state was restored before the batch ran)."""

    def __init__(self, loads: Any, kvcache: Any) -> None:
        super().__init__(loads)
        self.start_layer = int(getattr(kvcache, "start_layer", 0) or 0)
        self.mapping = dict(kvcache.full_attention_layer_id_mapping)

    def page_layer(self, layer: int) -> int | None:
        return self.mapping.get(layer + self.start_layer)


def _page_ends(path: list[TreeNode], page_size: int) -> list[tuple[int, bytes]]:
    """(depth, chained page key) of every page end on `path`, deepest first."""
    out: list[tuple[int, bytes]] = []
    depth = sum(n.num_pages for n in path) * page_size
    for node in reversed(path):
        for key in reversed(node.keys):
            out.append((depth, key))
            depth -= page_size
    return out


class MambaCalls:
    """Mixin of `TieredRadixCache`: the hybrid-state side of SGLang's calls (module docstring).
    `snapshots` is None for a model without recurrent state; every method is then a no-op."""

    snapshots: SnapshotTiers | None
    cache: Any
    _empty_match: Callable[[], MatchResult]  # the backend's
    req_to_token_pool: Any
    page_size: int
    disable: bool
    # the backend's, for `_mamba_admit`
    consensus: Any
    settings: Any
    counters: Any
    controller: Any
    deferred_rid: str | None

    def supports_mamba(self) -> bool:
        return self.snapshots is not None and not self.disable

    def mamba_evictable_size(self) -> int:
        s = self.snapshots
        return s.used["device"] - s.slots_moving() if s is not None else 0

    def mamba_protected_size(self) -> int:
        # the tree's slots a background copy still reads (a restore copies at once: no slot is held
        # for a request)
        return self.snapshots.slots_moving() if self.snapshots is not None else 0

    def all_mamba_values_flatten(self) -> torch.Tensor:
        slots = self.snapshots.device_slots() if self.snapshots is not None else []
        return torch.tensor(slots, dtype=torch.int64)

    def _snapshot_depth(self, path: list[TreeNode], limit: int) -> tuple[int, bytes | None]:
        """The deepest page end within `limit` tokens of `path` whose snapshot some tier holds."""
        assert self.snapshots is not None
        for depth, key in _page_ends(path, self.page_size):
            if depth <= limit and key in self.snapshots:
                return depth, key
        return 0, None

    @cached_property
    def _state_source(self) -> NoBuffer:
        """Where a request's state at a cacheable point is, under this pool's strategy."""
        return state_source(self.req_to_token_pool)

    def _alloc_slot(self) -> torch.Tensor | None:
        """A fresh mamba slot (shape [1]), evicting tree snapshots if short; None if none is free."""
        assert self.snapshots is not None
        alloc = self.req_to_token_pool.mamba_allocator
        got = alloc.alloc(1)
        if got is None:
            self.snapshots.evict_device(1)
            got = alloc.alloc(1)
        return got

    def _mamba_slot(self, req: Any) -> int | None:
        """The request's own mamba slot, allocated (evicting tree snapshots if short) when it has none."""
        if req.kv.mamba_pool_idx is None:
            got = self._alloc_slot()
            if got is None:
                return None
            req.kv.mamba_pool_idx = got[0]
        return int(req.kv.mamba_pool_idx)

    def _mamba_admit(self, req: Any, key: bytes, st: Any) -> bool | None:
        """At admission (`init_load_back`), before the pages load: True when the snapshot `key` can be
        restored now; None while its file is read (the request retries next round, as for its pages'
        prefetch, until `load_timeout_s` since it arrived is spent); False: recompute (no snapshot, its
        file failed, or waiting would outlast the timeout; TP >= 2, whose ranks do not agree on when
        a read lands). The request's prefetch ticket (`st.ticket`) is released when it recomputes."""
        assert self.snapshots is not None
        state = self.snapshots.fetch(key)
        if state == READY:
            return True
        waiting = state is not None and st is not None and self.consensus is None
        if waiting and time.monotonic() - st.created < self.settings.load_timeout_s:
            self.counters.load_back_retries += 1
            self.deferred_rid = req.rid  # scheduler_hooks.keep_admitting: skip it, admit the rest
            return None
        self.counters.load_back_declined += 1
        self.counters.extra["state_missing"] = self.counters.extra.get("state_missing", 0) + 1
        if st is not None and st.ticket is not None:
            self.controller.release(st.ticket)
        return False

    def _mamba_restore(self, req: Any, key: bytes) -> str | None:
        """Copy the snapshot `key` into the request's slot; the tier that served it, or None."""
        assert self.snapshots is not None
        slot = self._mamba_slot(req)
        if slot is None:
            return None
        tier = self.snapshots.restore(key, slot)
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = tier is None  # a failed restore: the request starts from the zero state
        return tier

    def _mamba_commit(self, req: Any, path: list[TreeNode], covered: int, committed: int) -> None:
        """A request's commit of its first `committed` tokens, whose tree path is `path` (its first
        `covered` tokens on device): the state its strategy offers (`state_sources`) at a page end
        of that device path becomes that point's snapshot (the slot passes to the tree), unless one
        is kept there already; else the slot stays the request's, for `_mamba_release`."""
        if self.snapshots is None or not path:
            return
        offer = self._state_source.offer(req, committed)
        if offer is None or offer.depth > covered:
            return
        ends = _page_ends(path, self.page_size)
        at = next((i for i, (d, _) in enumerate(ends) if d == offer.depth), None)
        if at is None:
            return
        key = ends[at][1]
        ancestor = next((d for d, k in ends[at + 1 :] if k in self.snapshots), 0)
        if not self.snapshots.accepts(key, offer.depth, ancestor):
            return
        slot = self._state_source.hand_over(req, offer, self._alloc_slot)
        if slot is not None:
            self.snapshots.take(key, offer.depth, ancestor, slot)

    def _hybrid_match(self, params: MatchPrefixParams, m: PrefixMatch, depth: int, key: bytes) -> MatchResult:
        """A hybrid Mamba model's match, cut to `depth` (a point with a state snapshot). All on device
        and the snapshot in a slot or in DRAM: the device prefix, and the snapshot goes into the
        request's slot now (`cow_mamba`). Else (a snapshot only on disk starts its read here) the
        whole hit is promised as a lower-tier hit (device prefix 0), so that the prefix SGLang computes
        from is either all of it or none: `init_load_back` loads the pages and restores the state, or
        the request recomputes from the zero state."""
        root = self.cache.tree.root
        if m.tokens != depth:
            return self._empty_match()
        assert self.snapshots is not None
        ready = self.snapshots.fetch(key) == READY  # a snapshot only on disk: its read starts now
        if m.device_tokens == depth and ready:
            req = params.req
            if params.cow_mamba and req is not None and self._mamba_restore(req, key) is None:
                return self._empty_match()
            return MatchResult(
                device_prefix_len=depth,
                last_device_node=m.last_node,
                last_host_node=m.last_node,
                best_match_node=m.last_node,
            )
        return MatchResult(
            device_prefix_len=0,
            last_device_node=root,
            last_host_node=m.last_node,
            best_match_node=m.last_node,
            host_hit_length=depth,
        )

    def _mamba_release(self, req: Any) -> None:
        """The request is released: the slots it still holds go back to SGLang's allocator."""
        if self.snapshots is not None:
            self._state_source.release(req)


__all__ = [
    "HybridLayerCounter",
    "MambaCalls",
    "build_snapshots",
    "hybrid_state_of",
    "model_costs",
    "unsupported_hybrid",
]
