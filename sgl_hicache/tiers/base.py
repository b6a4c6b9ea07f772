"""The one protocol every tier store speaks: allocate / free / read pages / write pages.

A store is a mechanism: it holds bytes and says how many pages are free. It never decides what to
evict; the cache's policies do that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from ..config import KVLayout
from ..hashing import PageKey

# a slot index (int) for device and host, the page key itself (bytes) for disk: each store knows its
# own, so to the code between stores a handle is opaque
Handle = Any


class Tier(str, Enum):
    """The tiers, fastest first. Members are their names as strings ("device" == Tier.DEVICE), so
    they key JSON, Prometheus labels and node attributes (`TreeNode.device` / `host` / `disk`)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"  # the lower, content-addressed slot: a disk directory or a shared store

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # (Enum's differs: it formats the member's name)


DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
TIERS = tuple(Tier)


class TierIOError(OSError):
    """A store could not read or write a page. The cache turns it into a miss, never into wrong KV."""


class PageCorruptError(TierIOError):
    """A stored page failed its header, length or checksum; the store has already discarded it."""


class PeerTierError(TierIOError):
    """A copy that failed on another rank of the same tensor-parallel cache (or failed here less
    badly than there): every rank records the same outcome, so their trees stay equal. `page_gone`
    says the page is unusable on some rank (corrupt or missing), so every rank drops it."""

    def __init__(self, message: str, page_gone: bool = False) -> None:
        super().__init__(message)
        self.page_gone = page_gone


class PageGoneError(TierIOError):
    """A stored page's file was deleted under the reader (another process sharing the directory
    evicted it). A miss, not corruption; the store has already forgotten the key."""


def page_shape(layout: KVLayout, page_size: int) -> tuple[int, int, int, int, int]:
    """Canonical shape of one page as moved between stores: (layers, planes, tokens, kv heads, head
    dim); planes are K and V, or MLA's one latent row (`KVLayout.kv_planes`)."""
    return (layout.num_layers, layout.kv_planes, page_size, layout.num_kv_heads, layout.head_dim)


