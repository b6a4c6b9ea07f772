"""Eviction order as one function: `priority(node) -> sortable`; the lowest is evicted first.

Following SGLang's `evict_policy.py`, a policy never touches the tree or a store: the cache asks it to
order the candidates (the tier's evictable leaves) and does the moving itself.
"""

from __future__ import annotations

from collections.abc import Callable

from ..tree.node import TreeNode

EvictionPriority = Callable[[TreeNode], tuple]


def lru(node: TreeNode) -> tuple:
    """Least recently used first."""
    return (node.last_access, node.id)


def lfu(node: TreeNode) -> tuple:
    """Least frequently used first; ties broken by recency."""
    return (node.hit_count, node.last_access, node.id)


_POLICIES: dict[str, EvictionPriority] = {"lru": lru, "lfu": lfu}

# policies whose keys only grow with use: the tree keeps their order incrementally (`tree/leaves.py`)
INCREMENTAL = frozenset(_POLICIES)


def orders_incrementally(name: str, custom_priority: bool = False) -> bool:
    """Whether `name`'s eviction order can live in the tree's incremental leaf queue. Never for a
    priority given in its place (the oracle's Belady key drops as the future comes closer), nor for
    `reuse` (its values move with the clock)."""
    return not custom_priority and name in INCREMENTAL


def eviction_policy(name: str) -> EvictionPriority:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(_POLICIES)}") from None
