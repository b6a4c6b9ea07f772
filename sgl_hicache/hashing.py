"""Chained page keys: key(page) = xxh3_128(parent key || page tokens), rooted in a namespace.

A namespace fingerprints everything that changes the bytes of a page (model architecture, layer
count, KV heads, head dim, dtype, K/V planes, page size) plus an optional tenant salt. Because the root of every
chain is the namespace, two namespaces never share a key, and an equal key means an equal token
prefix under an equal model: equal KV.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from .config import KVLayout

KEY_BYTES = 16
PageKey = bytes  # KEY_BYTES long


@dataclass(frozen=True)
class Namespace:
    """The root of every key chain of one (model, page size, tenant)."""

    root: PageKey
    description: str

    @classmethod
    def for_model(cls, layout: KVLayout, page_size: int, tenant_salt: str = "") -> Namespace:
        description = (
            f"arch={layout.architecture};layers={layout.num_layers};kv_heads={layout.num_kv_heads};"
            f"head_dim={layout.head_dim};dtype={layout.dtype};page={page_size};tenant={tenant_salt}"
        )
        if layout.kv_planes != 2:  # (K/V layouts keep the description, and so the keys, they always had)
            description += f";planes={layout.kv_planes}"
        return cls(root=xxhash.xxh3_128_digest(description.encode()), description=description)


def int64_tokens(tokens: Sequence[int]) -> array:
    """`tokens` as an int64 array: a copy (8 bytes a token, compared as bytes at memcmp speed)."""
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens[:]
    return array("q", tokens)


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """Canonical byte form of token ids (int64 little-endian, so ids above 2**31 hash distinctly)."""
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens.tobytes()
    return array("q", tokens).tobytes()


def page_key(parent: PageKey, page_tokens: Sequence[int]) -> PageKey:
    """Key of one page given its parent page's key (or the namespace root for the first page)."""
    h = xxhash.xxh3_128(parent)
    h.update(tokens_bytes(page_tokens))
    return h.digest()


def chain_keys(parent: PageKey, tokens: Sequence[int], page_size: int) -> list[PageKey]:
    """Keys of every full page of `tokens`, chained from `parent`. A trailing partial page has no key."""
    keys: list[PageKey] = []
    data = tokens_bytes(tokens)  # converted once, hashed page by page (what `page_key` hashes)
    step = page_size * 8
    for start in range(0, len(data) - step + 1, step):
        h = xxhash.xxh3_128(parent)
        h.update(data[start : start + step])
        parent = h.digest()
        keys.append(parent)
    return keys
