"""Write-back and write-through decisions: which pages get a copy one tier down, and when.

Pure: these functions read the tree and the config and return nodes or booleans; the cache turns
their answers into transfer ops (`cache/writeback.py`) and the controller's pump runs them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from ..config import CacheConfig
from ..tiers.base import DEVICE, DISK, HOST
from ..tree.node import TreeNode
from ..tree.radix import RadixTree


def below(tier: str) -> str | None:
    """The tier an evicted page of `tier` is demoted to."""
    return HOST if tier == DEVICE else DISK if tier == HOST else None


def is_clean(node: TreeNode, tier: str) -> bool:
    """Evicting `node` from `tier` copies nothing: the tier it would be demoted to holds it
    (device demotes to host; host to disk unless the device holds it)."""
    if tier == DEVICE:
        return node.host is not None
    return node.disk is not None or node.device is not None


def clean_pages(tree: RadixTree, tier: str) -> int:
    """Evictable pages of `tier` whose eviction is a free drop because the tier below holds them,
    from the tree's O(1) counts. (A host copy of a device page is not counted: it is what keeps the
    device page clean, so host eviction takes it last, `host_eviction_rank`.)"""
    return tree.evictable_shared_pages(tier, below(tier))  # type: ignore[arg-type]


def host_eviction_rank(node: TreeNode) -> int:
    """Where a host page stands in host eviction without demotion, lowest first: 0 also on disk
    and not on the device (a free drop); 1 only on host (lost if dropped: counted); 2 also on the
    device (its host copy keeps the device page clean; dropping it would only make the write-through
    copy it again, pushing out another)."""
    if node.device is not None:
        return 2
    return 0 if node.disk is not None else 1


def host_pages_before_fresh_copy(tree: RadixTree, config: CacheConfig) -> int:
    """Evictable host pages that host eviction takes before a page just brought up from disk (on
    host and disk, not on the device, used now): every page of its rank, 0 (`host_eviction_rank`),
    since all of them were used earlier; under demoting eviction (one order by priority) every
    evictable host page. In O(1), from the tree's page counts."""
    if eviction_demotes(config, HOST):
        return tree.evictable_pages(HOST)
    return tree.evictable_shared_pages(HOST, DISK) - tree.evictable_shared_pages(HOST, DISK, DEVICE)


def fresh_copy_stay_s(ahead_pages: int, ahead_trend: float, evict_rate: float, lead_s: float) -> float:
    """How long a page brought up from disk now stays on host: host eviction takes the
    `ahead_pages` pages before it (`host_pages_before_fresh_copy`) first, and the pages that join
    them meanwhile (older uses: a device page evicted, a disk copy landing) go before it too. So it
    lasts while that pool lasts: `ahead_pages` over the pool's measured shrinking (`ahead_trend`,
    pages/s, negative when shrinking), and indefinitely while the pool holds or grows. With the
    pool empty it is the next page the tier evicts: 0 while the tier evicts at least a page within
    `lead_s` (`evict_rate`, pages/s); infinite while it evicts nothing."""
    if evict_rate * lead_s < 1:
        return float("inf")
    if ahead_pages <= 0:
        return 0.0
    return ahead_pages / -ahead_trend if ahead_trend < 0 else float("inf")


def eviction_demotes(config: CacheConfig, tier: str) -> bool:
    """Whether evicting a dirty page from `tier` copies it down (`CacheConfig.eviction_demotes`)."""
    mode = config.eviction_demotes
    return mode == "all" or (mode == "host" and tier == DEVICE)


def write_through_on_insert(config: CacheConfig) -> bool:
    """Every newly committed device page gets a host copy (HiCache's `write_through`)."""
    return config.write_policy == "write_through"


def selective_write_through_due(config: CacheConfig, node: TreeNode) -> bool:
    """`write_through_selective`: a device page hit `write_through_threshold` times gets a host copy."""
    return (
        config.write_policy == "write_through_selective"
        and node.host is None
        and node.device is not None
        and node.hit_count >= config.write_through_threshold
    )


def disk_write_through_due(config: CacheConfig, node: TreeNode) -> bool:
    """`disk_write_policy=write_through`: a page that lands on host gets a disk copy."""
    return config.disk_write_policy == "write_through" and node.disk is None and node.host is not None


