"""Metadata-only tier stores: the accounting of a store without its bytes.

Capacity planning over a production trace needs what the cache decides (which pages sit in which
tier, what moves where, when) and what the cost model charges for it, not the bytes themselves. These
stores allocate and free exactly as the real ones do (`DeviceKVPool`/`HostKVBuffer` slots, the disk
store's content-addressed keys), so the tree, the policies and every counter run unchanged; a copy
between them moves nothing. `TransferOp.nbytes` is still counted by the cache, and the embedded
engine's clock still charges every transfer at the model's KV size.

Used by the embedded engine's `--bytes metadata` (`EngineConfig.byte_mode`). A store here never
holds KV, so nothing may ever serve a request from it: only the embedded engine, whose "KV" is never
read by a model, may use them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..config import KVLayout
from ..hashing import PageKey
from .base import DEVICE, DISK, HOST, Handle, KeyedStore, TierStore
from .memory import _SlotStore

_NO_BYTES = torch.empty(0)


class MetadataSlotStore(_SlotStore):
    """Device or host tier as slots only. Contract: `TierStore`'s allocation contract exactly;
    `write` records nothing, `read` returns an empty tensor (there are no bytes)."""

    def __init__(self, name: str, layout: KVLayout, page_size: int, capacity_pages: int) -> None:
        if name not in (DEVICE, HOST):
            raise ValueError(f"a slot store is the device or the host tier, not {name!r}")
        super().__init__(layout, page_size, capacity_pages)
        self.name = name

    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        return _NO_BYTES

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        return None


_RESERVED, _STORED = 0, 1


class MetadataDiskStore(KeyedStore):
    """The disk tier as an index of page keys (reserved -> stored), no files. Contract: the
    `DiskPageStore` accounting the cache relies on (`allocate` by key, all or nothing; `free` by key;
    `contains`, `keys`, `stored_pages`, `overfull_pages`); `read` of a page never written raises
    KeyError, as a missing file would."""

    name = DISK

    def __init__(self, layout: KVLayout, page_size: int, capacity_pages: int) -> None:
        super().__init__(layout, page_size, capacity_pages)
        self._index: dict[PageKey, int] = {}
        self._n_reserved = 0

    @property
    def free_pages(self) -> int:
        return max(0, self.capacity_pages - len(self._index))

    @property
    def stored_pages(self) -> int:
        return len(self._index) - self._n_reserved

    overfull_pages = 0  # nothing survives from an earlier process
    write_disabled = False

    def contains(self, key: PageKey) -> bool:
        return self._index.get(key) == _STORED

    def keys(self) -> Iterator[PageKey]:
        return iter([k for k, s in self._index.items() if s == _STORED])

    def allocate(self, keys: Sequence[PageKey]) -> list[Handle] | None:
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("disk: allocate got the same key twice")
        for k in keys:
            if k in self._index:
                raise ValueError(f"disk: page {bytes(k).hex()} is already allocated or stored (check contains() first)")
        if len(keys) > self.capacity_pages - len(self._index):
            return None
        for k in keys:
            self._index[k] = _RESERVED
        self._n_reserved += len(keys)
        return keys

    def free(self, handles: Sequence[Handle]) -> None:
        keys = list(handles)
        if len(set(keys)) != len(keys):
            raise KeyError("disk: free got the same key twice")
        for k in keys:
            if k not in self._index:
                raise KeyError(f"disk: page {bytes(k).hex()} is not allocated")
        for k in keys:
            if self._index.pop(k) == _RESERVED:
                self._n_reserved -= 1

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        for k in handles:
            if self._index.get(k) == _RESERVED:
                self._index[k] = _STORED
                self._n_reserved -= 1
            elif k not in self._index:
                raise KeyError(f"disk: write of page {bytes(k).hex()} that is not allocated")

    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        for k in handles:
            if self._index.get(k) != _STORED:
                raise KeyError(f"disk: page {bytes(k).hex()} is not stored")
        return _NO_BYTES


def metadata_stores(
    layout: KVLayout, page_size: int, device_pages: int, host_pages: int, disk_pages: int
) -> dict[str, TierStore]:
    """The three tiers as metadata stores (a tier of 0 pages is left out, as `TieredCache` does)."""
    stores: dict[str, TierStore] = {DEVICE: MetadataSlotStore(DEVICE, layout, page_size, device_pages)}
    if host_pages > 0:
        stores[HOST] = MetadataSlotStore(HOST, layout, page_size, host_pages)
    if disk_pages > 0:
        stores[DISK] = MetadataDiskStore(layout, page_size, disk_pages)
    return stores
