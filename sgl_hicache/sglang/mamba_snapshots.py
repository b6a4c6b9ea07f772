"""Recurrent-state snapshots of a hybrid Mamba / linear-attention model, tiered device -> host -> disk.

A hybrid model resumes a prefix only from the recurrent state at exactly the hit point. `SnapshotTiers`
keeps those states, one per tree point that has one, keyed by the tree's chained page key of the page
that ends there (`TreeNode.keys`): the key the disk tier names that page by, so a restarted server
finds the snapshot files of the pages it finds.

Tiers of one snapshot (any subset; an entry held nowhere is forgotten):
- device: a slot of SGLang's `MambaPool`, taken from the mamba allocator (a finished request's own
  slot, handed over at its commit, or a slot a promotion fills);
- host: the state's bytes in DRAM (`MambaStateAdapter.read`), charged `snapshot_bytes` against the
  snapshots' share of the host budget;
- disk: one file per snapshot under the disk tier's directory (`<dir>/mamba_states/<key hex>.state`:
  header with the depth, the payload size and a BLAKE2b digest; a file that fails it is deleted and
  counted, never restored), charged `snapshot_bytes` against the snapshots' share of the disk budget.

Which snapshot goes first out of a tier is the policy's (`policy.snapshots.priority`: Marconi's
reuse x FLOPs saved per byte; the least recently used first among equals); this module moves bytes.
A restore copies the state into the request's own slot: the tree's copy is never handed out
(copy-on-write), so no request mutates it. Device slots under pressure demote to host (and host to
disk) before they are freed (`evict_device`).

Contract: every call runs on SGLang's scheduler thread; disk reads and writes of snapshots are made
inline (a snapshot is one file of `snapshot_bytes`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..policy.snapshots import Candidate, SnapshotCosts, priority

logger = logging.getLogger(__name__)

MAGIC = b"SGLMSNP1"
_HEADER = struct.Struct("<8sQQQ16s")  # magic, depth, ancestor depth, payload bytes, blake2b-128 of the payload
SUFFIX = ".state"
SUBDIR = "mamba_states"
DEVICE, HOST, DISK = "device", "host", "disk"


class StateIO(Protocol):
    """What the tiers need of SGLang's `MambaPool` (`pool_adapters.MambaStateAdapter` is one)."""

    snapshot_bytes: int

    def read(self, slots: list[int]) -> torch.Tensor: ...

    def write(self, slots: list[int], pages: torch.Tensor) -> None: ...


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_file(depth: int, ancestor_depth: int, payload: bytes) -> bytes:
    """A snapshot file's bytes: header (depth, ancestor depth, size, digest), then the payload."""
    return _HEADER.pack(MAGIC, depth, ancestor_depth, len(payload), _digest(payload)) + payload


def decode_header(head: bytes) -> tuple[int, int, int, bytes] | None:
    """(depth, ancestor depth, payload bytes, digest) of a snapshot file's header, None when not one."""
    if len(head) < _HEADER.size:
        return None
    magic, depth, ancestor, size, digest = _HEADER.unpack(head[: _HEADER.size])
    return (depth, ancestor, size, digest) if magic == MAGIC else None


@dataclass(eq=False)
class Snapshot:
    """One state snapshot: the state after the first `depth` tokens of a prefix whose chained page key
    is `key`. `ancestor_depth`: the depth of the nearest snapshot above it when it was taken (the
    policy's gap). Held in `slot` (device), `host` (bytes in DRAM) and/or on disk."""

    key: bytes
    depth: int
    ancestor_depth: int
    slot: int | None = None
    host: torch.Tensor | None = None
    on_disk: bool = False
    reuse: int = 0
    last_use: int = 0

    @property
    def held(self) -> bool:
        return self.slot is not None or self.host is not None or self.on_disk


