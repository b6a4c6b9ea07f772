"""What the shared store tier (`store.py`) asks of a store product, and what the adapters
(`store_backends.py`) implement: `StoreBackend`, and `StoreUnavailable` for a store that failed.

Its own module so that the tier and the adapters both import it and neither imports the other
(the tier picks an adapter lazily, in `open_store`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class StoreUnavailable(OSError):
    """The backend could not be reached or failed the call (not: the key is missing)."""


class StoreBackend(ABC):
    """One small adapter per store product. Keys are strings, values bytes.

    Contract:
    - `exists(keys)` returns one bool per key; `get(key, max_bytes)` returns the value, or None when
      the key is missing, and never returns bytes that did not arrive (a transfer failure raises);
      `put(keys, values)` returns one bool per key (True: stored).
    - Any failure of the store itself raises `StoreUnavailable`; nothing else escapes.
    - Thread-safe: the tier calls it from the scheduler thread and from transfer workers.
    """

    url: str
    #: a call can block on a network (the tier bounds the existence check on the caller's thread)
    may_block: bool = True

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def get(self, key: str, max_bytes: int) -> bytes | None: ...

    @abstractmethod
    def put(self, keys: list[str], values: list[bytes]) -> list[bool]: ...

    def close(self) -> None:  # noqa: B027 - optional
        pass


__all__ = ["StoreBackend", "StoreUnavailable"]
