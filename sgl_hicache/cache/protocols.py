"""What the cache's helpers see of the `TieredCache` they serve, and of each other.

Each helper takes the narrowest of these it reads; `TieredCache` satisfies all the state protocols
and wires the helpers together. Members are read afresh at each use: `reset` replaces the tree, and
the clock, the eviction priority and the transfer handlers may be replaced on a live cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..config import CacheConfig
from ..policy.reuse import ReuseModel
from ..stats import CacheStats
from ..tiers.base import TierStore
from ..transfer.handlers import Handlers
from ..transfer.ops import TransferOp
from ..tree.node import TreeNode
from ..tree.radix import RadixTree

Priority = Callable[[TreeNode], tuple]


class CacheState(Protocol):
    """The books every helper reads: config, tree, stores, counters.

    Contract: the caller holds the cache's lock while a helper reads or changes them; `prune(node)`
    removes `node` and its ancestors while they are resident nowhere, childless and unused.
    """

    @property
    def config(self) -> CacheConfig: ...

    @property
    def page_size(self) -> int: ...

    @property
    def tree(self) -> RadixTree: ...

    @property
    def stores(self) -> dict[str, TierStore]: ...

    @property
    def stats(self) -> CacheStats: ...

    def prune(self, node: TreeNode) -> None: ...


class OrderState(CacheState, Protocol):
    """`CacheState` plus what orders eviction and write-back: the eviction priority (lowest goes
    first), the clock and the reuse model (None unless a policy learns from served requests).

    Contract: `priority` is a pure function of the node and the clock.
    """

    @property
    def priority(self) -> Priority: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def reuse(self) -> ReuseModel | None: ...


class CopyState(CacheState, Protocol):
    """`CacheState` plus what runs and lands the copies the cache makes itself: the handlers that
    move a transfer's bytes, and the cache's `complete` (which applies the copy and any
    write-through it triggers).

    Contract: `complete(op)` applies `op` exactly once and returns whether its copy is recorded.
    """

    @property
    def handlers(self) -> Handlers: ...

    def complete(self, op: TransferOp) -> bool: ...


class Demoter(Protocol):
    """What the evictor needs of the cache's copies: a dirty victim its policy keeps is copied one
    tier down, synchronously, before it is dropped (`Copies.copy_now`; the copies make room through
    the evictor, so the link is two-way).

    Contract: `copy_now(node, tier, kind, evict)` returns whether `node` and its ancestors are now
    in `tier`, and leaves the tree consistent when they are not.
    """

    def copy_now(self, node: TreeNode, tier: str, kind: str, evict: bool) -> bool: ...
