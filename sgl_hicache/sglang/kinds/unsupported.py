"""The error a device-pool adapter raises for a pool it cannot address (no sglang import)."""

from __future__ import annotations


class UnsupportedPool(ValueError):
    """SGLang's KV pool is of a kind this device tier cannot address (the message says which and what
    to run instead)."""


__all__ = ["UnsupportedPool"]
