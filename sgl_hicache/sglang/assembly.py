"""Composing the parts a `TieredRadixCache` drives, from SGLang's cache parameters and our settings.

`cache_config(...)` turns `BackendSettings` and SGLang's device pool into the core's `CacheConfig`
(capacities per tier, the disk directory and namespace salt, policies); `assemble(...)` builds the
device pool adapter, `TieredCache`, `TransferEngine`, the layer-wise loads, the executor, the
`RequestController` and the re-warm at start (`ServerRewarm`), in the order TP ranks must share (the consensus start is a collective).
No decision of the request path is made here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import TieredCache
from ..client.backend_settings import BackendSettings
from ..config import CacheConfig, HeadShard, default_disk_dir
from ..control.composition import build_cache, build_controller
from ..control.lifecycle import RequestController
from ..hashing import Namespace
from ..tiers.base import DISK, HOST
from ..transfer.engine import TransferEngine
from ..transfer.executors import ThreadExecutor
from .device_pool import SGLangDevicePool
from .layer_loads import LayerLoads
from .parallel.data_parallel import DPPlacement
from .parallel.head_shard import head_shard
from .parallel.rank_consensus import RankConsensus, inject_read_faults
from .parallel.replicated_group import follow, replicated_tiers
from .rewarm_calls import ServerRewarm

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Assembly:
    """The parts of one backend instance, built by `assemble` (the adapter keeps them as attributes)."""

    device_pool: SGLangDevicePool
    config: CacheConfig
    cache: TieredCache
    engine: TransferEngine
    layer_loads: LayerLoads | None
    controller: RequestController
    rewarm: ServerRewarm  # re-warm at start and its record (rewarm_calls.py)
    snapshot_budgets: tuple[int, int] = (0, 0)  # hybrid Mamba: the state snapshots' (host, disk) bytes


def snapshot_tokens(settings: BackendSettings, device_pool: SGLangDevicePool, tokens: int) -> int:
    """Of a host or disk budget of `tokens` KV tokens, those a hybrid Mamba model's state snapshots
    take (`mamba_state_share`; 0 for other models): the snapshots are charged at their bytes."""
    return int(tokens * settings.mamba_state_share) if device_pool.adapter.kind == "mamba" else 0


def cache_config(
    settings: BackendSettings,
    device_pool: SGLangDevicePool,
    page_size: int,
    *,
    sglang_eviction: Any = "lru",
    model_salt: str = "",
    consensus: RankConsensus | None = None,
    placement: DPPlacement | None = None,
    head_shard: HeadShard | None = None,
) -> CacheConfig:
    """The core's configuration: host capacity from the device pool's, disk only with a host tier
    and no shared store, the disk directory under the namespace (one per DP rank whose cache group
    agrees over >= 2 ranks, `DPPlacement.disk_dir`; inside it one per TP rank, or one per TP
    group whose ranks hold the same KV: `RankConsensus.rank_dir`), the eviction
    policy ours or else SGLang's when it is one we support."""
    s = settings
    layout = device_pool.layout
    device_tokens = device_pool.pool_pages * page_size
    host_tokens = s.host_tokens_for(device_tokens, layout.bytes_per_token)
    salt = ";".join(x for x in (model_salt, s.tenant_salt, consensus.salt if consensus is not None else "") if x)
    namespace = Namespace.for_model(layout, page_size, salt)  # (names the default directory only)
    host_tokens -= snapshot_tokens(s, device_pool, host_tokens)
    has_host = host_tokens >= page_size
    disk_tokens = s.disk_tokens_for(layout.bytes_per_token) if has_host and not s.store else 0
    disk_tokens -= snapshot_tokens(s, device_pool, disk_tokens)
    disk_dir = None
    if disk_tokens >= page_size:
        disk_dir = Path(s.disk_dir).expanduser() if s.disk_dir else default_disk_dir() / namespace.root.hex()[:16]
        if placement is not None:
            disk_dir = placement.disk_dir(disk_dir)
        if consensus is not None:
            disk_dir = consensus.rank_dir(disk_dir)  # each rank's shard of every page in its own files
    else:
        disk_tokens = 0
    policy = s.tiering(str(sglang_eviction))
    return CacheConfig(
        layout=layout,
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        disk_tokens=disk_tokens,
        page_size=page_size,
        disk_dir=disk_dir,
        eviction_policy=policy.eviction_policy,
        write_policy=policy.write_policy,
        write_through_threshold=policy.write_through_threshold,
        disk_write_policy=policy.disk_write_policy,
        predictor=policy.predictor,
        tenant_salt=salt,
        disk_fsync=s.disk_fsync,
        eviction_demotes=policy.eviction_demotes,
        store_url=s.store if has_host else None,
        store_min_hits=s.store_min_hits,
        head_shard=head_shard,
    )


