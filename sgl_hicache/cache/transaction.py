"""The two cache-side phases of a transfer (`transfer/ops.py`: prepare / execute / complete).

*prepare* (under the cache lock) allocates the destination and pins the node so nothing evicts or
splits it; the bytes are copied by a handler (`transfer/handlers.py`), inline or on a worker, with
no lock; *complete* (under the lock) records the new residency, or rolls the allocation back when
the copy failed. Neither phase decides anything: room is made before *prepare* (`Copies.reserve`),
and what follows a landed copy (write-through) is the caller's policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..stats import PREFETCH_KINDS
from ..tiers.base import DEVICE, DISK, HOST, Handle, PageCorruptError, PageGoneError, PeerTierError
from ..transfer.bandwidth import BandwidthMeter
from ..transfer.ops import Cancelled, TransferOp
from ..tree.node import TreeNode
from .lower import LowerTier
from .protocols import CacheState

log = logging.getLogger("sgl_hicache.cache")

# which tier to copy from into a destination, fastest first
SOURCES: dict[str, tuple[str, ...]] = {DEVICE: (HOST,), HOST: (DEVICE, DISK), DISK: (HOST, DEVICE)}


class Transactions:
    """Prepare and complete transfers for one `TieredCache` (the caller holds the cache's lock):
    copies into the disk tier are announced to `lower`, and landed copies timed in `meter`.

    Contract: `prepare` never evicts and never copies: it returns None when `dst` has no room, no
    tier holds a source, or a transfer into `dst` is pending; `complete` applies an op exactly once
    and returns whether its copy is now recorded; a failed copy is a miss counted in
    `stats.errors`, never wrong KV. `incoming_pages[tier]`: destination pages of the copies into
    `tier` in flight (allocated, in no node yet: a pool's accounting counts them as held).
    """

    def __init__(self, state: CacheState, lower: LowerTier, meter: BandwidthMeter) -> None:
        self.state = state
        self.lower = lower
        self.meter = meter
        self.incoming_pages: dict[str, int] = dict.fromkeys(SOURCES, 0)
        # (error name, reason) pairs already logged at WARNING: the rest go to DEBUG (one line per reason)
        self._logged_errors: set[tuple[str, str]] = set()

    @staticmethod
    def source_of(node: TreeNode, dst: str) -> str | None:
        """The fastest other tier that holds `node`, to copy from into `dst`."""
        for src in SOURCES[dst]:
            if node.in_tier(src):
                return src
        return None

    def free_stale(self, node: TreeNode, dst: str) -> None:
        """Pages an earlier process left in the disk tier under `node`'s keys are rewritten: free them
        (before room is counted, so that an eviction does not free what they give back)."""
        if dst == DISK:
            store = self.lower.store
            stale = [k for k in node.keys if store.contains(k)]
            if stale:
                store.free(stale)

    def prepare(
        self, node: TreeNode, dst: str, kind: str, src: str | None = None, src_handles: Sequence[Handle] | None = None
    ) -> TransferOp | None:
        c = self.state
        if node.parent is None or node.in_tier(dst) or dst in node.incoming:
            return None
        if src is None:
            src = self.source_of(node, dst)
            if src is None:
                return None
            src_handles = list(node.keys) if src == DISK else list(getattr(node, src))
        store = c.stores[dst]
        self.free_stale(node, dst)
        if store.free_pages < node.num_pages:
            return None
        # a slot store counts its pages and never reads a key: hashing a node's pages (one xxh3 per
        # page, every token at page size 1) is for the stores that address pages by content
        handles = store.allocate(node.keys if store.content_addressed else [b""] * node.num_pages)
        if handles is None:
            return None
        c.tree.pin(node)
        op = TransferOp(
            node, src, dst, list(src_handles or []), list(handles), node.num_pages * c.config.page_bytes, kind
        )
        node.own_dict("incoming")[dst] = op
        self.incoming_pages[dst] += len(handles)
        if dst == DISK:
            self.lower.writes_in_flight.add(op)
        return op

    @staticmethod
    def parts(op: TransferOp) -> list[TreeNode]:
        """The nodes `op`'s pages span now, root first: its node, and the upper parts split off it
        while the copy was in flight (`RadixTree.split` keeps the lower part in the old node)."""
        parts = [op.node]
        pages = op.node.num_pages
        while pages < len(op.dst_handles):
            upper = parts[-1].parent
            assert upper is not None and not upper.is_root and op.dst in upper.incoming, (op, parts)
            parts.append(upper)
            pages += upper.num_pages
        assert pages == len(op.dst_handles), (op, parts)
        parts.reverse()
        return parts

    def complete(self, op: TransferOp) -> bool:
        c = self.state
        if op.applied:  # completed already (a background copy an eviction used early)
            return op.error is None
        parts = self.parts(op)
        for part in parts:
            c.tree.unpin(part)
            if part.incoming.get(op.dst) is op:
                del part.incoming[op.dst]
        if op.locks_path:
            c.tree.unlock(op.node)
        self.lower.writes_in_flight.discard(op)
        self.incoming_pages[op.dst] -= len(op.dst_handles)
        op.applied = True
        if op.cancelled and (op.error is None or op.gated):
            op.error = Cancelled()  # gated: a local I/O error must not change this rank's tree alone
        if op.error is not None:
            c.stores[op.dst].free(op.dst_handles)
            c.tree.push_leaf(parts[0].parent, op.dst)  # no longer waiting for this child
            if not isinstance(op.error, Cancelled):
                self._on_error(op, parts[0])
            return False
        start = 0
        for part in parts:
            c.tree.set_resident(part, op.dst, op.dst_handles[start : start + part.num_pages])
            start += part.num_pages
        node = op.node
        tokens = len(op.dst_handles) * c.page_size
        c.stats.add("bytes_moved", op.nbytes, op.link)
        c.stats.add("transfer_seconds", op.seconds, op.link)
        self.meter.record(op.link, op.nbytes, op.seconds)
        if op.kind == "demote":
            c.stats.add("demoted_tokens", tokens, op.src)
        elif op.kind != "backup":
            c.stats.add("promoted_tokens", tokens, op.dst)
            # a speculative copy counts once per node, until a request uses it
            if op.kind in PREFETCH_KINDS and not node.prefetched:
                node.prefetched = op.kind
                c.stats.add_prefetch(op.kind, "promoted_tokens", tokens, node.prefetch_trigger)
        return True

    def _on_error(self, op: TransferOp, top: TreeNode) -> None:
        """`top`: the highest node `op`'s pages span (dropping its subtree drops them all)."""
        assert op.error is not None  # (called for failed copies only)
        c = self.state
        if isinstance(op.error, PageGoneError):  # another process sharing the directory evicted it: a miss
            c.stats.errors["vanished_pages"] += 1
            log.debug("tier transfer %s of %d pages missed: %s", op.link, op.node.num_pages, op.error)
            self.lower.drop_subtree(top)
            return
        if isinstance(op.error, PeerTierError):
            name = "peer_rank_errors"
        else:
            name = "corrupt_pages" if isinstance(op.error, PageCorruptError) else f"{op.link}_errors"
        if name != "corrupt_pages":
            c.stats.errors[name] += 1
        if op.corrupt_pages or name == "corrupt_pages":  # per page: one op's chunks may each meet one
            c.stats.errors["corrupt_pages"] += max(1, op.corrupt_pages)
        cause = getattr(op.error.__cause__, "errno", None)
        reason = getattr(op.error, "reason", None) or str(cause or type(op.error).__name__)
        first = (name, reason) not in self._logged_errors
        self._logged_errors.add((name, reason))
        (log.warning if first else log.debug)(
            "tier transfer %s of %d pages failed: %s", op.link, op.node.num_pages, op.error
        )
        if op.src == DISK and op.source_lost:
            self.lower.drop_subtree(top)
