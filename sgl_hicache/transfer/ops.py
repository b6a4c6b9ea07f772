"""A transfer as plain data: one node's pages moving between two tiers.

The cache plans ops (`TieredCache.prepare`), executors move their bytes (`transfer/`), and the cache
records the outcome (`TieredCache.complete`). Kept apart from `cache.py` so that the byte movers need
not import the cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..tiers.base import DEVICE, DISK, HOST, Handle

if TYPE_CHECKING:
    from ..tree.node import TreeNode

LINKS = {(DEVICE, HOST): "device->host", (HOST, DEVICE): "host->device", (HOST, DISK): "host->disk", (DISK, HOST): "disk->host"}


@dataclass(eq=False)
class TransferOp:
    """One node's pages moving from tier `src` to tier `dst` (see the module docstring).

    `executed` is set when the bytes have been copied (or the copy failed, see `error`);
    `applied` once the cache has recorded the outcome in the tree.
    """

    node: TreeNode
    src: str
    dst: str
    src_handles: list[Handle]
    dst_handles: list[Handle]
    nbytes: int
    kind: str  # "demand" | "prefetch" | "predict" | "demote" | "backup"
    error: BaseException | None = None
    seconds: float = 0.0
    executed: threading.Event = field(default_factory=threading.Event)
    applied: bool = False
    cancelled: bool = False
    submitted: bool = False  # handed to a transfer engine, which will set `executed`

    @property
    def link(self) -> str:
        return LINKS[(self.src, self.dst)]
