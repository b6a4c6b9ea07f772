"""Copies the cache makes itself: room first, then a transfer prepared, run inline and completed.

`reserve` is how every planner (promotion jobs, write-back, eviction's demotions) gets a prepared
op: it makes room in the destination by evicting (one tier down first, through the evictor), then
prepares the op, which itself never evicts. `copy_now` runs a copy synchronously on the calling
thread: the embedded cache's demotions and write-through, never SGLang's scheduler thread in the
server's default settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ..tiers.base import DEVICE, DISK, HOST, Handle
from ..transfer.handlers import execute
from ..transfer.ops import TransferOp
from ..tree.node import TreeNode
from .evictor import Evictor
from .lower import LowerTier
from .protocols import CopyState
from .transaction import Transactions


class Copies:
    """Room-making reservations and synchronous copies for one `TieredCache` (caller holds the lock):
    rooms made through `evictor`, ops prepared by `tx`, disk pages looked up in `lower`.

    Contract: `reserve` returns a prepared op or None (no room could be made, no source, a copy
    pending), and never evicts `node` or its parent; `copy_now` returns whether `node` and its
    ancestors are now in `tier`, and leaves the tree consistent when they are not.
    """

    def __init__(self, state: CopyState, tx: Transactions, lower: LowerTier, evictor: Evictor) -> None:
        self.state = state
        self.tx = tx
        self.lower = lower
        self.evictor = evictor

    def reserve(
        self,
        node: TreeNode,
        dst: str,
        kind: str,
        evict: bool,
        src: str | None = None,
        src_handles: Sequence[Handle] | None = None,
    ) -> TransferOp | None:
        if node.parent is None or node.in_tier(dst) or dst in node.incoming:
            return None
        if src is None and self.tx.source_of(node, dst) is None:
            return None
        if evict:
            self.tx.free_stale(node, dst)
            # nor its parent: evicting the parent from `dst` now would leave the copy's destination
            # tier not prefix-closed once it lands (the caller checked the parent is there)
            keep = (node,) if node.parent.is_root else (node, node.parent)
            self.evictor.make_room(dst, node.num_pages, keep, spare_device_copies=kind == "backup")
        return self.tx.prepare(node, dst, kind, src, src_handles)

    def copy_now(self, node: TreeNode, tier: str, kind: str, evict: bool) -> bool:
        """Make `node` (and, for prefix closure, its ancestors) resident in `tier`, synchronously;
        a disk-only node bound for the device comes through host first."""
        c = self.state
        if tier not in c.stores:
            return False
        path = node.path_from_root()
        for n in path:  # pinned, so evictions made to room for the chain cannot take its head
            c.tree.pin(n)
        try:
            for n in path:
                if n.in_tier(tier):
                    continue
                if n.parent is None:
                    return False  # removed meanwhile (a corrupt ancestor dropped its subtree)
                pending = n.incoming.get(tier)
                if pending is not None:
                    # a background copy into this tier: use it if its bytes are there, never
                    # race it (a second copy, or adopting its files before it completes)
                    if not (pending.kind == "backup" and pending.settled and c.complete(cast(TransferOp, pending))):
                        return False
                    continue
                if tier == DISK and all(map(self.lower.holds, n.keys)):
                    # content-addressed: already written, by us, an earlier process or a peer
                    c.tree.set_resident(n, DISK)
                    continue
                if tier == DEVICE and n.host is None and n.device is None and n.disk is not None:
                    if not self.copy_now(n, HOST, kind, evict):
                        return False
                op = self.reserve(n, tier, kind, evict)
                if op is None:
                    return False
                execute(op, c.handlers)
                if not c.complete(op):
                    return False
            return True
        finally:
            for n in path:
                c.tree.unpin(n)
            c.prune(node)
