"""A node of the tiered radix tree: a run of whole pages and where copies of them live."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Sequence
from itertools import compress
from operator import ne
from typing import Any, Protocol

import numpy as np

from ..hashing import PageKey, chain_keys, tokens_bytes
from ..tiers.base import DEVICE, DISK, HOST, Handle
from .edge_counts import EdgeCounts

_ids = itertools.count()


class IncomingCopy(Protocol):
    """A copy into one tier of a node, prepared and not completed yet: a `transfer.ops.TransferOp`,
    which the tree (a layer below the transfers) files in `TreeNode.incoming` and never reads.

    Contract: `settled` is True once the copy's outcome may be recorded, and stays True.
    """

    @property
    def kind(self) -> str: ...

    @property
    def dst(self) -> str: ...

    @property
    def settled(self) -> bool: ...


class _Unwritten(dict):
    """The empty mapping every node starts with in place of each of its per-node dicts, shared by
    all nodes: a leaf never writes most of them, and a dict per node and field made every insert
    pay for allocations (and garbage-collector passes) it did not use. Reading it is reading an
    empty dict; a writer replaces it with a dict of the node's own first (`own_dict`)."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("the shared empty mapping of a node is never written: `own_dict` first")

    __setitem__ = __delitem__ = setdefault = update = clear = popitem = __ior__ = _refuse  # type: ignore[assignment]


UNWRITTEN: dict = _Unwritten()


class _NoCounts(EdgeCounts):
    """`TreeNode.child_traffic` of a node no match has gone on from yet, shared by all such nodes
    (read as empty; `tree.traffic.count_edge` gives the node counts of its own at the first one)."""

    __slots__ = ()

    def __setitem__(self, key: bytes, value: float) -> None:
        raise TypeError("the shared empty counts are never written")


NO_COUNTS: EdgeCounts = _NoCounts()


# A child's key in its parent's `children` and traffic counts: its first page as int64 bytes. Bytes,
# not a tuple of ints: a bytes object hashes once (the hash is cached) and compares by memcmp, where
# a tuple of a page's ints is rebuilt, rehashed and compared int by int at every lookup.
EdgeKey = bytes


def edge_key_of(page: Sequence[int]) -> EdgeKey:
    """The key of the edge whose first page is `page` (exactly one page of token ids)."""
    return tokens_bytes(page)


