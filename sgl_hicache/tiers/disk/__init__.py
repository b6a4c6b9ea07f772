"""The disk tier: content-addressed page files that survive a restart and never serve wrong KV.

`DiskPageStore` (`page_store.py`) is the public API (`HeadShardDiskStore`, `head_shards.py`: one shard
of the KV heads, reading the other shards' pages too); `manifest.py` the directory's format version; `files.py` is the file protocol, `recovery.py` the
start-up scan and the pages other processes wrote, `ledger.py` what the processes sharing one
directory agree on. The on-disk format, the rules and the errors: `docs/disk-format.md`.
"""

from __future__ import annotations

from ..codec import FORMAT_VERSION, HEADER_SIZE, MAGIC, PAGE_SUFFIX, check_key, tensor_bytes
from .head_shards import HeadShardDiskStore
from .manifest import MANIFEST_NAME, READABLE_VERSIONS, DiskFormatError
from .page_store import COUNTER_NAMES, DiskPageStore

__all__ = [
    "COUNTER_NAMES",
    "DiskFormatError",
    "DiskPageStore",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "HeadShardDiskStore",
    "MAGIC",
    "MANIFEST_NAME",
    "PAGE_SUFFIX",
    "READABLE_VERSIONS",
    "check_key",
    "tensor_bytes",
]