def assemble(
    params: Any,
    settings: BackendSettings,
    *,
    architecture: str = "llama",
    model_salt: str = "",
    consensus: RankConsensus | None = None,
    placement: DPPlacement | None = None,
    clock: Callable[[], float],
    fault_disk_read_file: str | None = None,
    draft_pools: tuple[Any, ...] = (),
    total_kv_heads: int | None = None,
) -> Assembly:
    """Build one backend's parts over SGLang's KV pool (`params`: SGLang's `CacheInitParams`; `draft_pools`:
    a speculative draft model's KV pools at the same slots, tiered with it; `total_kv_heads`: the model's,
    before TP splits them, which names this rank's shard of the heads). `fault_disk_read_file` is a
    test switch (`debug_settings`): while it names this rank, disk reads fail."""
    s = settings
    page_size = int(params.page_size)
    device_pool = SGLangDevicePool(
        params.token_to_kv_pool_allocator, architecture=architecture, draft_pools=draft_pools
    )
    if device_pool.adapter.replicated_across_tp and consensus is not None:
        consensus.replicate()  # every rank holds the same KV (MLA): one copy, the leader writes it
    rank, size = (consensus.rank, consensus.size) if consensus is not None else (0, 1)
    shard = head_shard(device_pool.adapter, device_pool.layout.num_kv_heads, rank, size, total_kv_heads)
    if shard is not None and consensus is not None:
        consensus.shard_heads()  # keys without the TP size; this rank's heads' directory
    config = cache_config(
        s,
        device_pool,
        page_size,
        sglang_eviction=getattr(params, "eviction_policy", "lru"),
        model_salt=model_salt,
        consensus=consensus,
        placement=placement,
        head_shard=shard,
    )
    host = lower = None
    if consensus is not None and consensus.replicated:
        host, lower = replicated_tiers(consensus, config)  # a collective
    cache = build_cache(config, device=device_pool, host=host, lower=lower, clock=clock)
    if consensus is not None:
        follow(cache, consensus)
    if fault_disk_read_file and DISK in cache.stores:
        rank = consensus.rank if consensus is not None else 0
        inject_read_faults(cache.stores[DISK], rank, fault_disk_read_file)
    if consensus is not None:
        consensus.start(cache)  # a collective: every rank builds its cache at the same point
    engine = TransferEngine(cache, workers=s.transfer_workers)  # started on first use
    # host -> device loads queued layer by layer, waited for by SGLang's KV pool (the factory registers
    # it). TP >= 2: a load's nodes unlock only once every rank reported it done (sgl_hicache_on_step)
    # (a page with tail layers, DSA's indexer, loads whole: its tail has no layer of the pool to wait for)
    layer_loads = (
        LayerLoads(cache, agreed=consensus is not None)
        if s.layerwise_loads and HOST in cache.stores and device_pool.views_every_layer
        else None
    )
    executor = ThreadExecutor(cache, engine, layers=layer_loads, bytes_per_token=device_pool.layout.bytes_per_token)
    controller = build_controller(
        cache,
        consensus.gate(executor) if consensus is not None else executor,
        s.tiering(str(getattr(params, "eviction_policy", "lru"))),
        clock,
    )
    logger.info(
        "sgl_hicache: device %d tokens (SGLang pool), host %d tokens, disk %d tokens at %s, page %d, write %s, "
        "disk write %s, eviction %s, predictor %s, prefetch %s",
        config.device_tokens,
        config.host_tokens,
        config.disk_tokens,
        config.disk_dir,
        page_size,
        s.write_policy,
        s.disk_write_policy,
        config.eviction_policy,
        s.predictor,
        s.prefetch,
    )
    bpt = device_pool.layout.bytes_per_token
    host_total = s.host_tokens_for(config.device_tokens, bpt)
    budgets = (
        snapshot_tokens(s, device_pool, host_total) * bpt,
        snapshot_tokens(s, device_pool, s.disk_tokens_for(bpt)) * bpt if config.disk_dir is not None else 0,
    )
    rewarm = ServerRewarm(cache, controller, s, ranks_agree=consensus is not None, cache_disabled=bool(params.disable))
    return Assembly(device_pool, config, cache, engine, layer_loads, controller, rewarm, budgets)


__all__ = ["Assembly", "assemble", "cache_config"]