class TreeNode:
    """One edge of the radix tree: `tokens` (a whole number of pages, an int64 array: 8 bytes a token,
    where a tuple of ints took ~40), their chained `keys`, and the
    tiers that hold a copy: `device`, `host` and `disk` are per-page handles in that tier (None when
    absent): the slot tiers' (device, host) as one int64 `array` per node, so splitting, comparing
    and freeing a node's pages are C copies, not a Python object per page; the disk tier's handles
    are the page keys, a list. Residency is symmetric: every tier is read and
    written the same way (`in_tier`, `handles`).

    Counters the policies read: `lock_ref` (requests using the node; a locked node is never evicted
    from any tier), `pins` (transfers reading or writing it; a pinned node is never evicted or
    split), `hit_count`, `last_access`, and `child_traffic` (decayed counts of how often a match went
    on from this node into each child, keyed by the child's first page; read by the predictor).
    """

    __slots__ = (
        "id",
        "parent",
        "children",
        "tokens",
        "_bytes",
        "_edge",
        "_keys",
        "num_pages",
        "device",
        "host",
        "disk",
        "lock_ref",
        "pins",
        "hit_count",
        "last_access",
        "keep_until",
        "child_traffic",
        "traffic_stamp",
        "prefetched",
        "incoming",
        "children_in",
        "traffic_stops",
        "stops_at",
        "prefetch_trigger",
    )

    def __init__(
        self,
        parent: TreeNode | None,
        tokens: array | tuple[int, ...],
        keys: list[PageKey] | None,
        num_pages: int,
        node_id: int | None = None,
    ) -> None:
        self.id = next(_ids) if node_id is None else node_id
        self.parent = parent
        self.children: dict[EdgeKey, TreeNode] = {}
        self.tokens = tokens
        self._bytes: bytes | None = None  # `tokens` as int64 bytes, made on first use
        self._edge: EdgeKey | None = None  # `edge_key`, made on first use (or given by the tree)
        # computed on first use (disk I/O, restart lookups): hashing every page of every insert
        # would cost more than the tree walk itself when pages never reach the disk tier
        self._keys = keys
        self.num_pages = num_pages
        self.device: array | None = None
        self.host: array | None = None
        self.disk: list[PageKey] | None = None
        self.lock_ref = 0
        self.pins = 0
        self.hit_count = 0
        self.last_access = 0.0
        # a retention keeps it on host until then (clock seconds): it lands there as just used
        self.keep_until = 0.0
        # the dicts below start as the shared empty ones (`UNWRITTEN`, `NO_COUNTS`): a writer makes
        # the node's own first
        self.child_traffic = NO_COUNTS
        self.traffic_stamp = 0.0
        # requests whose path ended here since one last went on below (decayed, as of `stops_at`):
        # the traffic that says "do not go on" (`tree.traffic.count_stop`)
        self.traffic_stops = 0.0
        self.stops_at = 0.0
        # set by a prefetch or a prediction until a request uses the node: "prefetch" | "predict" | None
        self.prefetched: str | None = None
        # the trigger of the prediction that brought it (`speculation.trigger_of`), for the guard
        self.prefetch_trigger: str | None = None
        # transfers prepared into a tier and not yet completed, by destination tier
        self.incoming: dict[str, IncomingCopy] = UNWRITTEN
        # children resident in each tier, kept by the tree on every residency change: "is a leaf of
        # this tier" in O(1), even for a node with thousands of children
        self.children_in: dict[str, int] = UNWRITTEN

    def own_dict(self, field: str) -> dict:
        """The node's own dict in `field` (`incoming` or `children_in`), made on the first write."""
        d = getattr(self, field)
        if d is UNWRITTEN:
            d = {}
            setattr(self, field, d)
        return d

    @property
    def keys(self) -> list[PageKey]:
        """One chained key per page (the root holds the namespace root as its only key)."""
        if self._keys is None:
            assert self.parent is not None, "a detached node has no key chain"
            self._keys = chain_keys(self.parent.last_key, self.tokens, len(self.tokens) // self.num_pages)
        return self._keys

    @property
    def token_bytes(self) -> bytes:
        """`tokens` as int64 bytes (`hashing.tokens_bytes`): edges compare at memcmp speed."""
        if self._bytes is None:
            self._bytes = tokens_bytes(self.tokens)
        return self._bytes

    @property
    def edge_key(self) -> EdgeKey:
        """The first page's token ids (`edge_key_of`): this node's key in its parent's `children` and
        `child_traffic`. Kept once made: it is the very object the parent's dicts hold."""
        if self._edge is None:
            self._edge = edge_key_of(self.tokens[: len(self.tokens) // self.num_pages])
        return self._edge

    def set_tokens(self, tokens: array | tuple[int, ...]) -> None:
        self.tokens = tokens
        self._bytes = None
        self._edge = None

    def split_keys(self, pages: int) -> tuple[list[PageKey] | None, list[PageKey] | None]:
        """Keys of the first `pages` pages and of the rest, without computing uncomputed keys."""
        if self._keys is None:
            return None, None
        return self._keys[:pages], self._keys[pages:]

    def set_keys(self, keys: list[PageKey] | None) -> None:
        self._keys = keys

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def last_key(self) -> PageKey:
        return self.keys[-1]

    def in_tier(self, tier: str) -> bool:
        return getattr(self, tier) is not None

    def handles(self, tier: str) -> Sequence[Handle]:
        """This node's per-page handles in `tier` (which must hold a copy): an int64 `array` of
        slots (device, host) or a list of page keys (disk)."""
        handles = getattr(self, tier)
        assert handles is not None, f"{self} holds no copy in {tier}"
        return handles

    def tiers(self) -> tuple[str, ...]:
        """The tiers holding a copy, fastest first (one table lookup: it runs on every lock and
        residency change)."""
        return _TIERS_OF[(self.device is not None) | (self.host is not None) << 1 | (self.disk is not None) << 2]

    @property
    def evictable(self) -> bool:
        return self.lock_ref == 0 and self.pins == 0 and not self.is_root

    def path_from_root(self) -> list[TreeNode]:
        """Ancestors then self, root excluded."""
        path: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None and not node.is_root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages={self.num_pages}, tiers={self.tiers()}, lock={self.lock_ref}, pins={self.pins})"


# `TreeNode.tiers()` by residency bitmask (bit 0 device, 1 host, 2 disk)
_TIERS_OF: tuple[tuple[str, ...], ...] = tuple(
    tuple(t for bit, t in enumerate((DEVICE, HOST, DISK)) if mask >> bit & 1) for mask in range(8)
)


def split_handles(handles: Sequence[Handle] | None, at: int) -> tuple[Any, Any]:
    """The first `at` handles and the rest, each a new sequence of the same kind (a node's handles
    are an int64 `array` or a list: slices of either are copies already)."""
    if handles is None:
        return None, None
    return handles[:at], handles[at:]


def slot_array(handles: Iterable[Handle]) -> array:
    """Slot handles (ints) as a new int64 `array`, the form the tree keeps for the slot tiers."""
    if type(handles) is array and handles.typecode == "q":
        return array("q", handles)  # (a copy at C speed)
    try:
        return array("q", handles)
    except (TypeError, OverflowError) as exc:
        raise TypeError(f"slot handles must be ints: {exc}") from None


def differing(mine: array, theirs: array) -> Iterable[int]:
    """The handles of `mine` that differ from `theirs` at the same place (two int64 arrays of one
    length), in order: one vectorised comparison for a long node, a C-level iteration for a short
    one (where numpy's fixed cost is the larger)."""
    if len(mine) <= _SHORT:
        return compress(mine, map(ne, mine, theirs))
    a = np.frombuffer(mine, dtype=np.int64)
    out = array("q")
    out.frombytes(a[a != np.frombuffer(theirs, dtype=np.int64)].tobytes())
    return out


_SHORT = 24  # (measured: below about this many pages the iteration is the cheaper)
