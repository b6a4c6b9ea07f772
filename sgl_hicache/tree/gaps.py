"""Which resident nodes still lack their copy one tier down: the write-back planner's candidates.

Under write-through almost every page already has its lower copy, so a round that scanned every
resident node (as it did) paid O(resident nodes) on the scheduler thread to find the few that were
just committed. The tree keeps these sets on every residency change instead (O(1) each), and a
round walks only the gaps.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..tiers.base import DEVICE, DISK, HOST, Tier
from .node import TreeNode

# the links background write-back copies along: device -> host, host -> disk
WRITEBACK_LINKS: tuple[tuple[Tier, Tier], ...] = ((DEVICE, HOST), (HOST, DISK))


class TierGaps:
    """For each write-back link `(src, dst)`, the set of nodes resident in `src` and not in `dst`.

    Contract: the owner (`RadixTree`) calls `entered` after a node became resident in a tier,
    `left` after it stopped being resident there, and `split` after a split gave a new upper node
    the residency of the node it was cut from. `missing[(src, dst)]` then always equals
    `{n in resident[src] : n not in dst}` for every `tracked` link (all of them unless
    `track_only` narrowed them), and is empty for the others (checked by `RadixTree.check`)."""

    def __init__(self) -> None:
        self.missing: dict[tuple[str, str], set[TreeNode]] = {link: set() for link in WRITEBACK_LINKS}
        # per tier, the links it is the source of (with their destination) and the destination of
        # (with their source): each residency change touches only its own links
        self.tracked: tuple[tuple[Tier, Tier], ...] = WRITEBACK_LINKS
        self._index()

    def _index(self) -> None:
        self._as_src: dict[str, list[tuple[str, set[TreeNode]]]] = {t: [] for t in (DEVICE, HOST, DISK)}
        self._as_dst: dict[str, list[tuple[str, set[TreeNode]]]] = {t: [] for t in (DEVICE, HOST, DISK)}
        for src, dst in self.tracked:
            gap = self.missing[(src, dst)]
            self._as_src[src].append((dst, gap))
            self._as_dst[dst].append((src, gap))

    def track_only(self, tiers: Iterable[str]) -> None:
        """Keep the sets of the links whose two tiers are both among `tiers` (the stores a cache
        has), on an empty tree: a link to a tier the cache lacks is never written back, and its
        set would cost every residency change of the tier above for nothing (it stays empty)."""
        present = set(tiers)
        assert not any(self.missing.values()), "track_only on a tree that holds nodes"
        self.tracked = tuple((src, dst) for src, dst in WRITEBACK_LINKS if src in present and dst in present)
        self._index()

    def entered(self, node: TreeNode, tier: str) -> None:
        for dst, gap in self._as_src[tier]:
            if getattr(node, dst) is None:
                gap.add(node)
        for _, gap in self._as_dst[tier]:
            gap.discard(node)

    def left(self, node: TreeNode, tier: str) -> None:
        for _, gap in self._as_src[tier]:
            gap.discard(node)
        for src, gap in self._as_dst[tier]:
            if getattr(node, src) is not None:
                gap.add(node)

    def dropped(self, node: TreeNode, tier: str) -> None:
        """`left` for a node that held `tier` alone (eviction's plain case): it is in no gap now."""
        for _, gap in self._as_src[tier]:
            gap.discard(node)

    def split(self, upper: TreeNode, node: TreeNode) -> None:
        for gap in self.missing.values():  # (an untracked link's set is empty)
            if node in gap:
                gap.add(upper)

    def expected(self, resident: dict[str, set[TreeNode]]) -> dict[tuple[Tier, Tier], set[TreeNode]]:
        """What the sets must hold, recomputed from the resident sets (for the tree's check)."""
        return {
            (src, dst): {n for n in resident[src] if getattr(n, dst) is None} if (src, dst) in self.tracked else set()
            for src, dst in WRITEBACK_LINKS
        }
