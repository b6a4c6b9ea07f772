"""The two store adapters behind `StoreBackend`: Mooncake Store and Redis/Valkey. The only module that
names a store product; `open_backend(url)` picks one by URL scheme.

URLs:
- `mooncake://HOST:PORT` (the master's RPC address). Query options: `metadata=` the HTTP metadata
  server (default `http://HOST:8080/metadata`), `local=` this host's address for the transfer
  engine (default 127.0.0.1 for a loopback master, else this host's name), `protocol=` (tcp).
  The client mounts no memory (global segment 0): data lives in the holders, so a server that exits
  takes no pages with it.
- `redis://HOST:PORT[/DB]` (or `rediss://`, `valkey://`): anything redis-py's `from_url` accepts.
- `memory://NAME`: a dict in this process, shared by the caches given the same `MemoryBackend`
  object; what the embedded engine's fleet what-if uses (`engine/fleet.py`). Not for serving.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import urllib.parse

from .store_protocol import StoreBackend, StoreUnavailable

SCHEMES = ("mooncake", "redis", "rediss", "valkey", "memory")

# Mooncake error codes (mooncake-store `types.h`) the adapter tells apart
_MC_OBJECT_NOT_FOUND = -704
_MC_BUFFER_OVERFLOW = -600
_MC_RPC_FAIL = -900


class MooncakeBackend(StoreBackend):
    """Mooncake Store through `MooncakeDistributedStore`. Reads use `get_into` into a registered
    per-thread buffer, whose status code tells "missing" (-704) from "did not arrive" (any other
    negative code: raised), because `get` returns b'' in both cases."""

    def __init__(self, url: str, local_buffer_mb: int = 64) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - optional dependency
        except ImportError as exc:
            raise ValueError(
                f"--store {url}: needs `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` and "
                f"`apt-get install -y libibverbs1` ({exc})"
            ) from exc
        u = urllib.parse.urlparse(url)
        if not u.hostname or not u.port:
            raise ValueError(
                f"--store {url!r}: a mooncake URL needs the master's HOST:PORT (mooncake://127.0.0.1:50051)"
            )
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query).items()}
        unknown = set(q) - {"metadata", "local", "protocol"}
        if unknown:
            raise ValueError(
                f"--store {url!r}: unknown option(s) {', '.join(sorted(unknown))}; known: metadata, local, protocol"
            )
        loopback = u.hostname in ("127.0.0.1", "localhost", "::1")
        self.url = url
        self.metadata = q.get("metadata", f"http://{u.hostname}:8080/metadata")
        local = q.get("local", "127.0.0.1" if loopback else socket.gethostname())
        if loopback:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # else it advertises the external address
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local, self.metadata, 0, local_buffer_mb << 20, q.get("protocol", "tcp"), "", f"{u.hostname}:{u.port}"
        )
        if rc != 0:
            raise StoreUnavailable(
                f"mooncake: cannot connect to master {u.hostname}:{u.port} (metadata {self.metadata}): setup returned {rc}"
            )
        self._tls = threading.local()
        self._buffers: list[ctypes.Array] = []  # registered staging buffers, alive as long as the client
        self._lock = threading.Lock()

    def _staging(self, size: int) -> tuple[int, ctypes.Array]:
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < size:
            size = 1 << max(size - 1, 1).bit_length()  # powers of two: a growing batch registers few buffers
            buf = ctypes.create_string_buffer(size)
            rc = self._store.register_buffer(ctypes.addressof(buf), size)
            if rc != 0:
                raise StoreUnavailable(f"mooncake: register_buffer returned {rc}")
            with self._lock:
                self._buffers.append(buf)
            self._tls.buf = buf
        return ctypes.addressof(buf), buf

    def exists(self, keys: list[str]) -> list[bool]:
        flags = self._store.batch_is_exist(keys)
        if any(f < 0 for f in flags):
            raise StoreUnavailable(f"mooncake: batch_is_exist returned {min(flags)}")
        return [f == 1 for f in flags]

    def get(self, key: str, max_bytes: int) -> bytes | None:
        ptr, _buf = self._staging(max_bytes + 1)  # one spare byte: a longer value is not ours
        n = self._store.get_into(key, ptr, max_bytes + 1)
        if n == _MC_OBJECT_NOT_FOUND:
            return None
        if n == _MC_BUFFER_OVERFLOW:
            return b""  # larger than any page of ours: fails the codec
        if n < 0:
            raise StoreUnavailable(f"mooncake: get_into returned {n}")
        return ctypes.string_at(ptr, n)

    def put(self, keys: list[str], values: list[bytes]) -> list[bool]:
        # batch_upsert_from answers per key (upsert_batch has one code for the batch): a store with
        # room for some of the pages keeps those, and only the refused ones count as failed.
        # Upsert: a page another server wrote is equal anyway.
        ptr, _buf = self._staging(sum(len(v) for v in values))
        ptrs, off = [], 0
        for v in values:
            ctypes.memmove(ptr + off, v, len(v))
            ptrs.append(ptr + off)
            off += len(v)
        rcs = self._store.batch_upsert_from(keys, ptrs, [len(v) for v in values])
        if _MC_RPC_FAIL in rcs:
            raise StoreUnavailable(f"mooncake: batch_upsert_from returned {_MC_RPC_FAIL} (master unreachable)")
        return [rc == 0 for rc in rcs]

    def close(self) -> None:
        try:
            self._store.close()
        except Exception:  # noqa: BLE001 - closing a client of a dead master must not raise
            pass


class RedisBackend(StoreBackend):
    """Redis or Valkey through redis-py (hiredis when installed), pipelined batches."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        try:
            import redis  # noqa: PLC0415 - optional dependency
        except ImportError as exc:
            raise ValueError(f"--store {url}: needs `pip install redis hiredis` ({exc})") from exc
        self._redis = redis
        self.url = url
        fixed = "redis" + url[len("valkey") :] if url.startswith("valkey") else url
        try:
            self._client = redis.Redis.from_url(fixed, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except ValueError as exc:
            raise ValueError(f"--store {url!r}: {exc}") from exc
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

    def exists(self, keys: list[str]) -> list[bool]:
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]
        except self._errors as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    def get(self, key: str, max_bytes: int) -> bytes | None:
        try:
            value = self._client.get(key)
        except self._errors as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        if value is None:
            return None
        return value if len(value) <= max_bytes else b""  # type: ignore[return-value]  # (bytes: the client does not decode)

    def put(self, keys: list[str], values: list[bytes]) -> list[bool]:
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, v in zip(keys, values):
                pipe.set(k, v)
            results = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        # a full server with a no-eviction policy answers OOM per key: a failed put, not an outage
        return [r is True for r in results]

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


class MemoryBackend(StoreBackend):
    """An in-process dict: the shared store of a simulated fleet (no network, no eviction)."""

    may_block = False

    def __init__(self, url: str = "memory://fleet") -> None:
        self.url = url
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def exists(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def get(self, key: str, max_bytes: int) -> bytes | None:
        with self._lock:
            value = self._data.get(key)
        return value if value is None or len(value) <= max_bytes else b""

    def put(self, keys: list[str], values: list[bytes]) -> list[bool]:
        with self._lock:
            self._data.update(zip(keys, values))
        return [True] * len(keys)


def open_backend(url: str) -> StoreBackend:
    """The adapter for `url` (its scheme names the product); ValueError naming the URL when it is not one."""
    scheme = urllib.parse.urlparse(url).scheme
    if scheme == "mooncake":
        return MooncakeBackend(url)
    if scheme in ("redis", "rediss", "valkey"):
        return RedisBackend(url)
    if scheme == "memory":
        return MemoryBackend(url)
    raise ValueError(f"--store {url!r}: unknown store; give mooncake://HOST:PORT or redis://HOST:PORT")


__all__ = ["MemoryBackend", "MooncakeBackend", "RedisBackend", "SCHEMES", "open_backend"]