class SnapshotTiers:
    """The snapshots of one hybrid model's tree (see the module docstring).

    `state` reads and writes slots of SGLang's `MambaPool` (`pool`, whose `copy_from` copies slot to
    slot); `allocator` is SGLang's mamba slot allocator (`alloc(n)` / `free(indices)`); `host_bytes`
    and `disk_bytes` are the snapshots' budgets; `disk_dir` None: no disk tier. `min_gap_tokens`: a
    snapshot closer than this to its nearest kept ancestor is not kept (the policy's `keep` rule)."""

    def __init__(
        self,
        state: StateIO,
        pool: Any,
        allocator: Any,
        costs: SnapshotCosts,
        *,
        host_bytes: int,
        disk_dir: Path | None,
        disk_bytes: int,
        min_gap_tokens: int = 1,
    ) -> None:
        self.state = state
        self.pool = pool
        self.allocator = allocator
        self.costs = costs
        self.size = int(state.snapshot_bytes)
        self.host_bytes = max(0, int(host_bytes))
        self.disk_bytes = max(0, int(disk_bytes)) if disk_dir is not None else 0
        self.min_gap_tokens = max(1, int(min_gap_tokens))
        self.dir = Path(disk_dir) / SUBDIR if disk_dir is not None and self.disk_bytes >= self.size else None
        self.entries: dict[bytes, Snapshot] = {}
        self.used = {DEVICE: 0, HOST: 0, DISK: 0}  # entries per tier
        self._clock = itertools.count(1)
        self.counters: dict[str, int] = {
            "taken": 0,  # finished requests' slots kept as snapshots
            "declined": 0,  # a snapshot of that key existed, or the gap to its ancestor was too short
            "restored_device": 0,
            "restored_host": 0,
            "restored_disk": 0,
            "demoted_device": 0,  # device slots freed under mamba slot pressure, the state kept below
            "dropped_device": 0,  # ... with nowhere below to keep it
            "demoted_host": 0,
            "dropped_host": 0,
            "disk_writes": 0,
            "disk_deleted": 0,
            "disk_corrupt": 0,
            "disk_found_at_start": 0,
        }
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    # ---- queries -------------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def tier_of(self, key: bytes) -> str | None:
        e = self.entries.get(key)
        if e is None:
            return None
        return DEVICE if e.slot is not None else HOST if e.host is not None else DISK if e.on_disk else None

    def device_slots(self) -> list[int]:
        return [e.slot for e in self.entries.values() if e.slot is not None]

    def bytes_in(self, tier: str) -> int:
        """The bytes of the snapshots `tier` holds, at their true size."""
        return self.used[tier] * self.size

    def stats(self) -> dict[str, Any]:
        return {
            "snapshot_bytes": self.size,
            "snapshots": len(self.entries),
            "device_snapshots": self.used[DEVICE],
            "host_bytes": self.bytes_in(HOST),
            "host_budget_bytes": self.host_bytes,
            "disk_bytes": self.bytes_in(DISK),
            "disk_budget_bytes": self.disk_bytes,
            "disk_dir": str(self.dir) if self.dir is not None else None,
            **self.counters,
        }

    # ---- the request path ----------------------------------------------------------------------
    def take(self, key: bytes, depth: int, ancestor_depth: int, slot: int) -> bool:
        """Keep a finished request's `slot` (its state after `depth` tokens) as the snapshot of `key`.
        False: not kept (one exists, or too close to its ancestor); the caller still owns the slot."""
        if key in self.entries or depth - ancestor_depth < self.min_gap_tokens:
            self.counters["declined"] += 1
            return False
        e = Snapshot(key, depth, ancestor_depth, last_use=next(self._clock))
        self.entries[key] = e
        self._set_slot(e, int(slot))
        self.counters["taken"] += 1
        return True

    def restore(self, key: bytes, dst_slot: int) -> str | None:
        """Copy the snapshot of `key` into the request's slot `dst_slot` (the tree's copy stays as it
        is). Returns the tier that served it, or None (no snapshot, or its disk file failed its check)."""
        e = self.entries.get(key)
        if e is None:
            return None
        e.reuse += 1
        e.last_use = next(self._clock)
        if e.slot is not None:
            dev = self.pool_device()
            self.pool.copy_from(
                torch.tensor([e.slot], dtype=torch.int64, device=dev),
                torch.tensor([dst_slot], dtype=torch.int64, device=dev),
            )
            tier = DEVICE
        elif e.host is not None:
            self.state.write([dst_slot], e.host)
            tier = HOST
        else:
            payload = self._read_file(e)
            if payload is None:
                return None
            self.state.write([dst_slot], payload)
            self._put_host(e, payload)  # promoted: the next hit reads DRAM
            tier = DISK
        self.counters[f"restored_{tier}"] += 1
        return tier

    def evict_device(self, num: int) -> int:
        """Free `num` device slots (SGLang is short of mamba slots): the lowest-priority snapshots'
        states go to host (or disk) first where the budgets allow. Returns the slots freed."""
        freed = 0
        while freed < num:
            victims = [e for e in self.entries.values() if e.slot is not None]
            if not victims:
                break
            e = min(victims, key=self._rank)
            if e.host is None and (self.host_bytes >= self.size or self.dir is not None):
                payload = self.state.read([e.slot])  # type: ignore[list-item]
                self._put_host(e, payload)
                if e.host is None and not e.on_disk:
                    self._put_disk(e, payload)
            self.counters["demoted_device" if e.host is not None or e.on_disk else "dropped_device"] += 1
            self._drop_slot(e)
            freed += 1
        return freed

    def reset(self) -> None:
        """SGLang's flush: the device and host copies go (their slots back to the allocator); the
        disk files stay, for a restart."""
        for e in list(self.entries.values()):
            if e.slot is not None:
                self._drop_slot(e)
            if e.host is not None:
                e.host = None
                self.used[HOST] -= 1
            self._forget_if_empty(e)

    # ---- tiers ---------------------------------------------------------------------------------
    def pool_device(self) -> torch.device:
        return self.pool.mamba_cache.temporal.device

    def _rank(self, e: Snapshot) -> tuple[float, int]:
        return priority(self.costs, Candidate(e.key, e.depth, e.ancestor_depth, e.reuse)), e.last_use

    def _set_slot(self, e: Snapshot, slot: int) -> None:
        e.slot = slot
        self.used[DEVICE] += 1

    def _drop_slot(self, e: Snapshot) -> None:
        assert e.slot is not None
        self.allocator.free(torch.tensor([e.slot], dtype=torch.int64, device=self.pool_device()))
        e.slot = None
        self.used[DEVICE] -= 1
        self._forget_if_empty(e)

    def _forget_if_empty(self, e: Snapshot) -> None:
        if not e.held and self.entries.get(e.key) is e:
            del self.entries[e.key]

    def _put_host(self, e: Snapshot, payload: torch.Tensor) -> None:
        if e.host is not None or self.host_bytes < self.size:
            return
        while self.bytes_in(HOST) + self.size > self.host_bytes:
            victims = [x for x in self.entries.values() if x.host is not None and x is not e]
            if not victims:
                return
            v = min(victims, key=self._rank)
            if not v.on_disk:
                self._put_disk(v, v.host)  # type: ignore[arg-type]
            self.counters["demoted_host" if v.on_disk else "dropped_host"] += 1
            v.host = None
            self.used[HOST] -= 1
            self._forget_if_empty(v)
        e.host = payload.detach().to("cpu").clone()
        self.used[HOST] += 1

    def _path(self, key: bytes) -> Path:
        assert self.dir is not None
        return self.dir / (key.hex() + SUFFIX)

    def _put_disk(self, e: Snapshot, payload: torch.Tensor) -> None:
        if self.dir is None or e.on_disk:
            return
        while self.bytes_in(DISK) + self.size > self.disk_bytes:
            victims = [x for x in self.entries.values() if x.on_disk and x is not e]
            if not victims:
                return
            self._delete_file(min(victims, key=self._rank))
        raw = payload.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        path = self._path(e.key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_bytes(encode_file(e.depth, e.ancestor_depth, raw))
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("sgl_hicache: cannot write the state snapshot %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return
        e.on_disk = True
        self.used[DISK] += 1
        self.counters["disk_writes"] += 1

    def _delete_file(self, e: Snapshot) -> None:
        self._path(e.key).unlink(missing_ok=True)
        e.on_disk = False
        self.used[DISK] -= 1
        self.counters["disk_deleted"] += 1
        self._forget_if_empty(e)

    def _read_file(self, e: Snapshot) -> torch.Tensor | None:
        try:
            data = self._path(e.key).read_bytes()
        except OSError:
            data = b""
        head = decode_header(data)
        payload = data[_HEADER.size :]
        if head is None or head[2] != self.size or len(payload) != self.size or _digest(payload) != head[3]:
            logger.warning("sgl_hicache: state snapshot %s failed its check: deleted", self._path(e.key))
            self.counters["disk_corrupt"] += 1
            self._delete_file(e)
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(torch.bfloat16).view(1, 1, 1, 1, 1, -1)

    def _scan(self) -> None:
        """Index the snapshot files an earlier process left (their headers only; payloads are checked
        when read). Files of another snapshot size are deleted."""
        assert self.dir is not None
        for entry in os.scandir(self.dir):
            name = entry.name
            if not name.endswith(SUFFIX):
                if ".tmp" in name:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
                with open(entry.path, "rb") as f:
                    head = decode_header(f.read(_HEADER.size))
            except (ValueError, OSError):
                head = None
            if head is None or head[2] != self.size or self.bytes_in(DISK) + self.size > self.disk_bytes:
                Path(entry.path).unlink(missing_ok=True)
                continue
            self.entries[key] = Snapshot(key, int(head[0]), int(head[1]), on_disk=True)
            self.used[DISK] += 1
            self.counters["disk_found_at_start"] += 1


__all__ = ["DISK", "DEVICE", "HOST", "SUBDIR", "SUFFIX", "Snapshot", "SnapshotTiers", "decode_header", "encode_file"]
