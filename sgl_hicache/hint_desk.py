"""Client hints run through the request controller: the one implementation for the server's hint
API and the embedded engine's replay of trace hints (`policy/hints.py` says what a hint is).

- ``prefetch``: the prefix's disk-only part comes up to host as a speculative job of the
  controller (paced: `max_predicted_jobs`, sized by `prediction_budget`; guarded: trigger ``hint``;
  charged like a prediction, behind demand and ahead of write-back);
- ``pin``: the same, then the prefix is locked until its time is up (`expire` unlocks it; a
  pin's size and lifetime are bounded by `HintLimits`);
- ``retain``: the prefix's recency is refreshed, as a request using it would;
- ``demote``: the prefix is the first to go when room is needed (its recency set to the oldest).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from .cache import TieredCache
from .policy.hints import Hint, HintError, HintLimits, check_prefix
from .speculation import Speculation
from .tiers.base import HOST, TIERS
from .tree.node import TreeNode

HINT_TRIGGER = "hint"


class HintDesk:
    """Applies hints for one `RequestController` (its owner calls `expire` as time passes), on its
    `cache`, submitting prefetches through its `speculation` (same guard, same job limit), with its
    `clock`.

    Contract: `apply(hint, tokens)` runs `hint` on the prefix `tokens` (the caller resolved a
    session to its tokens) and returns the tokens it acted on (0: nothing cached matched, the guard
    refused, or no room); a hint that cannot run raises `HintError` (an oversized or over-long pin).
    Never waits on I/O. Every pin ends: at its expiry (`expire`), or at `shutdown`.
    `counts` tallies applied hints per action, `rejected` the refused ones.
    """

    def __init__(self, cache: TieredCache, speculation: Speculation, clock: Callable[[], float],
                 limits: HintLimits | None = None) -> None:
        self.cache = cache
        self.speculation = speculation
        self.clock = clock
        self.limits = limits or HintLimits()
        self._pins: list[tuple[float, int, TreeNode, int]] = []  # (expiry, seq, locked node, tokens)
        self._seq = itertools.count()
        self.pinned_tokens = 0
        self.counts = {a: 0 for a in ("prefetch", "pin", "retain", "demote")}
        self.rejected = 0

    def apply(self, hint: Hint, tokens: Sequence[int]) -> int:
        try:
            return self._apply(hint, tokens)
        except HintError:
            self.rejected += 1  # every refusal, counted once, whoever calls
            raise

    def _apply(self, hint: Hint, tokens: Sequence[int]) -> int:
        cache = self.cache
        check_prefix(len(tokens), cache.page_size)
        aligned = cache.tree.page_aligned(tokens)
        self.expire()
        m = cache.match(tokens[:aligned], touch=False, count=False)
        if not m.path:
            return 0
        now = self.clock()
        if hint.action == "retain":
            cache.match(tokens[:aligned], touch=True, count=False)
        elif hint.action == "demote":
            self._demote(m.path)
        else:
            if hint.action == "pin":
                if not cache.has_tier(HOST):
                    raise HintError("a pin needs a host tier")
                self.limits.check_pin(m.tokens, hint.ttl_s or 0.0, self.pinned_tokens, cache.stores[HOST].capacity_pages * cache.page_size)
            if m.disk_tokens:
                self._prefetch(m.path[-1], now)
            if hint.action == "pin":
                cache.lock(m.last_node)
                heapq.heappush(self._pins, (now + (hint.ttl_s or 0.0), next(self._seq), m.last_node, m.tokens))
                self.pinned_tokens += m.tokens
        self.counts[hint.action] += 1
        return m.tokens

    def _prefetch(self, node: TreeNode, now: float) -> None:
        """`node`'s path disk -> host, node by node (root first, each over host pages ranked below
        it), as speculative jobs of the controller, under the guard, up to its budget."""
        spec = self.speculation
        left = spec.prediction_budget()
        if not any(n.host is None and n.device is None for n in node.path_from_root()):
            return
        if spec.admit(HINT_TRIGGER) is None:  # one decision per hint
            return
        for n in node.path_from_root():
            if n.host is not None or n.device is not None or n.parent is None:
                continue
            if len(spec.predicted) >= spec.settings.max_predicted_jobs:
                return
            tokens = n.num_pages * self.cache.page_size
            if left is not None and tokens > left:
                return  # it would not land in time: the demand load does the rest
            job = spec.promote_fresh(n, now, may_evict=True)
            if job is None:
                return
            spec.submit(job, HINT_TRIGGER)
            if left is not None:
                left -= tokens

    def _demote(self, path: list[TreeNode]) -> None:
        """The prefix goes first: its recency set to the oldest (each node re-queued as an eviction
        candidate where its tier keeps an incremental order, since its key went down)."""
        tree = self.cache.tree
        for n in path:
            n.last_access = 0.0
        tree.touched()
        if getattr(tree, "leaves", None):
            for n in path:
                for tier in TIERS:
                    if n.in_tier(tier):
                        tree.leaf_queue(tier).push(n)

    def expire(self) -> int:
        """Unlock the pins whose time is up. Returns how many ended."""
        now = self.clock()
        ended = 0
        while self._pins and self._pins[0][0] <= now:
            _, _, node, tokens = heapq.heappop(self._pins)
            self.cache.unlock(node)
            self.pinned_tokens -= tokens
            ended += 1
        return ended

    def shutdown(self) -> None:
        """End every pin now."""
        while self._pins:
            _, _, node, tokens = heapq.heappop(self._pins)
            self.cache.unlock(node)
            self.pinned_tokens -= tokens

    @property
    def pins(self) -> int:
        return len(self._pins)
