"""The DSA indexer key cache of SGLang's `DSATokenToKVPool` (DeepSeek V3.2, GLM-5) as page bytes.

Beside the MLA latent (`kv_buffer`, one row per token) a DSA pool keeps, per layer, an indexer key
cache (`index_k_with_scale_buffer[layer]`: `[index pages, page_size * (128 fp8 key bytes + 4 scale
bytes)]` uint8, the keys of a page's tokens then their scales). Its pages are numbered as the
allocator's (`index_kpool` 1: page p holds token slots `p * page_size ...`), so the indexer page of a
tree page is the page itself. `pool_adapters.DSAPoolAdapter` carries these bytes as the tail layers
of the latent's page (one key, one page), through this reader.
"""

from __future__ import annotations

from typing import Any

import torch

from .unsupported import UnsupportedPool


class DSAIndexerAdapter:
    """`DSATokenToKVPool`'s indexer key cache as bytes per allocator page (no sglang import).

    Contract: `read_bytes(pages)` returns, for each allocator page in `pages` (an int64 tensor), the
    indexer bytes of every layer that holds index keys, layer after layer, as a uint8 tensor
    `(len(pages), page_bytes)` on the pool's device; `write_bytes(pages, data)` puts such bytes back
    bit for bit into the same or other pages of a pool of the same shapes. `page_bytes` is SGLang's
    own per-page indexer size summed over those layers (`layer_page_bytes` each). Pools that pack
    several index pages into one KV page (`index_kpool` > 1) or keep compressed tails per request
    (`index_kpool_compress`) are refused (`UnsupportedPool`): their index pages do not map one to
    one onto the tree's pages."""

    kind = "dsa_indexer"

    def __init__(self, pool: Any) -> None:
        kpool = int(getattr(pool, "index_kpool", 1))
        compress = bool(getattr(pool, "index_kpool_compress", False))
        if kpool != 1 or compress:
            raise UnsupportedPool(
                f"DSA pool with a packed index layout (index_kpool={kpool}, index_kpool_compress={compress}): "
                "its index pages do not map one to one onto the KV pages the tree tiers; supported: "
                "index_kpool=1 without compression (SGLang's default)"
            )
        self.pool = pool
        self.page_size = int(pool.page_size)
        # 0-row placeholders (layers that share another layer's top-k) hold no keys
        self.buffers: list[torch.Tensor] = [b for b in pool.index_k_with_scale_buffer if b.shape[0]]
        if not self.buffers:
            raise UnsupportedPool("DSA pool without indexer key buffers")
        per_page = {int(b[0].numel() * b.element_size()) for b in self.buffers}
        if len(per_page) != 1 or any(b.dtype != torch.uint8 or b.dim() != 2 for b in self.buffers):
            raise UnsupportedPool(f"DSA indexer buffers of page sizes {sorted(per_page)}; expected one uint8 layout")
        self.layer_page_bytes = per_page.pop()
        self.page_bytes = self.layer_page_bytes * len(self.buffers)

    def read_bytes(self, pages: torch.Tensor) -> torch.Tensor:
        """The indexer bytes of allocator pages `pages` (see the class contract)."""
        return torch.cat([b.index_select(0, pages.to(b.device)) for b in self.buffers], dim=1)

    def write_bytes(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Restore allocator pages `pages` from what `read_bytes` gave (of a pool of the same shapes)."""
        if tuple(data.shape) != (len(pages), self.page_bytes) or data.dtype != torch.uint8:
            raise ValueError(
                f"DSA indexer: data {tuple(data.shape)} {data.dtype}, expected ({len(pages)}, {self.page_bytes}) uint8"
            )
        n = self.layer_page_bytes
        for i, b in enumerate(self.buffers):
            b.index_copy_(0, pages.to(b.device), data[:, i * n : (i + 1) * n].to(b.device))


__all__ = ["DSAIndexerAdapter"]
