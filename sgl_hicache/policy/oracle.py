"""The ceiling: Belady eviction with the trace's future known, plus perfect prefetch.

Only a replay can run it (it reads the requests that have not arrived yet); every other policy's
gain is reported as a share of the oracle's gain over LRU. Pure decision code like the other
policies: it orders eviction candidates and names nodes to promote; the cache moves the bytes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from ..hashing import PageKey, chain_keys
from ..tree.node import TreeNode
from ..tree.radix import RadixTree
from .predictor import Prediction, Predictor


class FutureIndex:
    """Which requests (by position in arrival order) use which page.

    A page is named by its chained key (`hashing.chain_keys`), so a tree node's first key names
    exactly the prefix up to and including its first page: the next request holding that key is the
    next one to hit the node (at least its first page). `cursor` is the position of the first
    request not admitted yet; `next_use(node)` never looks before it.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], root_key: PageKey, page_size: int) -> None:
        self.page_size = page_size
        self.uses: dict[PageKey, list[int]] = {}
        for pos, tokens in enumerate(prompts):
            whole = len(tokens) // page_size * page_size
            for key in chain_keys(root_key, tokens[:whole], page_size):
                self.uses.setdefault(key, []).append(pos)
        self.cursor = 0

    def next_use(self, node: TreeNode) -> float:
        """Position of the next request (not admitted yet) that uses `node`'s first page; inf if none."""
        if node.parent is None:
            return -1.0  # the root is used by everyone
        uses = self.uses.get(node.keys[0])
        if not uses:
            return math.inf
        i = bisect.bisect_left(uses, self.cursor)
        return float(uses[i]) if i < len(uses) else math.inf


class Oracle:
    """Belady-style retention and perfect prefetch over a known request sequence.

    Contract:
    - `priority(node)` is an eviction priority (the lowest is evicted first): the node whose next use
      is furthest in the future (or never) goes first, in every tier, ties broken by recency.
    - `admitted(position)` moves the present forward (the engine calls it as each request is admitted,
      in arrival order); `arrived(position)` tells the predictor which requests are already known.
    - `predictor` names, for each arrival, the tree nodes that the next `lookahead` requests (not yet
      arrived) will match but that are not on host or device: a prefetch that is never wrong.
    """

    def __init__(self, page_size: int, lookahead: int = 8) -> None:
        """Made before the cache it orders (its `priority` and `predictor` are passed to the cache
        and the controller at construction); `bind` gives it the future and the tree."""
        self.page_size = page_size
        self.prompts: Sequence[Sequence[int]] = ()
        self.tree: RadixTree | None = None
        self.index: FutureIndex | None = None
        self.lookahead = lookahead
        self.arrived_upto = 0
        self.predictor = _OraclePredictor(self)

    def bind(self, prompts: Sequence[Sequence[int]], tree: RadixTree) -> None:
        """The requests to come, in arrival order, and the tree they will be matched in."""
        self.prompts = prompts
        self.tree = tree
        self.index = FutureIndex(prompts, tree.root.last_key, self.page_size)

    def priority(self, node: TreeNode) -> tuple:
        return (-self.index.next_use(node), node.last_access, node.id)  # type: ignore[union-attr]

    def admitted(self, position: int) -> None:
        self.index.cursor = max(self.index.cursor, position + 1)  # type: ignore[union-attr]

    def arrived(self, position: int) -> None:
        self.arrived_upto = max(self.arrived_upto, position + 1)

    def upcoming_nodes(self) -> list[TreeNode]:
        """Nodes the next `lookahead` not-yet-arrived requests will match, root first per request."""
        out: list[TreeNode] = []
        seen: set[int] = set()
        for pos in range(self.arrived_upto, min(len(self.prompts), self.arrived_upto + self.lookahead)):
            path, _ = self.tree.walk(self.prompts[pos], split=False)  # type: ignore[union-attr]
            for node in path:
                if node.id not in seen:
                    seen.add(node.id)
                    out.append(node)
        return out


class _OraclePredictor(Predictor):
    """The oracle's perfect prefetch as a `Predictor`: the future requests' paths, deepest last.
    It may evict (`may_evict`): Belady's order only ever pushes out a page used later than these."""

    name = "oracle"
    may_evict = True
    knows_future = True

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle

    def predict(self, start: TreeNode, now: float, budget_tokens: int | None = None) -> list[Prediction]:
        return [Prediction(n, 1.0) for n in self.oracle.upcoming_nodes() if n.device is None and n.host is None]
