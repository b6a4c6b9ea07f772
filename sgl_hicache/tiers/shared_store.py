"""The shared store tier: KV pages in a store that many servers of one model share (Mooncake Store,
Redis/Valkey), behind the same tier protocol as the disk tier, in the same place of the tree.

Where it sits: in the lower-tier slot below host, *beside* disk (a cache has one or the other).
Both are content-addressed page stores whose keys are the chained page keys, so the cache's
machinery for disk (adopting pages it did not write at match time, disk -> host prefetch with
wait-or-recompute, background host -> disk write-back, dropping a subtree whose page is gone) is
the store's too, unchanged; a store below disk would need a fourth tree tier and a second copy of
that machinery.

Keys: `sglh/<namespace root hex>/<page key hex>`, or `sglh/<namespace root hex>/heads<lo>-<hi>/<page
key hex>` for a cache holding a shard of the KV heads (a TP rank of an MHA model): each shard's bytes
under keys of their own. The page key is chained from the namespace (model fingerprint + tenant
salt), so servers of one model share pages and other models never collide; servers of different TP
sizes share nothing through a store (the disk tier reads across them: `disk/head_shards.py`).
Values: the disk page codec (`tiers/codec.py`), header + payload; a missing, truncated, foreign or
corrupt value is a counted miss (`PageCorruptError`), never served.

Local view: the store is shared and unbounded from here; `capacity_pages` bounds how many of its
pages this process's tree tracks. `free` forgets a page locally and never deletes it from the store
(other servers may use it; the store evicts by its own policy). `contains` answers from the local
view, with no I/O; `count_present(keys)` asks the store, in one batched existence check, how many
leading keys it holds, and adds them to the local view.

Failures: any backend error (store down, master or holder killed, network) marks the store
unavailable: one log line, `errors` += 1, and for `backoff` seconds (doubling up to
`max_backoff_s`) every call answers at once from the local side (no pages present, writes skipped
and counted in `puts_skipped`, reads fail as a miss); then one call probes again and, on success,
the tier is back (one log line). A failed put is counted (`puts_failed`) and not retried. The
existence check on the caller's thread is bounded by `exists_timeout_s` (run on one lazily started
helper thread), so a hung store never stalls the scheduler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from ..config import CacheConfig, HeadShard, KVLayout
from ..hashing import KEY_BYTES, Namespace, PageKey
from .base import Handle, KeyedStore, PageCorruptError, ReadsInto, TierIOError
from .codec import DTYPE_MISMATCH, PageCodec, check_key, is_other_version, tensor_bytes
from .store_protocol import StoreBackend, StoreUnavailable

log = logging.getLogger(__name__)

STORE = "store"

COUNTER_NAMES = (
    "exists_calls",
    "exists_keys",
    "exists_found",
    "pages_read",
    "bytes_read",
    "pages_written",
    "bytes_written",
    "read_misses",  # the store no longer held a page it had said it held
    "corrupt_values",  # a value failed the codec (truncated, bad checksum, other layout)
    "foreign_values",  # a value of another namespace under one of our keys
    "dtype_mismatch",  # of corrupt_values: a value whose header named another KV dtype (never served)
    "version_skipped",  # a value of another format version (another build wrote it): never served
    "puts_failed",
    "puts_skipped",  # not attempted: the store was unavailable
    "errors",  # transitions to unavailable
    "recoveries",
)


class SharedStoreTier(KeyedStore, ReadsInto):
    """Pages in a shared store, keyed by page key (module docstring). Handles are the page keys."""

    name = STORE
    #: other processes write pages into it: the cache asks it at match time for pages it did not write
    shared = True
    #: evicting a host page does not write it here synchronously (puts are paced write-back only)
    demote_on_evict = False

    def __init__(
        self,
        layout: KVLayout,
        page_size: int,
        capacity_pages: int,
        backend: StoreBackend,
        namespace: Namespace,
        *,
        min_hits: int = 0,
        shard: HeadShard | None = None,
        exists_timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(layout, page_size, capacity_pages)
        if not isinstance(namespace, Namespace) or len(namespace.root) != KEY_BYTES:
            raise ValueError(f"store: namespace must be a hashing.Namespace, got {namespace!r}")
        for label, value in (
            ("exists_timeout_s", exists_timeout_s),
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
        ):
            if not value > 0:
                raise ValueError(f"store: {label} must be > 0, got {value!r}")
        if min_hits < 0:
            raise ValueError(f"store: min_hits must be >= 0, got {min_hits!r}")
        self.backend = backend
        self.namespace = namespace
        #: write back only pages whose tree node was hit at least this often (pages worth sharing)
        self.min_hits = int(min_hits)
        self.dtype = layout.torch_dtype
        self.codec = PageCodec(namespace, self.page_shape, layout.dtype, self.page_bytes, "store")
        self._prefix = f"sglh/{namespace.root.hex()}/"
        if shard is not None and not shard.whole:
            self._prefix += f"heads{shard.lo}-{shard.hi}/"
        self.exists_timeout_s = float(exists_timeout_s)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._index: dict[PageKey, bool] = {}  # key -> stored (False: reserved for a write)
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._down_until = 0.0
        self._down = False
        self._next_backoff = self.backoff_s
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # started on first use
        self._pending_exists: concurrent.futures.Future | None = None
        self._refused: set[PageKey] = set()  # puts that failed: not offered again (best-effort)

    # ------------------------------------------------------------------ accounting
    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def stored_pages(self) -> int:
        with self._lock:
            return sum(1 for v in self._index.values() if v)

    @property
    def free_pages(self) -> int:
        return max(0, self.capacity_pages - len(self._index))

    @property
    def available(self) -> bool:
        """False while the store is marked unavailable (between a failure and the next probe)."""
        return not self._down

    def contains(self, key: PageKey) -> bool:
        """True when the local view holds the page as stored. No I/O."""
        return self._index.get(key) is True

    def keys(self) -> Iterator[PageKey]:
        with self._lock:
            return iter([k for k, v in self._index.items() if v])

    def accepts(self, keys: Sequence[PageKey]) -> bool:
        """False for pages whose put already failed once (a full store): write-back skips them
        instead of retrying forever. Forgotten when the store recovers from an outage."""
        return not self._refused or not any(k in self._refused for k in keys)

    def store_key(self, key: PageKey) -> str:
        return self._prefix + check_key(key).hex()

    # ------------------------------------------------------------------ availability
    def _ready(self) -> bool:
        """May a call go to the backend now (not marked down, or its backoff has passed)?"""
        return not self._down or self._clock() >= self._down_until

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            was = self._down
            self._down = True
            self._down_until = self._clock() + self._next_backoff
            backoff = self._next_backoff
            self._next_backoff = min(self.max_backoff_s, self._next_backoff * 2)
            if not was:
                self.counters["errors"] += 1
        if not was:
            log.error(
                "store tier: %s unavailable (%s); serving from local tiers, retrying in %g s", self.url, exc, backoff
            )
        else:
            log.debug("store tier: %s still unavailable (%s); next try in %g s", self.url, exc, backoff)

    def _succeeded(self) -> None:
        if not self._down:
            return
        with self._lock:
            was = self._down
            self._down = False
            self._next_backoff = self.backoff_s
            self._refused.clear()
            if was:
                self.counters["recoveries"] += 1
        if was:
            log.warning("store tier: %s reachable again", self.url)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    # ------------------------------------------------------------------ lookups
    def count_present(self, keys: Sequence[PageKey]) -> int:
        """How many of `keys`, from the first, the store holds (one batched existence check, at most
        `exists_timeout_s`); those are added to the local view. 0 while the store is unavailable."""
        keys = [check_key(k) for k in keys]
        if not keys or not self._ready():
            return 0
        with self._lock:
            room = self.capacity_pages - len(self._index)
            known = 0
            for k in keys:
                if self._index.get(k) is not True:
                    break
                known += 1
        keys = keys[: known + max(0, room)]
        if known == len(keys):
            return known
        names = [self.store_key(k) for k in keys[known:]]
        try:
            flags = self._exists_bounded(names)
        except StoreUnavailable as exc:
            self._failed(exc)
            return known
        self._succeeded()
        found = known
        for flag in flags:
            if not flag:
                break
            found += 1
        with self._lock:
            self.counters["exists_calls"] += 1
            self.counters["exists_keys"] += len(names)
            self.counters["exists_found"] += found - known
            for k in keys[known:found]:
                if k not in self._index:
                    self._index[k] = True
        return found

    def _exists_bounded(self, names: list[str]) -> list[bool]:
        if not self.backend.may_block:
            return self.backend.exists(names)
        if self._pending_exists is not None and not self._pending_exists.done():
            raise StoreUnavailable("an earlier existence check is still blocked")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglh-store-exists")
        fut = self._pool.submit(self.backend.exists, names)
        self._pending_exists = fut
        try:
            return fut.result(timeout=self.exists_timeout_s)
        except concurrent.futures.TimeoutError:
            raise StoreUnavailable(f"existence check took longer than {self.exists_timeout_s:g} s") from None

    # ------------------------------------------------------------------ protocol
    def allocate(self, keys: Sequence[PageKey]) -> list[Handle] | None:
        keys = [check_key(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("store: allocate got the same key twice")
        if not self._ready():
            self._count("puts_skipped", len(keys))
            return None
        with self._lock:
            for k in keys:
                if k in self._index:
                    raise ValueError(f"store: page {k.hex()} is already allocated or stored (check contains() first)")
            if len(keys) > self.capacity_pages - len(self._index):
                return None
            for k in keys:
                self._index[k] = False
        return list(keys)

    def free(self, handles: Sequence[Handle]) -> None:
        keys = [check_key(k) for k in handles]
        with self._lock:
            if len(set(keys)) != len(keys):
                raise KeyError("store: free got the same key twice")
            for k in keys:
                if k not in self._index:
                    raise KeyError(f"store: page {k.hex()} is not allocated")
            for k in keys:  # forgotten here only: the shared store keeps it for the other servers
                del self._index[k]

    def write(self, handles: Sequence[Handle], data: torch.Tensor) -> None:
        """Put the pages (best-effort): TierIOError when any put failed or the store is unavailable;
        the pages before are stored."""
        self._check_data(handles, data)
        keys = [check_key(k) for k in handles]
        with self._lock:
            for k in keys:
                if k not in self._index:
                    raise KeyError(f"store: page {k.hex()} is not allocated")
        if not self._ready():
            self._count("puts_skipped", len(keys))
            raise TierIOError(f"store: {self.url} is unavailable; {len(keys)} pages not written")
        cpu = data.to("cpu").contiguous()
        values = [self.codec.encode(k, tensor_bytes(cpu[i])) for i, k in enumerate(keys)]
        try:
            ok = self.backend.put([self.store_key(k) for k in keys], values)
        except StoreUnavailable as exc:
            self._failed(exc)
            with self._lock:
                self.counters["puts_failed"] += len(keys)
                self._remember_refused(keys)
            raise TierIOError(f"store: put of {len(keys)} pages failed: {exc}") from exc
        self._succeeded()
        good = sum(ok)
        with self._lock:
            for k, stored in zip(keys, ok):
                if stored and k in self._index:
                    self._index[k] = True
            self.counters["pages_written"] += good
            self.counters["bytes_written"] += good * self.codec.value_bytes
            self.counters["puts_failed"] += len(keys) - good
            self._remember_refused([k for k, stored in zip(keys, ok) if not stored])
        if good != len(keys):
            raise TierIOError(f"store: {len(keys) - good} of {len(keys)} puts failed (store full?)")

    def _remember_refused(self, keys: Sequence[PageKey]) -> None:
        if len(self._refused) > 1 << 20:  # bounded: a very long outage forgets the oldest refusals
            self._refused.clear()
        self._refused.update(keys)

    def read(self, handles: Sequence[Handle]) -> torch.Tensor:
        out = torch.empty((len(handles), *self.page_shape), dtype=self.dtype)
        for i, h in enumerate(handles):
            self.read_into(h, out[i])
        return out

    def read_into(self, key: PageKey, out: torch.Tensor) -> None:
        """Fetch one page into `out` (contiguous CPU, page shape). PageCorruptError (the key is
        already dropped from the local view: forget it, do not free it) when the value is missing,
        unreadable or fails the codec; `out` is then undefined."""
        key = check_key(key)
        if (
            tuple(out.shape) != self.page_shape
            or out.dtype != self.dtype
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            raise ValueError(f"store: read_into needs a contiguous CPU tensor of {self.page_shape} / {self.dtype}")
        if self._index.get(key) is not True:
            raise KeyError(f"store: page {key.hex()} is not stored")
        if not self._ready():
            self._miss(key, "unavailable", "the store is unavailable", "read_misses")
        try:
            value = self.backend.get(self.store_key(key), self.codec.value_bytes)
        except StoreUnavailable as exc:
            self._failed(exc)
            self._miss(key, "unavailable", str(exc), "read_misses")
        self._succeeded()
        if value is None:
            self._miss(key, "missing", "the store no longer holds the page", "read_misses")
        payload, reason = self.codec.decode(value, key)
        if payload is None:
            if reason == DTYPE_MISMATCH:
                with self._lock:
                    self.counters["dtype_mismatch"] += 1
            counter = (
                "foreign_values"
                if reason == "foreign"
                else "version_skipped"
                if is_other_version(reason)
                else "corrupt_values"
            )
            self._miss(key, reason, f"bad value: {reason}", counter)
        tensor_bytes(out)[:] = payload
        with self._lock:
            self.counters["pages_read"] += 1
            self.counters["bytes_read"] += len(value)

    def _miss(self, key: PageKey, reason: str, detail: str, counter: str) -> NoReturn:
        with self._lock:
            self._index.pop(key, None)
            self.counters[counter] += 1
        err = PageCorruptError(f"store: page {key.hex()} not served ({reason}): {detail}")
        err.key_hex = key.hex()  # type: ignore[attr-defined]
        err.reason = reason  # type: ignore[attr-defined]
        raise err

    def close(self) -> None:
        """Stop the helper thread and close the backend's connections."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.backend.close()

    def snapshot(self) -> dict:
        """Counters plus where the store is and whether it is reachable (for reports and /metrics)."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out.update(url=self.url, available=not self._down, tracked_pages=self.stored_pages)
        return out


def open_store(config: CacheConfig, namespace: Namespace) -> SharedStoreTier:
    """The store tier a `CacheConfig` names (`store_url`, `store_tokens`, `store_min_hits`)."""
    from .store_backends import open_backend  # noqa: PLC0415 - the adapters import optional clients

    backend = open_backend(config.store_url or "")
    return SharedStoreTier(
        config.layout,
        config.page_size,
        config.store_pages,
        backend,
        namespace,
        min_hits=config.store_min_hits,
        shard=config.head_shard,
    )


__all__ = ["COUNTER_NAMES", "open_store", "STORE", "SharedStoreTier", "StoreBackend", "StoreUnavailable"]