class TierStore(ABC):
    """A bounded store of KV pages in one medium.

    Contract (checked for every store by `tests/unit/tiers/test_tier_contract.py`):
    - `allocate(keys)` reserves one page per key and returns one handle per key (a slot store: an
      int64 `array` of slots; a keyed store: a list of the keys), or None (and reserves nothing)
      when fewer than `len(keys)` pages are free. All or nothing.
    - `free(handles)` returns pages to the store; freeing an unknown handle raises KeyError.
    - `write(handles, data)` stores `data[i]` (shape `page_shape`) under `handles[i]`;
      `read(handles)` returns a tensor of shape `(len(handles), *page_shape)` with exactly the bytes
      written. A read that cannot prove its bytes are right raises PageCorruptError.
    - `free_pages + used_pages == capacity_pages` at all times.
    Stores are not thread-safe by themselves; the cache (and the transfer engine) serialise access
    to allocation, while reads and writes of distinct, allocated handles may run concurrently.
    """

    name: str
    # Capabilities are declared here, by type, with their defaults; the cache and the byte movers
    # read them, never probe with hasattr. A subclass that has one overrides it.
    #: survives a restart of the process (the disk tier)
    persistent: bool = False
    #: handles are the page keys (content-addressed) rather than slots
    content_addressed: bool = False
    #: other servers add and remove pages at any time (a store shared between servers)
    shared: bool = False
    #: write back only pages hit at least this often (a shared store's bar; 0 = every page)
    min_hits: int = 0

    #: an evicted node's pages move down into this store (a shared store takes only hit pages)
    demote_on_evict: bool = True

    @property
    def stored_pages(self) -> int:
        """Pages this store holds for this process (a shared directory's `used_pages` counts
        every process's)."""
        return self.used_pages

    @property
    def overfull_pages(self) -> int:
        """Pages over capacity found at open (a restart with a smaller capacity) that must go."""
        return 0

    @property
    def peers_wrote(self) -> bool:
        """Another process has written into this store since it opened (a shared directory)."""
        return False

    def snapshot(self) -> dict | None:
        """The store's own counters for reports (a shared store's puts, gets, outages); None if none."""
        return None

    def __init__(self, layout: KVLayout, page_size: int, capacity_pages: int) -> None:
        if capacity_pages < 0:
            raise ValueError(f"{type(self).__name__}: capacity_pages must be >= 0, got {capacity_pages}")
        self.layout = layout
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.page_shape = page_shape(layout, page_size)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.layout.bytes_per_token

    @property
    @abstractmethod
    def free_pages(self) -> int: ...

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - self.free_pages

    @abstractmethod
    def allocate(self, keys: Sequence[PageKey]) -> Sequence[Handle] | None: ...

    @abstractmethod
    def free(self, handles: Sequence[Handle]) -> None: ...

    def free_runs(self, runs: Sequence[Sequence[Handle]]) -> None:
        """`free` each run of handles, in order, in one call (eviction frees node by node; a store
        may take them at once)."""
        for handles in runs:
            self.free(handles)

    @abstractmethod
    def read(self, handles: Sequence[Handle]) -> torch.Tensor: ...

    @abstractmethod
    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None: ...

    def _check_data(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        expected = (len(handles), *self.page_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"{self.name}: write of shape {tuple(data.shape)}, expected {expected}")


class KeyedStore(TierStore):
    """A content-addressed store, the kind the lower (disk or shared-store) slot holds: handles are
    the page keys, so pages outlive the tree that wrote them and can be found by hashing a prompt.

    Contract on top of `TierStore`: `contains(key)` answers from the store's own index with no I/O;
    `keys()` iterates what it indexes; `discover(key)` may also look where other processes write;
    `count_present(keys)` is how many leading keys the store holds (one batched round trip where
    the store is remote); `evict_unindexed(n)` frees up to `n` pages other processes wrote (0 when
    none can be); `accepts(keys)` says whether a write of those pages would be taken.
    """

    content_addressed = True

    @abstractmethod
    def contains(self, key: PageKey) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[PageKey]: ...

    def own_keys(self) -> Iterator[PageKey]:
        """The stored pages whose freeing gives this store room back: all of `keys` unless some are
        read from elsewhere (`HeadShardDiskStore`'s borrowed pages)."""
        return self.keys()

    def discover(self, key: PageKey) -> bool:
        return self.contains(key)

    def count_present(self, keys: Sequence[PageKey]) -> int:
        n = 0
        for key in keys:
            if not self.discover(key):
                break
            n += 1
        return n

    def evict_unindexed(self, num_pages: int) -> int:
        return 0

    def accepts(self, keys: Sequence[PageKey]) -> bool:
        return True


class PageViews(ABC):
    """Capability: each page is a view of one buffer (`page_view(handle)`, shape `page_shape`), so
    a copy between two such stores goes view to view with no intermediate tensor."""

    @abstractmethod
    def page_view(self, handle: Handle) -> torch.Tensor: ...


class ReadsInto(ABC):
    """Capability: `read_into(key, out)` fills a caller's page tensor in place (disk -> host with no
    intermediate copy)."""

    @abstractmethod
    def read_into(self, key: PageKey, out: torch.Tensor) -> None: ...


class WritesFrom(ABC):
    """Capability: `write_from(keys, pages)` writes each page from a caller's page tensor (a host
    tier's page views), with no gathered intermediate copy (host -> disk)."""

    @abstractmethod
    def write_from(self, handles: Sequence[Handle], pages: Sequence[torch.Tensor]) -> None: ...


class LayeredPages(ABC):
    """Capability: a device tier kept as separate per-layer buffers, one per plane (K and V, or MLA's
    latent; SGLang's pool): `layer_pages(layer, kv)` for `kv` in `range(layout.kv_planes)` is one
    layer's buffer, indexed by page; `device` is where it lives.

    `layer_space(layer)` names the index space of that layer's buffer: 0, the tier's own page
    handles, for every layer of a plain pool; another space (a hybrid sliding-window pool's window
    layers, kept in a sub-pool of their own) is reached by `space_pages(space, pages)`, the pages of
    that space holding the tier's pages `pages` (a tensor of handles, on `device`; no host sync).

    `views_every_layer` False: only some first layers have `layer_pages` views (the rest of a page,
    DSA's indexer tail, is no buffer of the pool); such pages move whole, through `read` / `write`."""

    device: torch.device
    views_every_layer: bool = True

    @abstractmethod
    def layer_pages(self, layer: int, kv: int) -> torch.Tensor: ...

    def layer_space(self, layer: int) -> int:
        return 0

    def space_pages(self, space: int, pages: torch.Tensor) -> torch.Tensor:
        return pages


class SlotAllocator:
    """Free list of integer slots 0..capacity-1, with double-free detection.

    Contract: `allocate(n)` returns `n` distinct free slots as an int64 `array` (the last freed
    first), or None when fewer are free; `free(slots)` / `free_runs(runs)` take back all of the
    slots or, when one is not allocated, out of range, not an int, or given twice, none of them
    (KeyError naming what was wrong). The free list is an int64 array and the allocation state one
    int32 per slot, checked with vectorised gathers: freeing a node's thousand pages costs a few
    C passes, not a Python operation per page."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # the free slots are `_stack[_next:]`, the next to go first (the last freed first): the
        # stack is allocated whole once, so a free is a copy into memory already there, and an
        # allocation one slice (an array grown by each free paid a reallocation and fresh pages)
        self._stack = array("q", range(capacity))
        self._stack_np = np.frombuffer(self._stack, dtype=np.int64) if capacity else np.zeros(0, dtype=np.int64)
        self._next = 0
        # per slot: 1 allocated, 0 free
        self._state = np.zeros(capacity, dtype=np.int8)
        self._repeats = RepeatCheck(capacity)

    @property
    def free_count(self) -> int:
        return self.capacity - self._next

    def allocate(self, n: int) -> Any:
        if n > self.free_count:
            return None
        out = self._take(n)
        if n:
            self._state[_as_index(out)] = 1
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Free all of `slots` or, when one is not allocated (or appears twice), none of them."""
        self.free_runs((slots,))

    def free_runs(self, runs: Sequence[Sequence[int]]) -> None:
        """`free` of all the slots of `runs` at once (the free list takes them run by run, in order)."""
        idx = self._batch(runs)
        n = len(idx)
        if n == 0:
            return
        cap = self.capacity
        # one pass for both bounds: a negative slot read as unsigned is past any capacity
        if n > cap or int(idx.view(np.uint64).max()) >= cap:
            bad = idx[(idx < 0) | (idx >= cap)]
            raise KeyError(f"slot {int(bad[0])} is not allocated" if len(bad) else "free got the same slot twice")
        state = self._state
        if n * 128 >= cap:
            # a large batch (eviction's): free them all, then count what is still allocated; it fell
            # by exactly `n` only if every slot was allocated and none came twice (two passes in C,
            # one of them sequential, where a check per slot took three random ones)
            state[idx] = 0
            if cap - self.free_count - n != np.count_nonzero(state):
                self._undo_free(idx)
        else:
            if not state[idx].all():
                raise KeyError(f"slot {int(idx[state[idx] == 0].min())} is not allocated")
            if n > 1 and self._repeats(idx):
                raise KeyError("free got the same slot twice")
            state[idx] = 0
        self._give(idx)

    def _batch(self, runs: Sequence[Sequence[int]]) -> np.ndarray:
        """The slots of `runs`, in order, as one int64 numpy array: a view of the run itself when it
        is one int64 `array`, else their bytes joined in one C call."""
        if len(runs) == 1 and type(runs[0]) is array and runs[0].typecode == "q":
            return _as_index(runs[0])
        try:
            arrays = [r if type(r) is array and r.typecode == "q" else array("q", r) for r in runs]
        except (TypeError, OverflowError):
            raise KeyError(f"free got a slot that is not an int: {_first_non_int(runs)!r}") from None
        return np.frombuffer(b"".join(arrays), dtype=np.int64)

    def _undo_free(self, idx: np.ndarray) -> None:
        """A large free found a slot not allocated or given twice, after marking the batch free:
        restore the state (the free slots are exactly those on the free list) and raise naming it."""
        state = self._state
        state[idx] = 1
        state[_as_index(self._free_slots())] = 0
        not_allocated = idx[state[idx] == 0]
        if len(not_allocated):
            raise KeyError(f"slot {int(not_allocated.min())} is not allocated")
        raise KeyError("free got the same slot twice")

    def _free_slots(self) -> Any:
        """The free slots (an int64 array or a list), in no particular order."""
        return self._stack[self._next :]

    def _take(self, n: int) -> Any:
        """Remove `n` (<= free_count) slots from the free list: the last freed first."""
        start = self._next
        self._next = start + n
        return self._stack[start : start + n]

    def _give(self, slots: np.ndarray) -> None:
        """Put back checked, distinct `slots`, in order (the last one goes first)."""
        end = self._next
        self._next = start = end - len(slots)
        self._stack_np[start:end] = slots[::-1]

    def is_allocated(self, slot: int) -> bool:
        return isinstance(slot, int) and 0 <= slot < self.capacity and bool(self._state[slot])


def _as_index(slots: Any) -> np.ndarray:
    """An int64 array of slots as a numpy view (no copy), or a list of them as a new one."""
    if type(slots) is array:
        return np.frombuffer(slots, dtype=np.int64) if len(slots) else np.zeros(0, dtype=np.int64)
    return np.asarray(slots, dtype=np.int64)


class RepeatCheck:
    """Whether a batch of page ids (or slots) repeats one, in O(n): each page's entry in a
    scratch array (one int32 per page of a pool of `num_pages`, made on first use) takes the
    position in the batch that writes it last, so a repeated page reads back another position than
    its own. A sort, the O(n log n) way, cost 3-9x as much on batches of 1,000-20,000 pages (at page
    1 an eviction frees one page per token). Not thread-safe: the cache serialises its stores."""

    SMALL = 32  # up to this many, a set

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._stamps: np.ndarray | None = None
        self._positions = np.arange(0, dtype=np.int32)

    def __call__(self, handles: Sequence[Handle] | np.ndarray) -> bool:
        n = len(handles)
        if n <= self.SMALL:  # (a numpy batch as Python ints: hashing numpy scalars costs more)
            return len(set(handles.tolist() if isinstance(handles, np.ndarray) else handles)) != n
        pages = (
            np.frombuffer(handles, dtype=np.int64)
            if type(handles) is array and handles.typecode == "q"
            else np.asarray(handles, dtype=np.int64)
        )
        if pages.min() < 0 or pages.max() >= self.num_pages:  # not pages of this pool: the sort
            ordered = np.sort(pages)
            return bool((ordered[1:] == ordered[:-1]).any())
        if self._stamps is None:
            self._stamps = np.zeros(self.num_pages, dtype=np.int32)
        if len(self._positions) < n:
            self._positions = np.arange(max(n, 2 * len(self._positions)), dtype=np.int32)
        positions = self._positions[:n]
        self._stamps[pages] = positions
        return bool((self._stamps[pages] != positions).any())


def _first_non_int(runs: Sequence[Sequence[object]]) -> object:
    return next((s for run in runs for s in run if not isinstance(s, int) or not -(2**63) <= s < 2**63), None)
