"""The two in-memory stores: the device KV pool and the host DRAM buffer."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ..config import KVLayout
from ..hashing import PageKey
from .base import DEVICE, HOST, Handle, LayeredPages, PageViews, SlotAllocator, TierStore


class _SlotStore(TierStore):
    """Shared allocation for stores whose handles are integer page slots."""

    def __init__(self, layout: KVLayout, page_size: int, capacity_pages: int) -> None:
        super().__init__(layout, page_size, capacity_pages)
        self._slots = SlotAllocator(capacity_pages)

    @property
    def free_pages(self) -> int:
        return self._slots.free_count

    def allocate(self, keys: Sequence[PageKey]) -> array | None:
        return self._slots.allocate(len(keys))

    def free(self, handles: Sequence[Handle]) -> None:
        self.free_runs((handles,))

    def free_runs(self, runs: Sequence[Sequence[Handle]]) -> None:
        try:  # all or nothing: a KeyError leaves the accounting untouched
            self._slots.free_runs(runs)
        except KeyError as exc:
            raise KeyError(f"{self.name}: {exc.args[0]}") from None


class DeviceKVPool(_SlotStore, PageViews, LayeredPages):
    """The device tier for the embedded engine: a KV pool laid out as SGLang lays out its own,
    `(layers, K/V, slots, kv heads, head dim)`, allocated a page at a time.

    On a CUDA machine the pool lives on the GPU; on a CPU it is an ordinary tensor. The SGLang
    backend wraps SGLang's own pool behind the same protocol instead (`sgl_hicache.sglang`).
    """

    name = DEVICE

    def __init__(
        self, layout: KVLayout, page_size: int, capacity_pages: int, device: str | torch.device | None = None
    ) -> None:
        super().__init__(layout, page_size, capacity_pages)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.kv = torch.zeros(
            (layout.num_layers, layout.kv_planes, capacity_pages * page_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.torch_dtype,
            device=self.device,
        )
        self._pages = self.kv.view(layout.num_layers, layout.kv_planes, capacity_pages, page_size, *self.page_shape[3:])
        self._views: list[torch.Tensor | None] = [None] * capacity_pages  # page_view's, made on first use

    def token_slots(self, handles: Sequence[Handle]) -> torch.Tensor:
        """Token indices of the pages, in order: what an attention kernel reads."""
        pages = torch.as_tensor(list(handles), dtype=torch.int64, device=self.device)
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    @property
    def pages(self) -> torch.Tensor:
        """The pool viewed page by page: `(layers, K/V, pages, page tokens, heads, dim)`, no copy."""
        return self._pages

    def layer_pages(self, layer: int, kv: int) -> torch.Tensor:
        """K (`kv=0`) or V (`kv=1`) of one layer, page by page: `(pages, page tokens, heads, dim)`, no copy."""
        return self.pages[layer, kv]

    def page_view(self, handle: Handle) -> torch.Tensor:
        """One page in place, in the canonical page shape (strided: one run per layer and K/V)."""
        view = self._views[handle]
        if view is None:  # (two threads may both make it: the same view)
            view = self._views[handle] = self._pages[:, :, handle]
        return view

    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        # one strided copy per page into the output: no gathered intermediate, no second permute pass
        out = torch.empty((len(handles), *self.page_shape), dtype=self.kv.dtype, device=self.device)
        pages = self.pages
        for i, h in enumerate(handles):
            out[i].copy_(pages[:, :, h])
        return out

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        self._check_data(handles, data)
        pages = self.pages
        for i, h in enumerate(handles):
            pages[:, :, h].copy_(data[i], non_blocking=True)


# below this page size one `index_copy_` beats a copy per page (torch 2.13 CPU, one thread: 8 KiB pages
# 58 against 132 us for 32 pages, 32 KiB pages 203 against 167)
INDEX_COPY_BELOW_BYTES = 16 << 10
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _slot_index(handles: Sequence[Handle]) -> torch.Tensor:
    """Slots as an int64 index tensor, through an int64 array (a copy the tensor keeps alive)."""
    return torch.frombuffer(array("q", handles), dtype=torch.int64)


class HostKVBuffer(_SlotStore, PageViews):
    """The host tier: one DRAM buffer laid out page-first, `(pages, layers, K/V, tokens, heads, dim)`,
    so that a page is one contiguous run of bytes for disk I/O. Pinned when CUDA is present, so
    host->device copies can run asynchronously on a stream.
    """

    name = HOST

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        capacity_pages: int,
        pin_memory: bool | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__(layout, page_size, capacity_pages)
        if buffer is None:
            pin = torch.cuda.is_available() if pin_memory is None else pin_memory
            self.pinned = bool(pin)
            buffer = torch.zeros((capacity_pages, *self.page_shape), dtype=layout.torch_dtype, pin_memory=self.pinned)
        else:  # a caller's memory (tiers/shared_host.py: one buffer mapped by every TP rank)
            if tuple(buffer.shape) != (capacity_pages, *self.page_shape) or buffer.dtype != layout.torch_dtype:
                raise ValueError(
                    f"host: buffer of {tuple(buffer.shape)} / {buffer.dtype}, expected "
                    f"{(capacity_pages, *self.page_shape)} / {layout.torch_dtype}"
                )
            self.pinned = bool(pin_memory)
        self.buffer = buffer
        # page_view's views, made on first use: a transfer asks for every page's view, and indexing
        # the buffer each time cost more than the copy of a small page (a few hundred bytes a view)
        self._views: list[torch.Tensor | None] = [None] * capacity_pages

    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        # one `index_select` gather over the page axis, its index built through an int64 array: as
        # fast as a copy per page for MB pages, 5-25x faster for a few dozen small ones (advanced
        # indexing, `buffer[idx]`, took ~50x longer: benchmarks/engine/replay_scale.py, real-bytes mode)
        if not handles:
            return self.buffer[:0].clone()
        return self.buffer.index_select(0, _slot_index(handles))

    def page_view(self, handle: Handle) -> torch.Tensor:
        """The page's bytes in place (no copy): what the disk tier writes from and reads into."""
        view = self._views[handle]
        if view is None:  # (two threads may both make it: the same view)
            view = self._views[handle] = self.buffer[handle]
        return view

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        self._check_data(handles, data)
        buffer = self.buffer
        if len(handles) == 0:
            return
        if self.page_bytes < INDEX_COPY_BELOW_BYTES and data.device == buffer.device and data.dtype == buffer.dtype:
            # small pages: one call (a call per page cost 10-25x more, and each releases the GIL), on
            # integers of the element's width (CPU torch has no index_copy_ for fp8)
            bits = _SAME_WIDTH_INT[buffer.element_size()]
            buffer.view(bits).index_copy_(0, _slot_index(handles), data.view(bits))
            return
        # large pages (a copy per page is 1.2-3x faster than index_copy_), or data to convert
        for i, h in enumerate(handles):
            buffer[h].copy_(data[i])
