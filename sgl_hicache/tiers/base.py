"""The one protocol every tier store speaks: allocate / free / read pages / write pages.

A store is a mechanism: it holds bytes and says how many pages are free. It never decides what to
evict; the cache's policies do that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Hashable

import torch

from ..config import KVLayout
from ..hashing import PageKey

Handle = Hashable  # a slot index for device and host, the page key itself for disk

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


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
    """Canonical shape of one page as moved between stores: (layers, K/V, tokens, kv heads, head dim)."""
    return (layout.num_layers, 2, page_size, layout.num_kv_heads, layout.head_dim)


class TierStore(ABC):
    """A bounded store of KV pages in one medium.

    Contract (checked for every store by `tests/test_tier_contract.py`):
    - `allocate(keys)` reserves one page per key and returns one handle per key, or None (and
      reserves nothing) when fewer than `len(keys)` pages are free. All or nothing.
    - `free(handles)` returns pages to the store; freeing an unknown handle raises KeyError.
    - `write(handles, data)` stores `data[i]` (shape `page_shape`) under `handles[i]`;
      `read(handles)` returns a tensor of shape `(len(handles), *page_shape)` with exactly the bytes
      written. A read that cannot prove its bytes are right raises PageCorruptError.
    - `free_pages + used_pages == capacity_pages` at all times.
    Stores are not thread-safe by themselves; the cache (and the transfer engine) serialise access
    to allocation, while reads and writes of distinct, allocated handles may run concurrently.
    """

    name: str
    #: survives a restart of the process (the disk tier)
    persistent: bool = False
    #: handles are the page keys (content-addressed) rather than slots
    content_addressed: bool = False

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
    def allocate(self, keys: Sequence[PageKey]) -> list[Handle] | None: ...

    @abstractmethod
    def free(self, handles: Sequence[Handle]) -> None: ...

    @abstractmethod
    def read(self, handles: Sequence[Handle]) -> torch.Tensor: ...

    @abstractmethod
    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None: ...

    def _check_data(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        expected = (len(handles), *self.page_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"{self.name}: write of shape {tuple(data.shape)}, expected {expected}")


class SlotAllocator:
    """Free list of integer slots 0..capacity-1, with double-free detection."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        self._used.update(out)
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Free all of `slots` or, when one is not allocated (or appears twice), none of them."""
        batch = set(slots)
        if len(batch) != len(slots):
            raise KeyError("free got the same slot twice")
        if not batch <= self._used:
            raise KeyError(f"slot {min(batch - self._used)} is not allocated")
        self._used -= batch
        self._free.extend(slots)

    def is_allocated(self, slot: int) -> bool:
        return slot in self._used
