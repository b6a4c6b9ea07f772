"""The device tier of the SGLang backend: SGLang's own KV pool and allocator behind `TierStore`.

Handles are SGLang page indices (token slot // page_size; with page size 1 a handle is a token slot).
Pages move in the canonical page shape `(layers, planes, page_size, kv_heads, head_dim)` (planes: K and
V, or MLA's one latent row), so the host and disk stores of `sgl_hicache.tiers` work unchanged.

Accounting. SGLang's pool is shared: the tree owns some pages, running requests own the rest of the
used ones (allocated by SGLang's scheduler, not through this store). So:
- `free_pages` is the allocator's real free count;
- `used_pages` counts only the pages the cache owns: pages it allocated here (promotion destinations)
  plus pages it took over from requests (`adopt`), minus what it freed here;
- `capacity_pages` is therefore `free_pages + used_pages`: what the cache could hold if no request
  held KV. `pool_pages` is the pool's full size. When no request runs,
  `pool_pages == free_pages + used_pages` must hold (checked by the backend's `pool_accounting`).

The pool's kind is addressed through its adapter (`pool_adapters.PoolAdapter`: MHA, fp8 MHA, MLA,
hybrid sliding window); nothing here depends on the kind. A hybrid sliding-window pool's window
layers keep their rows in a sub-pool of their own: `layer_space(layer)` is 1 for them and
`space_pages(1, pages)` their pages there (SGLang's full -> window mapping). A page whose last layers
are no buffer of the pool (DSA's indexer pages, the adapter's tail layers) has layer views for its
first `adapter.view_layers` only (`views_every_layer` False): those pages move whole, through `read`
and `write`. An unsupported pool raises `UnsupportedPool` at start, naming what was found and what to
run instead.
"""

from __future__ import annotations

import contextlib
import functools
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from ..config import KVLayout
from ..hashing import PageKey
from ..tiers.base import DEVICE, Handle, LayeredPages, RepeatCheck, TierStore, page_shape
from .kinds.pool_adapters import DraftPoolsAdapter, PoolAdapter, UnsupportedPool, adapter_for  # noqa: F401 (UnsupportedPool: re-exported)


def layout_of(kvcache, architecture: str = "llama") -> KVLayout:
    """The `KVLayout` of an SGLang KV pool, validated (`pool_adapters.adapter_for`)."""
    return adapter_for(kvcache, architecture).layout


# SGLang's plain allocators take page ids as they are (`free_page_ids`: allocator/token.py:77,
# allocator/paged.py:359): no expansion to token slots that `free` turns back into pages with
# `torch.unique` (a sort, and a device sync on a GPU). Other allocators get token slots (`free`).
_FREES_PAGE_IDS = frozenset({"TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"})