def writeback_candidates(tree: RadixTree, src: str, dst: str) -> tuple[list[TreeNode], int]:
    """The nodes of `src` a background write-back to a local tier `dst` may copy, and the pages
    already on their way there: unpinned, not in `dst` nor on their way, with their parent in `dst`
    (or the root), in use or not (a prefix every request holds locked must reach `dst` first, or
    nothing below it ever could; its bytes are final). A host page also on the device is not on disk
    yet: evicting it from the device later would leave the disk tier without it. One pass over the
    nodes of `src` missing from `dst` (`tree.gaps`: under write-through only the freshly committed
    ones), with the attribute reads inlined: it runs whenever the watermark is short."""
    candidates: list[TreeNode] = []
    incoming = 0
    append = candidates.append
    for n in tree.gaps.missing[(src, dst)]:
        if dst in n.incoming:
            incoming += n.num_pages
            continue
        parent = n.parent
        if n.pins == 0 and parent is not None and (parent.parent is None or getattr(parent, dst) is not None):
            append(n)
    return candidates, incoming


def shared_candidates(
    tree: RadixTree, src: str, dst: str, min_hits: int, accepts: Callable[[TreeNode], bool]
) -> list[TreeNode]:
    """The nodes of `src` a shared store `dst` should take: not in it nor on their way, hit at least
    `min_hits` times, accepted by the store, with their parent there (or the root). A shared store
    also takes pages in use: a hot prefix is the one most worth sharing."""
    out = []
    for n in tree.gaps.missing[(src, dst)]:
        if dst in n.incoming:
            continue
        if n.hit_count < min_hits or not accepts(n):
            continue
        if n.parent.is_root or n.parent.in_tier(dst):  # type: ignore[union-attr]
            out.append(n)
    return out


def pick_writeback(
    candidates: list[TreeNode], budget: int, priority: Callable[[TreeNode], tuple], shared: bool
) -> list[TreeNode]:
    """The candidates to copy this round, coldest first, within `budget` pages. A local tier takes
    whole nodes until one does not fit; a shared store skips a node that does not fit (a later
    round takes it). Either way a node larger than the whole budget goes alone when it comes first,
    or it would never be copied (at page size 1 a long prompt's node is thousands of pages), and
    every node behind it would wait on it."""
    if budget <= 0 or not candidates:
        return []
    if not shared and budget + 1 < len(candidates):
        # at most `budget` nodes are taken (a page each at least), then one that does not fit
        ordered: Iterable[TreeNode] = heapq.nsmallest(budget + 1, candidates, key=priority)
    else:
        ordered = sorted(candidates, key=priority)
    picked: list[TreeNode] = []
    for n in ordered:
        if n.num_pages > budget and picked:
            if not shared:
                break
            continue
        picked.append(n)
        budget -= n.num_pages
    return picked


class EvictionRate:
    """Pages evicted per second from one tier, smoothed: fed the tier's cumulative eviction count
    at each write-back round (`update`). `half_life_s` sets how fast it forgets a burst. Fed a
    page count that also falls (a pool's size), it is that count's trend, of either sign."""

    def __init__(self, half_life_s: float = 2.0) -> None:
        self.half_life_s = half_life_s
        self.rate = 0.0
        self._last: tuple[float, int] | None = None

    def update(self, now: float, evicted_pages: int) -> float:
        if self._last is not None:
            t0, n0 = self._last
            dt = now - t0
            if dt > 0:
                sample = (evicted_pages - n0) / dt
                keep = 0.5 ** (dt / self.half_life_s)
                self.rate = keep * self.rate + (1 - keep) * sample
        self._last = (now, evicted_pages)
        return self.rate


def watermark_pages(capacity: int, fraction: float, rate: float, horizon_s: float) -> int:
    """How many evictable pages of a tier should be clean: at least `fraction` of it, and as many
    as the tier evicts (`rate` pages/s) before the copies started now can land (`horizon_s`), so
    that eviction finds clean pages instead of dropping dirty ones."""
    if fraction <= 0:
        return 0
    return min(capacity, max(int(capacity * fraction), int(rate * horizon_s + 0.999)))
