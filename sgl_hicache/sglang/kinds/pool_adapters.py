"""Device-pool adapters: one per SGLang KV pool kind, all behind one protocol, `PoolAdapter`.

An adapter says what a page of the pool holds (`layout`: the `KVLayout`, whose `kv_planes` is 2 for
K and V, 1 for MLA's latent + rope row) and hands out, per layer and plane, the pool's own buffer as
`[rows, heads, dim]` in the layout's dtype, with no copy. `SGLangDevicePool` moves pages through
that alone, so the host and disk tiers work unchanged for every kind; `replicated_across_tp` says
every TP rank holds the same bytes (MLA).

`adapter_for(kvcache)` picks the adapter. A pool of SGLang's own classes must be one an adapter
names in `pool_classes` (a subclass may change the layout); every other SGLang pool is refused
with `coverage.refusal(...)`, naming the kind and what to run instead. This module (no sglang
import: it reads the pool's attributes) is the only place that tells pool kinds apart.

Supported:
- `MHATokenToKVPool`, NHD layout: `k_buffer[layer]` / `v_buffer[layer]` of `[slots, kv_heads,
  head_dim]`, K and V of one head dim; dtypes bf16 / fp16 / fp32 / fp8 e4m3 / fp8 e5m2 (SGLang
  stores fp8 as uint8; pages move as the fp8 dtype, bytes unchanged). An fp8 pool has no scale
  buffer: its scale is the model's (per layer, `layer.k_scale`), part of the model, not of a page.
- `MLATokenToKVPool`: `kv_buffer[layer]` of `[slots, 1, kv_lora_rank + qk_rope_head_dim]`.
- `SWAKVPool` (hybrid sliding window): every layer's pages, the window layers' rows through SGLang's
  full -> window slot mapping (`SWAPoolAdapter`).
- `HybridLinearKVPool` (hybrid Mamba / linear attention): the attention layers' pages, and beside
  them a `MambaPool`: not pages of tokens but one recurrent state per slot; `MambaStateAdapter` reads and writes a slot's state as one snapshot (every layer's conv and
  temporal state), which the snapshot tiers store (`mamba_snapshots.py`); served with
  `--mamba-radix-cache-strategy no_buffer` or `extra_buffer` (`mamba_calls.py`, `state_sources.py`), the
  other strategies refused (coverage "mamba").
- Speculative decoding (EAGLE, EAGLE3, NextN MTP): `DraftPoolsAdapter` puts the draft model's pools
  (their rows at the target's token slots) beside the target's, as further layers of one page.
- `DSATokenToKVPool` (DSA: DeepSeek V3.2, GLM-5): the MLA latent rows, and the indexer key pages as the
  page's tail layers (`DSAPoolAdapter`); built, not served (the factory refuses DSA, coverage "dsa").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ...config import _DTYPES, KVLayout
from ..coverage import refusal
from .dsa_indexer import DSAIndexerAdapter
from .unsupported import UnsupportedPool

_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class PoolAdapter(ABC):
    """One SGLang KV pool kind seen as pages.

    Contract: `layout` describes one token of the pool (every plane of every layer);
    `plane(layer, p)` for `p in range(layout.kv_planes)` is the pool's own buffer of that layer and
    plane, `[rows, layout.num_kv_heads, layout.head_dim]` in `layout.torch_dtype`, a view (writes
    through it land where SGLang's attention reads); `device` is where the buffers live;
    `replicated_across_tp` is True when every TP rank holds the same bytes for a token.

    Page layers `0..view_layers-1` are such buffers; an adapter whose page carries more than the
    pool's per-token rows (DSA's indexer pages) has tail layers `view_layers..layout.num_layers-1`,
    which are no buffer of the pool: `read_tail(pages)` returns them for allocator pages `pages` (an
    int64 tensor) as `(n, tail layers, planes, page_size, heads, head_dim)` on `device`, and
    `write_tail(pages, data)` puts such data back bit for bit.
    """

    kind: str = ""
    #: the SGLang pool classes (exact names) this adapter serves
    pool_classes: tuple[str, ...] = ()
    replicated_across_tp: bool = False

    def __init__(self, kvcache: Any, architecture: str) -> None:
        self.kvcache = kvcache
        self.layout = self._layout(architecture)

    @staticmethod
    @abstractmethod
    def matches(kvcache: Any) -> bool:
        """Whether the pool has this kind's buffers (for pools not of SGLang's own classes)."""

    @abstractmethod
    def _layout(self, architecture: str) -> KVLayout: ...

    @abstractmethod
    def _buffer(self, layer: int, p: int) -> torch.Tensor: ...

    @property
    def view_layers(self) -> int:
        """How many of the page's layers are buffers of the pool (`plane`); the rest are the tail."""
        return self.layout.num_layers

    def read_tail(self, pages: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no tail layers")

    def write_tail(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no tail layers")

    def plane(self, layer: int, p: int) -> torch.Tensor:
        buf = self._buffer(layer, p)
        dtype = self.layout.torch_dtype
        return buf if buf.dtype == dtype else buf.view(dtype)

    @property
    def device(self) -> torch.device:
        return self._buffer(0, 0).device

    def is_window(self, layer: int) -> bool:
        """Whether `layer`'s rows of token slots `s` are `window_slots(s)` rather than `s` (hybrid
        sliding-window pools only)."""
        return False

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no window layers")

    def check_allocator(self, allocator: Any) -> None:
        """Raise `UnsupportedPool` if SGLang's `allocator` cannot serve this pool through `alloc`
        (every allocator can, unless an adapter says otherwise)."""
        return

    @staticmethod
    def alloc(allocator: Any, tokens: int) -> torch.Tensor | None:
        """`tokens` page-aligned token slots from SGLang's `allocator` (None: not enough free)."""
        return allocator.alloc(tokens)

    def _dtype_name(self, buf: torch.Tensor) -> str:
        kind = type(self.kvcache).__name__
        dtype = getattr(self.kvcache, "dtype", buf.dtype)
        if dtype not in _DTYPE_NAMES:
            raise UnsupportedPool(f"KV pool {kind} has dtype {dtype}; supported: {sorted(_DTYPES)}")
        if torch.empty((), dtype=buf.dtype).element_size() != torch.empty((), dtype=dtype).element_size():
            raise UnsupportedPool(f"KV pool {kind} stores {dtype} as {buf.dtype} of another width; not supported")
        return _DTYPE_NAMES[dtype]


class MHAPoolAdapter(PoolAdapter):
    """SGLang's `MHATokenToKVPool` (NHD): a K and a V buffer per layer (see the module docstring)."""

    kind = "mha"
    pool_classes = ("MHATokenToKVPool",)

    @staticmethod
    def matches(kvcache: Any) -> bool:
        return hasattr(kvcache, "k_buffer") and hasattr(kvcache, "v_buffer")

    def _layout(self, architecture: str) -> KVLayout:
        kv = self.kvcache
        kind = type(kv).__name__
        k_buf, v_buf = kv.k_buffer, kv.v_buffer
        if not isinstance(k_buf, (list, tuple)) or not isinstance(v_buf, (list, tuple)) or not k_buf:
            raise UnsupportedPool(f"KV pool {kind} has no per-layer k_buffer/v_buffer lists")
        layout_name = getattr(kv, "kv_cache_layout", "nhd")
        if layout_name not in ("nhd", None):
            raise UnsupportedPool(refusal("kv_layout", f"{kind} with kv_cache_layout={layout_name!r}"))
        if getattr(kv, "is_quantized_kv_cache", False) or getattr(kv, "k_scale_buffer", None) is not None:
            method = type(getattr(kv, "quant_method", None)).__name__
            raise UnsupportedPool(refusal("scaled_quant_kv", f"{kind} with {method}"))
        k0, v0 = k_buf[0], v_buf[0]
        if k0.dim() != 3 or tuple(k0.shape) != tuple(v0.shape):
            raise UnsupportedPool(
                f"KV pool {kind}: k_buffer[0] {tuple(k0.shape)} / v_buffer[0] {tuple(v0.shape)}; "
                "expected equal [slots, kv_heads, head_dim]"
            )
        return KVLayout(
            num_layers=len(k_buf),
            num_kv_heads=int(k0.shape[1]),
            head_dim=int(k0.shape[2]),
            dtype=self._dtype_name(k0),
            architecture=architecture,
        )

    def _buffer(self, layer: int, p: int) -> torch.Tensor:
        return (self.kvcache.k_buffer if p == 0 else self.kvcache.v_buffer)[layer]


class MLAPoolAdapter(PoolAdapter):
    """SGLang's `MLATokenToKVPool`: one latent + rope row per token and layer (`kv_planes=1`), the same
    on every TP rank (see the module docstring)."""

    kind = "mla"
    pool_classes = ("MLATokenToKVPool",)
    replicated_across_tp = True

    @staticmethod
    def matches(kvcache: Any) -> bool:
        return hasattr(kvcache, "kv_buffer") and hasattr(kvcache, "kv_lora_rank")

    def _layout(self, architecture: str) -> KVLayout:
        if getattr(self.kvcache, "use_dsa", False):
            raise UnsupportedPool(refusal("dsa", type(self.kvcache).__name__))
        return self._latent_layout(architecture)

    def _latent_layout(self, architecture: str) -> KVLayout:
        kv = self.kvcache
        kind = type(kv).__name__
        bufs = kv.kv_buffer
        if getattr(kv, "kv_scale_buffer", None) is not None:
            raise UnsupportedPool(refusal("scaled_quant_kv", f"{kind} has scale buffers"))
        if not isinstance(bufs, (list, tuple)) or not bufs:
            raise UnsupportedPool(f"KV pool {kind} has no per-layer kv_buffer list")
        b0 = bufs[0]
        width = int(kv.kv_lora_rank) + int(kv.qk_rope_head_dim)
        if b0.dim() != 3 or int(b0.shape[1]) != 1 or int(b0.shape[2]) != width:
            raise UnsupportedPool(
                f"KV pool {kind}: kv_buffer[0] {tuple(b0.shape)}; expected [slots, 1, "
                f"kv_lora_rank + qk_rope_head_dim = {width}]"
            )
        return KVLayout(
            num_layers=len(bufs),
            num_kv_heads=1,
            head_dim=width,
            dtype=self._dtype_name(b0),
            architecture=architecture,
            kv_planes=1,
        )

    def _buffer(self, layer: int, p: int) -> torch.Tensor:
        if p != 0:
            raise IndexError(f"MLA pool has one plane, asked for plane {p}")
        return self.kvcache.kv_buffer[layer]


class DSAPoolAdapter(MLAPoolAdapter):
    """SGLang's `DSATokenToKVPool` (DeepSeek V3.2, GLM-5): the MLA latent rows and, in the same page,
    the indexer key pages of the same allocator page (`DSAIndexerAdapter`), so one key, one host slot
    and one page file carry both.

    Contract: layers `0..L-1` of a page are the latent's, as `MLAPoolAdapter`'s (`view_layers` = L);
    the tail layers after them hold the page's indexer bytes (every indexer layer's page, layer after
    layer, zero-padded to whole layers), carried in the latent's dtype and shape, never computed on:
    `tail_layers = ceil(indexer page bytes / latent bytes per layer and page)` (DeepSeek V3.2 at
    page 64: 61 latent layers + 7 tail layers, 8,052 of the tail's 8,064 bytes per token used). The
    architecture is salted with the indexer's shape (`:dsa_indexer=<layers>x<bytes>`), so an MLA page
    of the same model never reads as a DSA page. Packed index layouts are refused (`UnsupportedPool`).
    """

    kind = "dsa"
    pool_classes = ("DSATokenToKVPool",)

    @staticmethod
    def matches(kvcache: Any) -> bool:
        return MLAPoolAdapter.matches(kvcache) and hasattr(kvcache, "index_k_with_scale_buffer")

    def _layout(self, architecture: str) -> KVLayout:
        latent = self._latent_layout(architecture)
        self.indexer = DSAIndexerAdapter(self.kvcache)
        self.page_size = int(self.kvcache.page_size)
        layer_bytes = self.page_size * latent.bytes_per_token // latent.num_layers
        self.tail_layers = -(-self.indexer.page_bytes // layer_bytes)
        self._latent_layers = latent.num_layers
        self._tail_bytes = self.tail_layers * layer_bytes
        return KVLayout(
            num_layers=latent.num_layers + self.tail_layers,
            num_kv_heads=1,
            head_dim=latent.head_dim,
            dtype=latent.dtype,
            architecture=f"{architecture}:dsa_indexer={len(self.indexer.buffers)}x{self.indexer.layer_page_bytes}",
            kv_planes=1,
        )

    @property
    def view_layers(self) -> int:
        return self._latent_layers

    def read_tail(self, pages: torch.Tensor) -> torch.Tensor:
        raw = self.indexer.read_bytes(pages)
        out = torch.zeros((len(pages), self._tail_bytes), dtype=torch.uint8, device=raw.device)
        out[:, : raw.shape[1]] = raw
        t = self.layout
        return out.view(t.torch_dtype).view(len(pages), self.tail_layers, 1, self.page_size, 1, t.head_dim)

    def write_tail(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        raw = data.contiguous().view(len(pages), -1).view(torch.uint8)
        if raw.shape[1] != self._tail_bytes:
            raise ValueError(f"DSA tail of {raw.shape[1]} bytes a page, this pool's is {self._tail_bytes}")
        self.indexer.write_bytes(pages, raw[:, : self.indexer.page_bytes])


class _SubPoolAdapter(PoolAdapter):
    """A hybrid pool whose tiered pages are those of its `full_kv_pool` (an MHA or MLA sub-pool, with
    that sub-pool's adapter as `full`); subclasses add what sits beside it (`_beside`)."""

    def _layout(self, architecture: str) -> KVLayout:
        self.full = adapter_for(self.kvcache.full_kv_pool, architecture)
        self.replicated_across_tp = self.full.replicated_across_tp
        self._beside(architecture)
        return self.full.layout

    @abstractmethod
    def _beside(self, architecture: str) -> None: ...

    def _buffer(self, layer: int, p: int) -> torch.Tensor:
        return self.full._buffer(layer, p)


class SWAPoolAdapter(PoolAdapter):
    """SGLang's `SWAKVPool` (hybrid sliding-window models: gpt-oss, Granite SWA, Llama 4): two MHA
    sub-pools, the full-attention layers' (`full`, indexed by the allocator's token slots) and the
    window layers' (`window`, indexed through SGLang's full -> window slot mapping).

    Contract: a page holds every layer of the model, in the model's layer order (`layout.num_layers`
    is the full and the window layers together), so a tiered page is complete: a hit restores the
    window layers' KV of every token it covers, and the window before any hit point is there. This
    holds on the device too because the backend does not report `supports_swa()`: SGLang then never
    frees a running request's window slots (`ScheduleBatch.maybe_evict_swa`), so every token the tree
    adopts has its window row, freed with it (`SWATokenToKVPoolAllocator.free`). `is_window(layer)`
    says which layers are windowed; their rows of token slots `s` are `window_slots(s)`.
    `alloc(allocator, n)` allocates `n` page-aligned tokens in both sub-pools and records their
    mapping (SGLang's own `alloc` takes single tokens only). Both sub-pools must be MHA of one head
    count, head dim and dtype (otherwise `UnsupportedPool`)."""

    kind = "swa"
    pool_classes = ("SWAKVPool",)

    @staticmethod
    def matches(kvcache: Any) -> bool:
        return hasattr(kvcache, "full_kv_pool") and hasattr(kvcache, "swa_kv_pool")

    def _layout(self, architecture: str) -> KVLayout:
        kv = self.kvcache
        kind = type(kv).__name__
        self.full = adapter_for(kv.full_kv_pool, architecture)
        self.window = adapter_for(kv.swa_kv_pool, f"{architecture}:window")
        a, b = self.full.layout, self.window.layout
        if (self.full.kind, self.window.kind) != ("mha", "mha") or (a.num_kv_heads, a.head_dim, a.dtype) != (
            b.num_kv_heads,
            b.head_dim,
            b.dtype,
        ):
            raise UnsupportedPool(
                f"KV pool {kind}: full sub-pool {self.full.kind} {a.num_kv_heads}x{a.head_dim} "
                f"{a.dtype}, window sub-pool {self.window.kind} {b.num_kv_heads}x{b.head_dim} "
                f"{b.dtype}; supported: both MHA of one head count, head dim and dtype"
            )
        if getattr(kv, "swa_req_ring_size", None) is not None:
            raise UnsupportedPool(refusal("swa", f"{kind} with a per-request window ring"))
        mapping = dict(kv.layers_mapping)  # model layer -> (sub-pool layer, is a window layer)
        if sorted(mapping) != list(range(len(mapping))):
            raise UnsupportedPool(
                f"KV pool {kind} holds model layers {sorted(mapping)}; expected 0..{len(mapping) - 1}"
            )
        self._where = [mapping[layer] for layer in range(len(mapping))]
        windowed = ",".join(str(i) for i, (_, w) in enumerate(self._where) if w)
        return KVLayout(
            num_layers=len(mapping),
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            dtype=a.dtype,
            architecture=f"{architecture}:window_layers={windowed}",
        )

    def is_window(self, layer: int) -> bool:
        """Whether model layer `layer` is a window layer (its rows live in the window sub-pool)."""
        return self._where[layer][1]

    def _buffer(self, layer: int, p: int) -> torch.Tensor:
        index, windowed = self._where[layer]
        return (self.window if windowed else self.full)._buffer(index, p)

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The window sub-pool's rows of the full pool's token `slots` (0 where SGLang freed them)."""
        return self.kvcache.translate_loc_from_full_to_swa(slots)

    def check_allocator(self, allocator: Any) -> None:
        if not all(
            hasattr(allocator, a) for a in ("full_attn_allocator", "swa_attn_allocator", "set_full_to_swa_mapping")
        ):
            raise UnsupportedPool(refusal("swa", f"{type(self.kvcache).__name__} with {type(allocator).__name__}"))

    @staticmethod
    def alloc(allocator: Any, tokens: int) -> torch.Tensor | None:
        full = allocator.full_attn_allocator.alloc(tokens)
        if full is None:
            return None
        window = allocator.swa_attn_allocator.alloc(tokens)
        if window is None:
            allocator.full_attn_allocator.free(full)
            return None
        allocator.set_full_to_swa_mapping(full, window)
        return full


class HybridLinearPoolAdapter(_SubPoolAdapter):
    """SGLang's `HybridLinearKVPool` (hybrid Mamba / linear-attention models: Qwen3-Next, Nemotron-H):
    the attention layers' pool (`full_kv_pool`, MHA or MLA; this adapter's pages) beside a `MambaPool`
    of recurrent states, one per request slot, which `state` (`MambaStateAdapter`) reads and writes
    as snapshots (tiered by `mamba_snapshots.SnapshotTiers`; hybrid variants whose state is not one slot per
    request are refused, `coverage.REFUSED["mamba"]`)."""

    kind = "mamba"
    pool_classes = ("HybridLinearKVPool",)

    @staticmethod
    def matches(kvcache: Any) -> bool:
        return hasattr(kvcache, "full_kv_pool") and hasattr(kvcache, "mamba_pool")

    def _beside(self, architecture: str) -> None:
        self.state = MambaStateAdapter(self.kvcache.mamba_pool, architecture)


class DraftPoolsAdapter(PoolAdapter):
    """The target's pool with the speculative draft model's KV pools beside it (EAGLE / EAGLE3 / NextN
    MTP: the draft runners write their rows at the target's token slots). One page holds every layer of
    both: layers `0..T-1` are the target's (`target`), then each draft pool's in turn (`drafts`,
    `draft_offsets[i]` its first layer), so the host and disk tiers carry the draft's KV with the
    target's. Every draft pool must have the target's page layout (planes, heads, head dim, dtype);
    otherwise `UnsupportedPool` (coverage "eagle_draft_layout")."""

    kind = "draft"

    def __init__(self, target: PoolAdapter, drafts: list[PoolAdapter]) -> None:
        self.target, self.drafts = target, list(drafts)
        self.kvcache = target.kvcache
        t = target.layout
        for a in (target, *self.drafts):
            if a.view_layers != a.layout.num_layers:
                raise UnsupportedPool(f"speculative decoding over a {a.kind} pool (page tail layers): not built")
        for d in self.drafts:
            dl = d.layout
            if (dl.kv_planes, dl.num_kv_heads, dl.head_dim, dl.dtype) != (
                t.kv_planes,
                t.num_kv_heads,
                t.head_dim,
                t.dtype,
            ):
                raise UnsupportedPool(
                    refusal(
                        "eagle_draft_layout",
                        (
                            f"draft {type(d.kvcache).__name__} {dl.kv_planes} planes x {dl.num_kv_heads} heads x {dl.head_dim} "
                            f"{dl.dtype}, target {t.kv_planes} x {t.num_kv_heads} x {t.head_dim} {t.dtype}"
                        ),
                    )
                )
        self._layers: list[tuple[PoolAdapter, int]] = [(target, i) for i in range(t.num_layers)]
        self.draft_offsets: list[int] = []
        for d in self.drafts:
            self.draft_offsets.append(len(self._layers))
            self._layers.extend((d, i) for i in range(d.layout.num_layers))
        self.replicated_across_tp = target.replicated_across_tp and all(d.replicated_across_tp for d in self.drafts)
        self.layout = self._layout(t.architecture)

    @staticmethod
    def matches(kvcache: Any) -> bool:
        return False  # built by the factory from the recorded draft pools, never picked by buffers

    def _layout(self, architecture: str) -> KVLayout:
        t = self.target.layout
        return KVLayout(
            num_layers=len(self._layers),
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            dtype=t.dtype,
            architecture=f"{architecture}+draft{len(self._layers) - t.num_layers}",
            kv_planes=t.kv_planes,
        )

    def _buffer(self, layer: int, p: int) -> torch.Tensor:
        adapter, i = self._layers[layer]
        return adapter._buffer(i, p)

    def plane(self, layer: int, p: int) -> torch.Tensor:
        adapter, i = self._layers[layer]
        return adapter.plane(i, p)


ADAPTERS: tuple[type[PoolAdapter], ...] = (
    MHAPoolAdapter,
    DSAPoolAdapter,  # before MLA: a DSA pool has MLA's buffers too
    MLAPoolAdapter,
    SWAPoolAdapter,
    HybridLinearPoolAdapter,
)

# SGLang pool classes refused, by (a base of) their class name: the `coverage.REFUSED` kind
_REFUSED_POOLS = {
    "MHATokenToKVPoolFP4": "scaled_quant_kv",
    "MHATokenToKVPoolMXFP8": "scaled_quant_kv",
    "MLATokenToKVPoolFP4": "scaled_quant_kv",
    "PageMajorMHATokenToKVPool": "kv_layout",
    # (SWAKVPool and HybridLinearKVPool themselves have adapters; subclasses of other layouts are refused)
    "BaseSWAKVPool": "swa",
    "HybridLinearKVPool": "mamba",
}


def _is_sglang_pool(kvcache: Any) -> bool:
    return type(kvcache).__module__.split(".")[0] == "sglang"


def adapter_for(kvcache: Any, architecture: str = "llama") -> PoolAdapter:
    """The adapter of SGLang's KV pool `kvcache`, or UnsupportedPool naming the kind and what to run
    instead (see the module docstring)."""
    kind = type(kvcache).__name__
    if _is_sglang_pool(kvcache):
        for cls in ADAPTERS:
            if kind in cls.pool_classes:
                return cls(kvcache, architecture)
        for base in type(kvcache).__mro__:
            if base.__name__ in _REFUSED_POOLS:
                raise UnsupportedPool(refusal(_REFUSED_POOLS[base.__name__], kind))
        served = ", ".join(c for a in ADAPTERS for c in a.pool_classes)
        raise UnsupportedPool(
            f"KV pool {kind} is not supported (served: {served}; docs/sglang-backend.md, Model coverage)"
        )
    for cls in ADAPTERS:  # a pool of another origin (a wrapper, a test's stand-in): by its buffers
        if cls.matches(kvcache):
            return cls(kvcache, architecture)
    raise UnsupportedPool(f"KV pool {kind} has neither k_buffer/v_buffer (MHA) nor kv_buffer/kv_lora_rank (MLA)")


__all__ = [
    "ADAPTERS",
    "DSAPoolAdapter",
    "DraftPoolsAdapter",
    "HybridLinearPoolAdapter",
    "MHAPoolAdapter",
    "MLAPoolAdapter",
    "MambaStateAdapter",
    "PoolAdapter",
    "SWAPoolAdapter",
    "UnsupportedPool",
    "adapter_for",
]


class MambaStateAdapter:
    """SGLang's `MambaPool` (the recurrent state of a hybrid Mamba / linear-attention model) as state
    snapshots: `read(slots)` gives each slot's state, every layer's conv and temporal tensors, as
    one flat run of bytes shaped as a one-token page of `layout` (carried as 2-byte elements: moved,
    never computed on); `write(slots, pages)` puts them back bit for bit. SGLang's transfer fields
    only (its `_NON_TRANSFER_STATE_FIELDS`, speculative and ReplaySSM scratch, are not state).

    Contract: `snapshot_bytes` is what one snapshot costs in a host or disk tier (the bytes of the
    state, rounded up to an even count); `tokens_of_kv(kv_layout)` is the same cost in tokens of a
    KV layout, the honest charge of one snapshot against a host budget counted in tokens. A pool
    with slot-indexed side states (`register_slot_state`) is refused: their bytes are not covered."""

    kind = "mamba_state"

    def __init__(self, pool: Any, architecture: str = "mamba") -> None:
        if getattr(pool, "_slot_siblings", ()):
            raise UnsupportedPool(f"MambaPool with slot-indexed side states {pool._slot_siblings!r}: not covered")
        cache = pool.mamba_cache
        skip: frozenset[str] = getattr(pool, "_NON_TRANSFER_STATE_FIELDS", frozenset())
        self.pool = pool
        self.tensors: list[torch.Tensor] = []
        for name, value in vars(cache).items():
            if name in skip or value is None:
                continue
            for t in value if isinstance(value, list) else [value]:
                if t.numel():
                    self.tensors.append(t)  # [layers, slots + 1, ...]
        self.state_bytes = sum(t[:, 0].numel() * t.element_size() for t in self.tensors)
        self.snapshot_bytes = self.state_bytes + self.state_bytes % 2
        self.layout = KVLayout(
            num_layers=1,
            num_kv_heads=1,
            head_dim=self.snapshot_bytes // 2,
            dtype="bfloat16",
            architecture=f"{architecture}:mamba_state",
            kv_planes=1,
        )

    def tokens_of_kv(self, kv_layout: KVLayout) -> int:
        """How many tokens of `kv_layout` one snapshot costs (rounded up)."""
        return -(-self.snapshot_bytes // kv_layout.bytes_per_token)

    def read(self, slots: list[int]) -> torch.Tensor:
        """The snapshots of `slots`: `(len(slots), 1, 1, 1, 1, snapshot_bytes // 2)` (a page per slot)."""
        n = len(slots)
        idx = torch.as_tensor(slots, dtype=torch.int64)
        out = torch.zeros((n, self.snapshot_bytes), dtype=torch.uint8)
        off = 0
        for t in self.tensors:
            rows = t.index_select(1, idx.to(t.device)).movedim(1, 0).contiguous().to("cpu")
            b = rows.view(n, -1).view(torch.uint8)
            out[:, off : off + b.shape[1]] = b
            off += b.shape[1]
        return out.view(torch.bfloat16).view(n, 1, 1, 1, 1, -1)

    def write(self, slots: list[int], pages: torch.Tensor) -> None:
        """Restore `slots` from snapshots `read` made (of a pool of the same shapes)."""
        n = len(slots)
        raw = pages.contiguous().view(n, -1).view(torch.uint8)
        if raw.shape[1] != self.snapshot_bytes:
            raise ValueError(f"mamba state: snapshots of {raw.shape[1]} bytes, this pool's are {self.snapshot_bytes}")
        idx = torch.as_tensor(slots, dtype=torch.int64)
        off = 0
        for t in self.tensors:
            per = t[:, 0].numel() * t.element_size()
            part = raw[:, off : off + per].contiguous().view(t.dtype).view(n, t.shape[0], *t.shape[2:])
            t.index_copy_(1, idx.to(t.device), part.movedim(0, 1).to(t.device))
            off += per
