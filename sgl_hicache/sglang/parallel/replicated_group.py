"""One copy of the KV for a TP group whose ranks all hold the same KV (MLA's latent at `--tp > 1`).

`replicated_tiers(consensus, config)` builds, on every rank at the same point (collectives), the
host and disk stores of such a group (`tiers/replicated.py`):
- host: ONE `SharedHostBuffer` for the group: the leader (rank 0) creates its file in /dev/shm, every
  rank maps it, and once all have, the leader removes the name (nothing is left behind, even after a
  crash later on). `host_tokens` is the group's budget, not a rank's;
- disk: the leader's `DiskPageStore` on the group's one directory (`<disk_dir>/tp<N>-shared`,
  `RankConsensus.rank_dir`), and on a follower a `MirrorDiskStore`, the index of the same keys.
`follow(cache, consensus)` then gives a follower the movers that leave every write into host and
disk to the leader (`transfer/handlers.follower_handlers`). The page keys carry no rank and no TP
size (`RankConsensus.salt`); what keeps the ranks' trees equal is the usual per-step agreement.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...config import CacheConfig
from ...tiers.base import TierIOError, TierStore
from ...tiers.replicated import MirrorDiskStore, SharedHostBuffer, new_shared_file, unlink_shared_file
from ...transfer.handlers import follower_handlers
from .rank_consensus import RankConsensus

if TYPE_CHECKING:
    from ...cache import TieredCache

logger = logging.getLogger(__name__)


def replicated_tiers(consensus: RankConsensus, config: CacheConfig) -> tuple[TierStore | None, TierStore | None]:
    """(host, lower) stores of this rank of a replicated group (see the module docstring); None where
    `config` has no such tier (then `build_cache` builds nothing there either). A collective."""
    host: TierStore | None = None
    if config.host_pages > 0:
        nbytes = config.host_pages * config.page_size * config.layout.bytes_per_token
        path, error = None, ""
        if consensus.leader:
            try:
                path = new_shared_file(nbytes)
            except TierIOError as exc:
                error = str(exc)  # raised on every rank below: a collective only some ranks reach hangs
        name, error = consensus.gather((str(path) if path is not None else None, error))[0]
        if error:
            raise TierIOError(error)
        try:
            host = SharedHostBuffer(config.layout, config.page_size, config.host_pages, name)
        finally:
            consensus.gather(True)  # every rank has mapped it (or failed to): the name can go
            if path is not None:
                unlink_shared_file(path)
    lower: TierStore | None = None
    if not consensus.leader and config.disk_pages > 0:
        lower = MirrorDiskStore(config.layout, config.page_size, config.disk_pages)
    logger.info(
        "sgl_hicache: rank %d of %d is the %s of one shared copy of the KV (host %d pages mapped by every "
        "rank, disk %s)",
        consensus.rank,
        consensus.size,
        "leader" if consensus.leader else "follower",
        config.host_pages,
        config.disk_dir,
    )
    return host, lower


def follow(cache: TieredCache, consensus: RankConsensus) -> None:
    """On a follower rank: leave every copy into host and disk to the leader (nothing on the leader)."""
    if consensus.replicated and not consensus.leader:
        cache.handlers.update(follower_handlers(cache.handlers, cache.stores, consensus.counts.left_to_leader))


__all__ = ["follow", "replicated_tiers"]
