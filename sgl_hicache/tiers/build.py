"""The tier stores a `CacheConfig` names, built where the caller did not pass its own."""

from __future__ import annotations

from ..config import CacheConfig
from ..hashing import Namespace
from .base import DEVICE, DISK, HOST, KeyedStore, TierStore
from .memory import DeviceKVPool, HostKVBuffer


def build_stores(
    config: CacheConfig,
    namespace: Namespace,
    device: TierStore | None = None,
    host: TierStore | None = None,
    lower: TierStore | None = None,
) -> dict[str, TierStore]:
    """Device, host and lower-tier stores: the given ones, else those `config` sizes (a host buffer
    when `host_pages > 0`; a disk directory when `disk_pages > 0`, one shard's under it with a
    `head_shard`, else a shared store when
    `store_url` is set). The lower slot must be a content-addressed `KeyedStore`."""
    stores: dict[str, TierStore] = {
        DEVICE: device or DeviceKVPool(config.layout, config.page_size, config.device_pages)
    }
    if host is None and config.host_pages > 0:
        host = HostKVBuffer(config.layout, config.page_size, config.host_pages)
    if host is not None:
        stores[HOST] = host
    if lower is None and config.disk_pages > 0 and config.disk_dir is not None:
        from .disk import DiskPageStore, HeadShardDiskStore  # (file I/O code only where a disk tier is configured)

        if config.head_shard is not None:  # a shard of the heads: other TP sizes' pages readable too
            lower = HeadShardDiskStore(
                config.layout,
                config.page_size,
                config.disk_pages,
                config.disk_dir,
                config.head_shard,
                namespace,
                fsync=config.disk_fsync,
            )
        else:
            lower = DiskPageStore(
                config.layout, config.page_size, config.disk_pages, config.disk_dir, namespace, fsync=config.disk_fsync
            )
    if lower is None and config.store_url:
        from .shared_store import open_store  # (a remote client only where a store is configured)

        lower = open_store(config, namespace)
    if lower is not None:
        if not isinstance(lower, KeyedStore):
            raise TypeError(
                f"TieredCache: the disk slot needs a content-addressed KeyedStore, got {type(lower).__name__}"
            )
        stores[DISK] = lower
    return stores
