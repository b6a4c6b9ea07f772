"""The page codec shared by every tier that stores pages outside process memory (disk files, the
shared store): a 128-byte header (namespace, key, layout, payload checksum) then the payload, and
the two byte helpers both tiers use (`check_key`, `tensor_bytes`).

The layout is documented in `docs/disk-format.md`. A value whose header, length or checksum fails is
never served: `parse_header` says why, `decode` checks the bytes.
"""

from __future__ import annotations

import ctypes
import struct

import torch
import xxhash

from ..hashing import KEY_BYTES, Namespace, PageKey

MAGIC = b"SGLHPAGE"
FORMAT_VERSION = 1
HEADER_SIZE = 128
PAGE_SUFFIX = ".page"
DTYPE_MISMATCH = "dtype mismatch"  # parse_header's reason for a page of another element type
OTHER_VERSION = "format version"  # how parse_header's reason for a page of another format version starts
_STABLE_PREFIX = struct.Struct("<8sHH16s")  # magic, version, header size, namespace: never changes
_HEADER_BODY = struct.Struct("<8sHH16s16sQ16sI8IQ")  # ... payload checksum (112 bytes)
_HEADER_SUM = struct.Struct("<Q")
_MAX_DIMS = 8
_KEY_AT = _STABLE_PREFIX.size  # the page key follows the stable prefix
_PADDING = bytes(HEADER_SIZE - _HEADER_BODY.size - _HEADER_SUM.size)
assert _HEADER_BODY.size + _HEADER_SUM.size <= HEADER_SIZE


def check_key(key: object) -> PageKey:
    """A page key is exactly KEY_BYTES `bytes`; anything else is refused before it names a path."""
    if type(key) is not bytes or len(key) != KEY_BYTES:
        shown = repr(key)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise ValueError(f"disk: a page key must be {KEY_BYTES} bytes, got {type(key).__name__} {shown}")
    return key


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage, without a copy.

    The view does not keep the tensor alive: the caller must hold the tensor while using it.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("disk: tensor_bytes needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def is_other_version(reason: str) -> bool:
    """Whether a `parse_header` / `decode` reason says "written in another format version"."""
    return reason.startswith(OTHER_VERSION)


class PageCodec:
    """Encode and check page headers of one namespace and page layout.

    Contract: `parse_header(header, size, key)` returns `({"checksum": int}, "")` for a header this
    codec wrote for `key` with a value of `size` bytes in total, else `(None, reason)`; reason
    "foreign" means our magic under another namespace (another model or tenant: not corrupt, not ours);
    `DTYPE_MISMATCH` a page of our namespace and key whose header names another element type (e.g.
    written as float8_e5m2, read as float8_e4m3fn): never served, the stores count it apart; a reason
    starting with `OTHER_VERSION` a page of another format version (named with the version read):
    never served, never taken for corrupt (`is_other_version`).
    """

    def __init__(
        self, namespace: Namespace, page_shape: tuple[int, ...], dtype: str, payload_bytes: int, owner: str
    ) -> None:
        self.namespace = namespace
        self.page_shape = tuple(page_shape)
        self.dtype_name = dtype.encode("ascii")
        self.payload_bytes = payload_bytes
        if len(self.dtype_name) > 16 or len(self.page_shape) > _MAX_DIMS:
            raise ValueError(f"{owner}: layout {dtype} {self.page_shape} cannot be described by the page header")
        # every header of this codec is `_before_key + key + _after_key + checksum`: pack the fixed
        # fields once (a store writes one header per page)
        shape = list(self.page_shape) + [0] * (_MAX_DIMS - len(self.page_shape))
        fixed = _HEADER_BODY.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            namespace.root,
            bytes(16),
            payload_bytes,
            self.dtype_name,
            len(self.page_shape),
            *shape,
            0,
        )
        self._before_key, self._after_key = fixed[:_KEY_AT], fixed[_KEY_AT + 16 : -_HEADER_SUM.size]

    @property
    def value_bytes(self) -> int:
        """Header plus payload: the size of one stored page."""
        return HEADER_SIZE + self.payload_bytes

    def header(self, key: PageKey, checksum: int) -> bytes:
        if len(key) != 16:
            raise ValueError(f"page key must be 16 bytes, got {len(key)}")
        body = b"".join((self._before_key, key, self._after_key, _HEADER_SUM.pack(checksum)))
        return body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body)) + _PADDING

    def encode(self, key: PageKey, payload: memoryview | bytes) -> bytes:
        """Header + payload as one value (for stores that take whole values)."""
        return self.header(key, xxhash.xxh3_64_intdigest(payload)) + bytes(payload)

    def parse_header(self, header: bytes, size: int, key: PageKey) -> tuple[dict | None, str]:
        if len(header) < _STABLE_PREFIX.size:
            return None, "zero-length" if size == 0 else "truncated header"
        magic, version, header_size, ns = _STABLE_PREFIX.unpack_from(header)
        if magic != MAGIC:
            return None, "bad magic"
        if ns != self.namespace.root:
            return None, "foreign"
        if version != FORMAT_VERSION:
            return None, f"{OTHER_VERSION} {version} (this build reads {FORMAT_VERSION})"
        if header_size != HEADER_SIZE or len(header) < HEADER_SIZE:
            return None, "truncated header"
        body = header[: _HEADER_BODY.size]
        (stored_sum,) = _HEADER_SUM.unpack_from(header, _HEADER_BODY.size)
        if xxhash.xxh3_64_intdigest(body) != stored_sum:
            return None, "header checksum"
        f = _HEADER_BODY.unpack(body)
        file_key, length, dtype_name, ndim = f[4], f[5], f[6].rstrip(b"\0"), f[7]
        shape, checksum = f[8 : 8 + _MAX_DIMS], f[-1]
        if file_key != key:
            return None, "key does not match file name"
        if dtype_name != self.dtype_name:
            # (fp8_e4m3 and fp8_e5m2 pages have the same shape and length: only this tells them apart)
            return None, DTYPE_MISMATCH
        if tuple(shape[:ndim]) != self.page_shape or length != self.payload_bytes:
            return None, "layout mismatch"
        if size != HEADER_SIZE + length:
            return None, "truncated" if size < HEADER_SIZE + length else "trailing bytes"
        return {"checksum": checksum}, ""

    def decode(self, value: bytes | memoryview, key: PageKey) -> tuple[memoryview | None, str]:
        """The payload of a whole stored value, or (None, reason) when it is not a valid page of `key`."""
        view = memoryview(value).cast("B")
        fields, reason = self.parse_header(bytes(view[:HEADER_SIZE]), len(view), key)
        if fields is None:
            return None, reason
        payload = view[HEADER_SIZE:]
        if xxhash.xxh3_64_intdigest(payload) != fields["checksum"]:
            return None, "checksum"
        return payload, ""


__all__ = [
    "DTYPE_MISMATCH",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "OTHER_VERSION",
    "PAGE_SUFFIX",
    "PageCodec",
    "check_key",
    "is_other_version",
    "tensor_bytes",
]
