"""The byte movers of recurrent-state snapshots (`mamba_snapshots.SnapshotTiers`), run by the
transfer engine's workers like the KV pages' movers (`transfer/handlers.py`).

A snapshot copy is a `StateCopy`: a `TransferOp` of one state, its source and destination named by
the `STATE_*` links, its bytes in DRAM carried on the op (`payload`: given for a disk write, filled
by the mover for a device read or a disk read). The movers are registered in the cache's handler
table (`TieredCache.handlers`) under those links, so the transfer engine runs them and the I/O
guard (`call_timer.IOGuard`) watches them like any copy between tiers.

Snapshot file format: `<dir>/<key hex>.state`, a header (magic, depth, ancestor depth, payload
bytes, BLAKE2b-128 of the payload) then the payload. A read that fails the header, size or digest
raises `PageCorruptError`; the caller deletes the file and never restores it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ....tiers.base import PageCorruptError
from ....transfer.handlers import Handler
from ....transfer.ops import TransferOp

MAGIC = b"SGLMSNP1"
HEADER = struct.Struct("<8sQQQ16s")  # magic, depth, ancestor depth, payload bytes, blake2b-128 of the payload
SUFFIX = ".state"
# the snapshot links in the cache's handler table (apart from the KV pages' "device" / "host" / "disk")
STATE_DEVICE, STATE_HOST, STATE_DISK = "state:device", "state:host", "state:disk"


class StateIO(Protocol):
    """What the tiers need of SGLang's `MambaPool` (`pool_adapters.MambaStateAdapter` is one)."""

    snapshot_bytes: int

    def read(self, slots: list[int]) -> torch.Tensor: ...

    def write(self, slots: list[int], pages: torch.Tensor) -> None: ...


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_file(depth: int, ancestor_depth: int, payload: bytes) -> bytes:
    """A snapshot file's bytes: header (depth, ancestor depth, size, digest), then the payload."""
    return HEADER.pack(MAGIC, depth, ancestor_depth, len(payload), digest(payload)) + payload


def decode_header(head: bytes) -> tuple[int, int, int, bytes] | None:
    """(depth, ancestor depth, payload bytes, digest) of a snapshot file's header, None when not one."""
    if len(head) < HEADER.size:
        return None
    magic, depth, ancestor, size, dig = HEADER.unpack(head[: HEADER.size])
    return (depth, ancestor, size, dig) if magic == MAGIC else None


@dataclass(eq=False)
class StateCopy(TransferOp):
    """One snapshot's state moving between tiers (module docstring). `key` names the snapshot;
    `path` is its file (disk links); `depth` / `ancestor_depth` go into a written file's header;
    `drop_host`: a host -> disk write made to free host room (the host copy goes once it lands)."""

    key: bytes = b""
    payload: torch.Tensor | None = None
    path: Path | None = None
    depth: int = 0
    ancestor_depth: int = 0
    drop_host: bool = False


def state_copy(
    key: bytes, src: str, dst: str, nbytes: int, kind: str, source: int | None = None, **fields
) -> StateCopy:
    """A prepared copy of the snapshot `key` (no tree node: snapshots are keyed by page key);
    `source`: the device slot it is read from (a device read)."""
    handle = key if source is None else source
    return StateCopy(None, src, dst, [handle], [key], nbytes, kind, key=key, **fields)  # type: ignore[arg-type]


def state_movers(state: StateIO) -> dict[tuple[str, str], Handler]:
    """The movers of `state`'s snapshots: device slot -> DRAM, DRAM -> file, file -> DRAM (checked)."""
    size = int(state.snapshot_bytes)

    def device_to_host(op: TransferOp, start: int, stop: int) -> None:
        assert isinstance(op, StateCopy)
        op.payload = state.read([int(op.src_handles[0])])  # a fresh CPU tensor: the slot is only read

    def host_to_disk(op: TransferOp, start: int, stop: int) -> None:
        assert isinstance(op, StateCopy) and op.payload is not None and op.path is not None
        raw = op.payload.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        tmp = op.path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_bytes(encode_file(op.depth, op.ancestor_depth, raw))
            os.replace(tmp, op.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def disk_to_host(op: TransferOp, start: int, stop: int) -> None:
        assert isinstance(op, StateCopy) and op.path is not None
        data = op.path.read_bytes()
        head = decode_header(data)
        payload = data[HEADER.size :]
        if head is None or head[2] != size or len(payload) != size or digest(payload) != head[3]:
            raise PageCorruptError(f"state snapshot {op.path} failed its check")
        op.payload = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(torch.bfloat16).view(1, 1, 1, 1, 1, -1)
        )

    return {
        (STATE_DEVICE, STATE_HOST): device_to_host,
        (STATE_HOST, STATE_DISK): host_to_disk,
        (STATE_DISK, STATE_HOST): disk_to_host,
    }


__all__ = [
    "HEADER",
    "MAGIC",
    "STATE_DEVICE",
    "STATE_DISK",
    "STATE_HOST",
    "SUFFIX",
    "StateCopy",
    "StateIO",
    "decode_header",
    "encode_file",
    "state_copy",
    "state_movers",
]
