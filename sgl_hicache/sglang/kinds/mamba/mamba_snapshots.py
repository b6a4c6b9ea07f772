"""Recurrent-state snapshots of a hybrid Mamba / linear-attention model, tiered device -> host -> disk.

A hybrid model resumes a prefix only from the recurrent state at exactly the hit point. `SnapshotTiers`
keeps those states, one per tree point that has one, keyed by the tree's chained page key of the page
that ends there (`TreeNode.keys`): the key the disk tier names that page by, so a restarted server
finds the snapshot files of the pages it finds.

Tiers of one snapshot (any subset; an entry held nowhere is forgotten):
- device: a slot of SGLang's `MambaPool`, taken from the mamba allocator (the slot a request's
  strategy offers at its commit: a finished request's own slot under `no_buffer`, a ping-pong track
  slot under `extra_buffer`; `state_sources.py`);
- host: the state's bytes in DRAM (`MambaStateAdapter.read`), charged `snapshot_bytes` against the
  snapshots' share of the host budget;
- disk: one file per snapshot under the disk tier's directory (`<dir>/mamba_states/<key hex>.state`,
  `mamba_moves`: header with the depth, the payload size and a BLAKE2b digest; a file that fails it
  is deleted and counted, never restored), charged `snapshot_bytes` against the disk share.

Every byte between tiers moves on the transfer engine's threads (`mamba_moves.state_movers`, run
through the cache's handler table and executor like the KV pages' copies); the scheduler thread
only plans, and applies what landed (`poll`, at every step boundary and in each call below):
- write-through at commit: a taken snapshot's device -> host copy starts at once (`take`; else at
  the next step, `pump`, once the host share has room). Its slot stays the tree's, counted as
  protected, not evictable, until the copy lands: no allocation can hand it out while it is read.
- host room: the lowest-priority host copies that are on disk already are dropped; the others are
  written host -> disk in the background, and leave DRAM only once their file landed;
- eviction (`evict_device`, SGLang short of mamba slots) never copies: it frees clean slots (their
  state is kept below) first, then drops dirty ones (counted `dropped_device`);
- a disk hit's file is read (and checked) on a worker while the request waits for its pages
  (`fetch`, answered "pending" until it lands); it then serves from DRAM.
A copy in flight leaves its source where it was, and a hit meanwhile is served from it (the slot, or
the host copy being written); a copy that fails loses nothing (the state stays in its tier; counted
`demote_failed` / `disk_write_failed`); a disk read that fails deletes the file (`disk_corrupt` /
`disk_read_failed`) and the hit is recomputed.

Which snapshot goes first out of a tier is the policy's (`policy.snapshots.priority`: Marconi's
reuse x FLOPs saved per byte; the least recently used first among equals); this module moves bytes.
A restore copies the state into the request's own slot (copy-on-write: the tree's copy is never
handed out, so no request mutates it): slot to slot on the device, or the landed DRAM copy into the
slot (`snapshot_bytes`, one state) at the request's admission, before it runs.

Contract: every call runs on SGLang's scheduler thread (file deletes of evicted snapshots included).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ....policy.snapshots import Candidate, SnapshotCosts, priority
from ....tiers.base import PageCorruptError
from ....transfer.ops import TransferOp
from .mamba_moves import (
    HEADER,
    STATE_DEVICE,
    STATE_DISK,
    STATE_HOST,
    SUFFIX,
    StateCopy,
    StateIO,
    decode_header,
    encode_file,
    state_copy,
    state_movers,
)

logger = logging.getLogger(__name__)

SUBDIR = "mamba_states"
DEVICE, HOST, DISK = "device", "host", "disk"
READY, PENDING = "ready", "pending"  # `fetch`'s answers


@dataclass(eq=False)
class Snapshot:
    """One state snapshot: the state after the first `depth` tokens of a prefix whose chained page key
    is `key`. `ancestor_depth`: the depth of the nearest snapshot above it when it was taken (the
    policy's gap). Held in `slot` (device), `host` (bytes in DRAM) and/or on disk; `staged`: a disk
    read that landed while the host share had no room, kept (uncharged) for the restore it was read
    for; `from_disk`: its DRAM copy came from the disk since its last restore."""

    key: bytes
    depth: int
    ancestor_depth: int
    slot: int | None = None
    host: torch.Tensor | None = None
    on_disk: bool = False
    staged: torch.Tensor | None = None
    from_disk: bool = False
    reuse: int = 0
    last_use: int = 0

    @property
    def held(self) -> bool:
        return self.slot is not None or self.host is not None or self.on_disk or self.staged is not None


class SnapshotTiers:
    """The snapshots of one hybrid model's tree (see the module docstring).

    `state` reads and writes slots of SGLang's `MambaPool` (`pool`, whose `copy_from` copies slot to
    slot); `allocator` is SGLang's mamba slot allocator (`alloc(n)` / `free(indices)`); `host_bytes`
    and `disk_bytes` are the snapshots' budgets; `disk_dir` None: no disk tier. `min_gap_tokens`: a
    snapshot closer than this to its nearest kept ancestor is not kept (the policy's `keep` rule).
    `handlers`: the handler table the transfer engine runs (the cache's: the movers are registered
    there); `submit(ops, kind)`: queues prepared ops on the engine (an `Executor.submit_ops`), which
    sets each op's `executed`; nothing here waits for one."""

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
        handlers: dict,
        submit: Callable[[Sequence[TransferOp], str], None],
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
        self.used = {DEVICE: 0, HOST: 0, DISK: 0}  # entries per tier (landed copies)
        self.reserved = {HOST: 0, DISK: 0}  # room held for copies in flight into the tier
        self.pending: dict[bytes, StateCopy] = {}  # the copy in flight of each snapshot (one at most)
        self.dirty: set[bytes] = set()  # device snapshots with no copy below yet
        handlers.update(state_movers(state))
        self.submit = submit
        self._clock = itertools.count(1)
        self.counters: dict[str, int] = {
            "taken": 0,  # requests' slots kept as snapshots
            "declined": 0,  # a snapshot of that key existed, or the gap to its ancestor was too short
            "restored_device": 0,
            "restored_host": 0,
            "restored_disk": 0,
            "host_copies": 0,  # device -> host copies landed (write-through)
            "demote_failed": 0,  # ... failed: the state stayed in its slot
            "demoted_device": 0,  # device slots freed under mamba slot pressure, the state kept below
            "dropped_device": 0,  # ... with no copy below (never copied at eviction)
            "demoted_host": 0,
            "dropped_host": 0,
            "disk_writes": 0,
            "disk_write_failed": 0,  # the host copy stayed
            "disk_reads": 0,
            "disk_read_failed": 0,
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

    def slots_moving(self) -> int:
        """Device slots a copy in flight reads: the tree's, but not evictable until it lands."""
        return sum(1 for op in self.pending.values() if op.src == STATE_DEVICE)

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
            "copies_in_flight": len(self.pending),
            **self.counters,
        }

    # ---- the request path ----------------------------------------------------------------------
    def accepts(self, key: bytes, depth: int, ancestor_depth: int) -> bool:
        """Whether `take` would keep a snapshot of `key` at `depth` (False, counted `declined`: one
        exists, or it is too close to its ancestor)."""
        if key in self.entries or depth - ancestor_depth < self.min_gap_tokens:
            self.counters["declined"] += 1
            return False
        return True

    def take(self, key: bytes, depth: int, ancestor_depth: int, slot: int) -> bool:
        """Keep a request's `slot` (its state after `depth` tokens) as the snapshot of `key`, and start
        its host copy. False: not kept (`accepts`); the caller still owns the slot."""
        if not self.accepts(key, depth, ancestor_depth):
            return False
        e = Snapshot(key, depth, ancestor_depth, last_use=next(self._clock))
        self.entries[key] = e
        e.slot = int(slot)
        self.used[DEVICE] += 1
        self.dirty.add(key)
        self.counters["taken"] += 1
        self._copy_down(e)
        return True

    def fetch(self, key: bytes) -> str | None:
        """Whether the snapshot of `key` can be restored now: READY (a slot or a DRAM copy), PENDING
        (its file is being read: this starts the read), None (no snapshot, or its file failed)."""
        self.poll()
        e = self.entries.get(key)
        if e is None:
            return None
        if e.slot is not None or e.host is not None or e.staged is not None:
            return READY
        if key not in self.pending:
            if not e.on_disk or self.dir is None:
                return None
            self._start(state_copy(key, STATE_DISK, STATE_HOST, self.size, "demand", path=self._path(key)))
        return PENDING

    def restore(self, key: bytes, dst_slot: int) -> str | None:
        """Copy the snapshot of `key` into the request's slot `dst_slot` (the tree's copy stays as it
        is). Returns the tier that served it, or None (no snapshot, or only on disk: `fetch` first)."""
        self.poll()
        e = self.entries.get(key)
        if e is None:
            return None
        if e.slot is not None:
            dev = self.pool_device()
            self.pool.copy_from(
                torch.tensor([e.slot], dtype=torch.int64, device=dev),
                torch.tensor([dst_slot], dtype=torch.int64, device=dev),
            )
            tier = DEVICE
        elif e.host is not None or e.staged is not None:
            self.state.write([dst_slot], e.host if e.host is not None else e.staged)  # type: ignore[arg-type]
            tier = DISK if e.from_disk else HOST
            e.from_disk = False
            e.staged = None
        else:
            return None
        e.reuse += 1
        e.last_use = next(self._clock)
        self.counters[f"restored_{tier}"] += 1
        return tier

    def evict_device(self, num: int) -> int:
        """Free `num` device slots (SGLang is short of mamba slots), copying nothing: the clean ones
        (their state landed below) first, then dirty ones (dropped), lowest priority first; a slot a
        copy still reads is not freed. Returns the slots freed."""
        self.poll()
        freed = 0
        while freed < num:
            victims = [e for e in self.entries.values() if e.slot is not None and not self._reads_slot(e)]
            if not victims:
                break
            clean = [e for e in victims if e.host is not None or e.on_disk]
            e = min(clean or victims, key=self._rank)
            self.counters["demoted_device" if clean else "dropped_device"] += 1
            self._drop_slot(e)
            freed += 1
        return freed

    def pump(self) -> None:
        """At a step boundary: apply the copies that landed, and start the host copies of the device
        snapshots still without one (those that found no host room when taken)."""
        self.poll()
        for key in sorted(self.dirty, key=lambda k: self._rank(self.entries[k]), reverse=True):
            e = self.entries[key]
            if key not in self.pending and not self._copy_down(e):
                break  # no room in the host share this step

    def poll(self) -> None:
        """Apply every snapshot copy that landed (or failed) since the last poll."""
        if not self.pending:
            return
        for key, op in list(self.pending.items()):
            if op.executed.is_set():
                del self.pending[key]
                self._land(self.entries.get(key), op)

    def reset(self) -> None:
        """SGLang's flush (after the transfer engine stopped: every copy ended): the device and host
        copies go (their slots back to the allocator); the disk files stay, for a restart."""
        self.poll()
        for op in self.pending.values():  # (none once the engine has stopped)
            op.cancelled = True
        self.pending.clear()
        self.reserved = {HOST: 0, DISK: 0}
        for e in list(self.entries.values()):
            if e.slot is not None:
                self._drop_slot(e)
            if e.host is not None:
                e.host = None
                self.used[HOST] -= 1
            e.staged = None
            self._forget_if_empty(e)

    # ---- copies --------------------------------------------------------------------------------
    def _start(self, op: StateCopy) -> None:
        self.pending[op.key] = op
        self.submit([op], op.kind)

    def _reads_slot(self, e: Snapshot) -> bool:
        op = self.pending.get(e.key)
        return op is not None and op.src == STATE_DEVICE

    def _copy_down(self, e: Snapshot) -> bool:
        """Start `e`'s device -> host copy when the host share has room (False: not now)."""
        if e.slot is None or e.host is not None or e.on_disk or e.key in self.pending:
            self.dirty.discard(e.key)
            return True
        if not self._host_room(e):
            return False
        self.reserved[HOST] += 1
        self._start(state_copy(e.key, STATE_DEVICE, STATE_HOST, self.size, "backup", source=e.slot))
        return True

    def _host_room(self, e: Snapshot, for_read: bool = False) -> bool:
        """Whether one more DRAM copy fits now. Makes room: drops the lowest-priority host copies that
        are on disk, and starts host -> disk writes of others (their room comes when they land)."""
        cap = self.host_bytes // self.size
        if cap == 0:
            return False
        over = self.used[HOST] + self.reserved[HOST] + 1 - cap
        if over <= 0:
            return True
        arriving = sum(1 for op in self.pending.values() if op.drop_host)
        victims = sorted(
            (
                x
                for x in self.entries.values()
                if x.host is not None and x is not e and x.key not in self.pending and not (x.from_disk and for_read)
            ),
            # a landed disk read waits for its restore: last (another read never takes its room), or its
            # request would read it again
            key=lambda x: (x.from_disk, self._rank(x)),
        )
        for v in victims:
            if over <= 0:
                break
            if v.on_disk:
                self._drop_host(v, "demoted_host")
                over -= 1
            elif arriving < over:
                if self._write(v):
                    arriving += 1
                else:  # no disk room: the copy is dropped
                    self._drop_host(v, "dropped_host")
                    over -= 1
        return over <= 0

    def _write(self, e: Snapshot) -> bool:
        """Start `e`'s host -> disk write (its DRAM copy goes once the file landed)."""
        if self.dir is None:
            return False
        while self.used[DISK] + self.reserved[DISK] + 1 > self.disk_bytes // self.size:
            victims = [x for x in self.entries.values() if x.on_disk and x is not e and x.key not in self.pending]
            if not victims:
                return False
            self._delete_file(min(victims, key=self._rank))
        self.reserved[DISK] += 1
        self._start(
            state_copy(
                e.key,
                STATE_HOST,
                STATE_DISK,
                self.size,
                "backup",
                payload=e.host,
                path=self._path(e.key),
                depth=e.depth,
                ancestor_depth=e.ancestor_depth,
                drop_host=True,
            )
        )
        return True

    def _land(self, e: Snapshot | None, op: StateCopy) -> None:
        """Record a finished copy (`poll`). A failure leaves the state where it was."""
        ok = op.error is None and not op.cancelled
        if op.src == STATE_DEVICE:
            self.reserved[HOST] -= 1
            if e is not None and ok and e.slot is not None and e.host is None:
                e.host = op.payload
                self.used[HOST] += 1
                self.dirty.discard(e.key)
                self.counters["host_copies"] += 1
            elif not ok:
                self.counters["demote_failed"] += 1
        elif op.dst == STATE_DISK:
            self.reserved[DISK] -= 1
            if not ok:
                logger.warning("sgl_hicache: cannot write the state snapshot %s: %s", op.path, op.error)
                self.counters["disk_write_failed"] += 1
            elif e is not None:
                e.on_disk = True
                self.used[DISK] += 1
                self.counters["disk_writes"] += 1
                if op.drop_host and e.host is not None:
                    self._drop_host(e, "demoted_host")
            else:  # forgotten meanwhile: its file is not indexed
                op.path.unlink(missing_ok=True)  # type: ignore[union-attr]
        elif e is not None and e.on_disk:  # a disk read
            if ok:
                self.counters["disk_reads"] += 1
                e.from_disk = True
                if e.host is None and self._host_room(e, for_read=True):
                    e.host = op.payload
                    self.used[HOST] += 1
                else:
                    e.staged = op.payload
            else:
                corrupt = isinstance(op.error, PageCorruptError)
                logger.warning("sgl_hicache: state snapshot %s not restored (%s): deleted", op.path, op.error)
                self.counters["disk_corrupt" if corrupt else "disk_read_failed"] += 1
                self._delete_file(e)

    # ---- tiers ---------------------------------------------------------------------------------
    def pool_device(self) -> torch.device:
        return self.pool.mamba_cache.temporal.device

    def _rank(self, e: Snapshot) -> tuple[float, int]:
        return priority(self.costs, Candidate(e.key, e.depth, e.ancestor_depth, e.reuse)), e.last_use

    def _drop_slot(self, e: Snapshot) -> None:
        assert e.slot is not None
        self.allocator.free(torch.tensor([e.slot], dtype=torch.int64, device=self.pool_device()))
        e.slot = None
        self.used[DEVICE] -= 1
        self.dirty.discard(e.key)
        self._forget_if_empty(e)

    def _drop_host(self, e: Snapshot, counter: str) -> None:
        e.host = None
        self.used[HOST] -= 1
        self.counters[counter] += 1
        self._forget_if_empty(e)

    def _forget_if_empty(self, e: Snapshot) -> None:
        if not e.held and e.key not in self.pending and self.entries.get(e.key) is e:
            del self.entries[e.key]

    def _path(self, key: bytes) -> Path:
        assert self.dir is not None
        return self.dir / (key.hex() + SUFFIX)

    def _delete_file(self, e: Snapshot) -> None:
        self._path(e.key).unlink(missing_ok=True)
        e.on_disk = False
        self.used[DISK] -= 1
        self.counters["disk_deleted"] += 1
        self._forget_if_empty(e)

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
                    head = decode_header(f.read(HEADER.size))
            except (ValueError, OSError):
                head = None
            if head is None or head[2] != self.size or self.bytes_in(DISK) + self.size > self.disk_bytes:
                Path(entry.path).unlink(missing_ok=True)
                continue
            self.entries[key] = Snapshot(key, int(head[0]), int(head[1]), on_disk=True)
            self.used[DISK] += 1
            self.counters["disk_found_at_start"] += 1


__all__ = [
    "DEVICE",
    "DISK",
    "HOST",
    "PENDING",
    "READY",
    "SUBDIR",
    "SUFFIX",
    "Snapshot",
    "SnapshotTiers",
    "decode_header",
    "encode_file",
]
