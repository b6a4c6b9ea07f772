"""The DSA indexer key cache of SGLang's `DSATokenToKVPool` (DeepSeek V3.2, GLM-5) as pages.

Beside the MLA latent (`kv_buffer`, one row per token, which `MLAPoolAdapter` addresses) a DSA pool
keeps, per layer, an indexer key cache (`index_k_with_scale_buffer[layer]`: `[index pages,
page_size * (128 fp8 key bytes + 4 scale bytes)]` uint8, the keys of a page's tokens then their
scales). Its pages are numbered as the allocator's (`index_kpool` 1: page p holds token slots
`p * page_size ...`), so the indexer page of a tree page is the page itself and it can be tiered with
the latent page it belongs to. Serving DSA stays refused (`coverage.REFUSED["dsa"]`: SGLang's DSA
attention runs only on GPU kernels); this adapter is what tiering it needs, proven against the real
pool by tests/with_sglang/test_sglang_dsa_indexer.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ...config import KVLayout
from .pool_adapters import UnsupportedPool


class DSAIndexerAdapter:
    """`DSATokenToKVPool`'s indexer key cache as pages of `layout` (no sglang import).

    Contract: `read(pages)` returns the indexer bytes of allocator pages `pages`, every layer that
    holds index keys, as `(len(pages), *page_shape(layout, page_size))` (bytes carried as 2-byte
    elements: moved, never computed on); `write(pages, data)` puts them back bit for bit into the
    same or other pages of a pool of the same shapes. `page_bytes` is what one page costs in a host
    or disk tier, SGLang's own per-page indexer size summed over the layers. Pools that pack several
    index pages per KV page (`index_kpool` > 1, compressed tails) are refused: their pages do not map
    one to one."""

    kind = "dsa_indexer"

    def __init__(self, pool: Any, architecture: str = "deepseek_v32") -> None:
        kpool = int(getattr(pool, "index_kpool", 1))
        if kpool != 1 or getattr(pool, "index_kpool_compress", False):
            raise UnsupportedPool(f"DSA pool with index_kpool={kpool}: index pages do not map one to one to KV pages")
        self.pool = pool
        self.page_size = int(pool.page_size)
        # 0-row placeholders (layers that share another layer's top-k) hold no keys
        self.buffers: list[torch.Tensor] = [b for b in pool.index_k_with_scale_buffer if b.shape[0]]
        if not self.buffers:
            raise UnsupportedPool("DSA pool without indexer key buffers")
        per_page = {int(b[0].numel() * b.element_size()) for b in self.buffers}
        if len(per_page) != 1 or next(iter(per_page)) % (2 * self.page_size):
            raise UnsupportedPool(f"DSA indexer pages of {sorted(per_page)} bytes for page_size {self.page_size}")
        layer_page_bytes = per_page.pop()
        self.page_bytes = layer_page_bytes * len(self.buffers)
        self.layout = KVLayout(
            num_layers=len(self.buffers),
            num_kv_heads=1,
            head_dim=layer_page_bytes // self.page_size // 2,
            dtype="bfloat16",
            architecture=f"{architecture}:dsa_indexer",
            kv_planes=1,
        )

    def read(self, pages: list[int]) -> torch.Tensor:
        """The indexer bytes of allocator pages `pages` (see the class contract)."""
        idx = torch.as_tensor(pages, dtype=torch.int64)
        rows = [b.index_select(0, idx.to(b.device)).to("cpu") for b in self.buffers]  # [n, page bytes] each
        out = torch.stack(rows, 1).contiguous().view(torch.bfloat16)  # [n, layers, page bytes / 2]
        return out.view(len(pages), self.layout.num_layers, 1, self.page_size, 1, self.layout.head_dim)

    def write(self, pages: list[int], data: torch.Tensor) -> None:
        """Restore allocator pages `pages` from what `read` gave (of a pool of the same shapes)."""
        n = len(pages)
        raw = data.contiguous().view(torch.uint8).view(n, len(self.buffers), -1)
        if raw.shape[2] * len(self.buffers) != self.page_bytes:
            raise ValueError(
                f"DSA indexer: pages of {raw.shape[2] * len(self.buffers)} bytes, this pool's are {self.page_bytes}"
            )
        idx = torch.as_tensor(pages, dtype=torch.int64)
        for i, b in enumerate(self.buffers):
            b.index_copy_(0, idx.to(b.device), raw[:, i].to(b.device))


__all__ = ["DSAIndexerAdapter"]