class SGLangDevicePool(TierStore, LayeredPages):
    """`TierStore` over SGLang's `token_to_kv_pool_allocator` and its KV pool (see module docstring)."""

    name = DEVICE

    def __init__(self, allocator, architecture: str = "llama", draft_pools: Sequence[Any] = ()) -> None:
        """`draft_pools`: a speculative draft model's KV pools at the same token slots (EAGLE / MTP),
        tiered as further layers of each page (`pool_adapters.DraftPoolsAdapter`)."""
        # TierStore.__init__ would set capacity_pages, which is derived here: set the fields directly.
        self.allocator = allocator
        self.kvcache = allocator.get_kvcache()
        self.adapter: PoolAdapter = adapter_for(self.kvcache, architecture)
        self.adapter.check_allocator(allocator)
        if draft_pools:
            self.adapter = DraftPoolsAdapter(
                self.adapter, [adapter_for(p, f"{architecture}:draft") for p in draft_pools]
            )
        self.layout = self.adapter.layout
        self.page_size = int(allocator.page_size)
        self.page_shape = page_shape(self.layout, self.page_size)
        self.pool_pages = int(allocator.size) // self.page_size
        self.device = self.adapter.device
        self.planes = self.layout.kv_planes
        self._dtype = self.layout.torch_dtype
        self._owned = 0
        self._offsets_np = np.arange(self.page_size, dtype=np.int64)
        self._deferred: array | None = None  # pages freed inside `deferred_frees`, not yet given back
        self._frees_page_ids = type(allocator).__name__ in _FREES_PAGE_IDS
        # hybrid sliding window: the window layers' rows are reached through SGLang's slot mapping
        self._space = [1 if self.adapter.is_window(layer) else 0 for layer in range(self.adapter.view_layers)]
        self.views_every_layer = self.adapter.view_layers == self.layout.num_layers
        self._page_views: dict[int, torch.Tensor] = {}  # `layer_pages`, per layer * planes + plane
        self._has_repeats = RepeatCheck(self.pool_pages + 1)  # SGLang's page ids run 1..pool_pages

    # ---- batched frees -----------------------------------------------------------------
    @contextlib.contextmanager
    def deferred_frees(self) -> Iterator[None]:
        """Inside, `free` only collects pages; they go to SGLang's allocator in one call when the
        block ends or before the next `allocate`. One eviction frees node by node, and each
        allocator free costs a sort of its pages (`torch.unique`): batching makes it one sort per
        scheduler call. `free_pages` counts the collected pages meanwhile. Re-entrant."""
        if self._deferred is not None:
            yield
            return
        self._deferred = array("q")
        try:
            yield
        finally:
            self._flush_frees()
            self._deferred = None

    def _flush_frees(self) -> None:
        pages = self._deferred
        if pages:
            self._deferred = array("q")
            # one check over the whole batch (a page freed twice by two evictions of one call is
            # caught too): one O(n) check, where a check per free cost one per evicted node
            if self._has_repeats(pages):
                self._owned += len(pages)  # none given back: the books still count them held
                raise KeyError("device: free got the same page twice")
            self._give_back(pages)

    # ---- accounting --------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return int(self.allocator.available_size()) // self.page_size + len(self._deferred or ())

    @property
    def used_pages(self) -> int:
        return self._owned

    @property
    def capacity_pages(self) -> int:  # type: ignore[override]
        return self.free_pages + self._owned

    def adopt(self, num_pages: int) -> None:
        """The cache took over `num_pages` pages a request had allocated (an insert adopted them)."""
        self._owned += num_pages

    def disown(self, num_pages: int) -> None:
        """Pages the cache owned were handed to a request (or freed by SGLang itself)."""
        self._owned -= num_pages

    def reset_accounting(self) -> None:
        self._owned = 0

    def _give_back(self, pages: Sequence[Handle]) -> None:
        """Return checked, distinct `pages` to SGLang's allocator."""
        if self._frees_page_ids:
            self.allocator.free_page_ids(self._page_ids(pages))
        else:
            self.allocator.free(self.token_slots(pages))

    # ---- pages <-> token slots ---------------------------------------------------------
    def _page_ids(self, handles: Sequence[Handle]) -> torch.Tensor:
        """The pages as an int64 tensor where the pool lives."""
        return self._on_device(_int64_copy(handles))

    def _on_device(self, values: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(values)
        return out if out.device == self.device else out.to(self.device)

    def token_slots(self, handles: Sequence[Handle]) -> torch.Tensor:
        # index arithmetic in numpy: each torch call releases the GIL and waits to take it back from
        # the transfer threads, where a numpy call on a few hundred ints just runs
        if self.page_size == 1:
            return self._page_ids(handles)
        pages = _int64_copy(handles)
        return self._on_device((pages[:, None] * self.page_size + self._offsets_np).reshape(-1))

    def pages_of(self, slots: torch.Tensor) -> array:
        """Page handles of a page-aligned run of token slots (one per page), as an int64 `array`
        (the form the tree keeps: no Python int per page)."""
        if not (slots.dtype is torch.int64 and slots.is_cpu):  # (each torch call waits for the GIL)
            slots = slots.to(device="cpu", dtype=torch.int64)
        values = slots.numpy()
        pages = values if self.page_size == 1 else values[:: self.page_size] // self.page_size
        out = array("q")
        out.frombytes(np.ascontiguousarray(pages).data.cast("B"))  # one copy, into the array
        return out

    # ---- TierStore -------------------------------------------------------------------
    def allocate(self, keys: Sequence[PageKey]) -> array | None:
        n = len(keys)
        if n == 0:
            return array("q")
        self._flush_frees()  # pages freed earlier in this call are free for this allocation
        slots = self.adapter.alloc(self.allocator, n * self.page_size)
        if slots is None:
            return None
        self._owned += n
        return self.pages_of(slots)

    def free(self, handles: Sequence[Handle]) -> None:
        if not handles:
            return
        if self._deferred is not None:
            self._deferred.extend(handles if type(handles) is array else array("q", handles))  # checked at the flush
        else:
            if self._has_repeats(handles):
                raise KeyError("device: free got the same page twice")
            self._give_back(handles)
        self._owned -= len(handles)

    def layer_space(self, layer: int) -> int:
        return self._space[layer]

    def space_pages(self, space: int, pages: torch.Tensor) -> torch.Tensor:
        if space == 0:
            return pages
        # both sub-pools page in step: a full page's first slot maps into its window page
        return self.adapter.window_slots(pages * self.page_size) // self.page_size

    def layer_pages(self, layer: int, kv: int) -> torch.Tensor:
        """Plane `kv` (K=0 / V=1, or MLA's latent=0) of one layer, page by page: `(pages, page tokens,
        heads, dim)`, no copy, indexed in `layer_space(layer)`. (SGLang's buffers carry `page_size`
        padding rows; whole pages only.) Made once per plane: SGLang allocates its KV buffers once at
        start, and making the view on every copy cost more than copying a few small pages."""
        key = layer * self.planes + kv
        view = self._page_views.get(key)
        if view is None:
            buf = self.adapter.plane(layer, kv)
            rows = buf.shape[0] - buf.shape[0] % self.page_size
            view = buf[:rows].view(-1, self.page_size, self.layout.num_kv_heads, self.layout.head_dim)
            self._page_views[key] = view
        return view

    def _space_indices(self, handles: Sequence[Handle]) -> list[torch.Tensor]:
        """Per layer with a view (`adapter.view_layers`), the page index of `handles` in that layer's space (one tensor per space)."""
        pages = self._page_ids(handles)
        by_space = {space: self.space_pages(space, pages) for space in set(self._space)}
        return [by_space[space] for space in self._space]

    # Pages move page by page: one gather or scatter per layer and plane over the page axis, with the
    # canonical `(pages, layers, planes, ...)` tensor's strided slice as its source or target. No
    # index of token slots, and no permuted copy of the whole tensor (a gather into a `(layers, planes,
    # tokens)` buffer and its permute cost 2-4x as much at 16- and 64-token pages: a host hit's load
    # copies on the scheduler's thread on CPU; benchmarks/tree/hicache_peer.py).
    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        n = len(handles)
        out = torch.empty((n, *self.page_shape), dtype=self._dtype, device=self.device)
        if n:
            for layer, idx in enumerate(self._space_indices(handles)):
                for p in range(self.planes):
                    torch.index_select(self.layer_pages(layer, p), 0, idx, out=out[:, layer, p])
            if not self.views_every_layer:
                out[:, self.adapter.view_layers :] = self.adapter.read_tail(self._page_ids(handles))
        return out

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        self._check_data(handles, data)
        if data.dtype != self._dtype:
            raise ValueError(f"device: write of dtype {data.dtype}, pool holds {self._dtype}")
        if not len(handles):
            return
        src = data.to(self.device, non_blocking=True)
        for layer, idx in enumerate(self._space_indices(handles)):
            for p in range(self.planes):
                self.layer_pages(layer, p).index_copy_(0, idx, src[:, layer, p])
        if not self.views_every_layer:
            self.adapter.write_tail(self._page_ids(handles), src[:, self.adapter.view_layers :])


_Method = TypeVar("_Method", bound=Callable[..., Any])


def frees_batched(method: _Method) -> _Method:
    """Decorator for a scheduler call of an object with a `device_pool`: the pool's frees during the
    call go to SGLang's allocator in one call (its evictions free node by node; see
    `SGLangDevicePool.deferred_frees`)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        pool = getattr(self, "device_pool", None)
        if pool is None:
            return method(self, *args, **kwargs)
        with pool.deferred_frees():
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def _int64_copy(handles: Sequence[Handle]) -> np.ndarray:
    """`handles` as a fresh int64 numpy array (a copy: a tensor made from it pins no caller's array
    against resizing)."""
    if type(handles) is array and handles.typecode == "q":
        return np.frombuffer(handles, dtype=np.int64).copy()
    return np.array(handles, dtype=np.int64)
