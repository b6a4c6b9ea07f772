"""Background write-back ops: the write-back policy's picks (`policy/writeback.py`) turned into
prepared copies one tier down, each locking its node's path until it completes."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from ..policy.writeback_choice import clean_pages, pick_writeback, shared_candidates, writeback_candidates
from ..tiers.base import DEVICE, DISK, HOST, KeyedStore
from ..transfer.ops import TransferOp
from ..tree.node import TreeNode
from .copies import Copies
from .protocols import OrderState


class WritebackPlanner:
    """Plans background copies device -> host and host -> disk for one `TieredCache`, reserved
    through `copies`.

    Contract: `plan(src, dst, target, max_pages)` returns prepared ops (possibly none) and changes
    nothing else; the caller executes them anywhere and passes each to `complete`. The caller
    holds the cache's lock.
    """

    def __init__(self, state: OrderState, copies: Copies) -> None:
        self.state = state
        self.copies = copies
        # per (src, dst) link, the state in which planning last found nothing to do
        self._idle: dict[tuple[str, str], tuple] = {}

    def plan(
        self,
        src: str,
        dst: str,
        clean_target_pages: int,
        max_pages: int,
        only: Callable[[TreeNode], bool] | None = None,
    ) -> list[TransferOp]:
        """While fewer than `clean_target_pages` evictable pages of `src` are *clean* (`dst` already
        holds them, so evicting them from `src` is a free drop: the watermark), prepare copies of
        the coldest dirty ones, at most `max_pages` and no more than the watermark lacks. Only nodes
        whose parent is already in `dst` qualify (`dst` stays prefix-closed; their children follow
        in a later round). `only` narrows the candidates (selective write-through)."""
        if (src, dst) not in ((DEVICE, HOST), (HOST, DISK)):
            raise ValueError(f"write-back goes one tier down (device -> host, host -> disk), not {src} -> {dst}")
        c = self.state
        if src not in c.stores or dst not in c.stores:
            return []
        if clean_pages(c.tree, src) >= clean_target_pages:
            return []  # clean enough already (what the scan would find, in O(1))
        # nothing changed since this very plan found nothing to do: it would find nothing again
        # (the engine asks every scheduler step; most steps only decode)
        memo = (src, dst, clean_target_pages, max_pages, only, c.tree.version, c.stores[dst].free_pages)
        if self._idle.get((src, dst)) == memo:
            return []
        ops = self._plan(src, dst, clean_target_pages, max_pages, only)
        if not ops:
            self._idle[(src, dst)] = memo
        return ops

    def plan_path(self, src: str, dst: str, nodes: list[TreeNode], max_pages: int) -> list[TransferOp]:
        """Write-through at commit: prepare copies to a local tier `dst` of the nodes of `nodes` (a
        path, root first) that are in `src` and neither in `dst` nor on their way there, unpinned,
        with their parent in `dst` (or the root), at most `max_pages`, except that a first node larger
        than `max_pages` goes alone (else it would never be copied). Stops at the first node whose
        parent is not in `dst` (prefix closure: its copy follows in a later round). O(path): it runs
        on every commit, where a scan of the whole tier would not do."""
        c = self.state
        if src not in c.stores or dst not in c.stores or c.stores[dst].shared:
            return []
        ops: list[TransferOp] = []
        budget = max_pages
        for n in nodes:
            parent = n.parent
            if parent is None or getattr(n, src) is None or getattr(n, dst) is not None:
                continue
            if dst in n.incoming or n.pins or not (parent.is_root or parent.in_tier(dst)):
                break
            if n.num_pages > budget and ops:
                break
            op = self._backup(n, dst)
            if op is None:
                break
            ops.append(op)
            budget -= n.num_pages
        return ops

    def _plan(
        self, src: str, dst: str, clean_target_pages: int, max_pages: int, only: Callable[[TreeNode], bool] | None
    ) -> list[TransferOp]:
        c = self.state
        clean = clean_pages(c.tree, src)
        store = c.stores[dst]
        # a shared store takes the pages worth sharing (hit at least `min_hits` times), paced by
        # `max_pages` per round, whether or not the device also holds them
        shared = store.shared
        if not shared:
            candidates, incoming = writeback_candidates(c.tree, src, dst)
            clean += incoming  # clean once their copies land
            budget = min(max_pages, clean_target_pages - clean)
        else:
            keyed = cast(KeyedStore, store)  # a shared store is content-addressed
            candidates = shared_candidates(c.tree, src, dst, store.min_hits, lambda n: keyed.accepts(n.keys))
            budget = max_pages
        if only is not None:
            candidates = [n for n in candidates if only(n)]
        ops: list[TransferOp] = []
        for n in pick_writeback(candidates, budget, c.priority, shared):
            parent = n.parent
            if parent is None or not (parent.is_root or parent.in_tier(dst)):
                continue  # room made for an earlier pick evicted its parent from `dst`: a later round
            op = self._backup(n, dst)
            if op is None:
                break
            ops.append(op)
        return ops

    def _backup(self, node: TreeNode, dst: str) -> TransferOp | None:
        """A background copy of `node` into `dst`, its path locked until the copy completes (so the
        ancestors it keeps from being leaves are not counted as evictable either)."""
        op = self.copies.reserve(node, dst, "backup", evict=True)
        if op is not None:
            self.state.tree.lock(node)
            op.locks_path = True
        return op
