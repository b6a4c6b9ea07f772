"""A transfer as plain data: one node's pages moving between two tiers.

The cache plans ops (`TieredCache.prepare`), executors move their bytes (`transfer/`), and the cache
records the outcome (`TieredCache.complete`). Kept apart from `cache.py` so that the byte movers need
not import the cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..tiers.base import DEVICE, DISK, HOST, Handle, PageCorruptError

if TYPE_CHECKING:
    from ..tree.node import TreeNode

LINKS: dict[tuple[str, str], str] = {
    (DEVICE, HOST): "device->host",
    (HOST, DEVICE): "host->device",
    (HOST, DISK): "host->disk",
    (DISK, HOST): "disk->host",
}


_DONE_LOCK = threading.Lock()  # makes a `DoneFlag`'s event at most once


class DoneFlag:
    """`threading.Event`'s `set` / `is_set` / `wait`, with the event (a Condition and a lock) made
    only when somebody waits. Most ops are never waited for (the replay's virtual executor, the
    scheduler's polls), and making an Event per op was ~5 % of a long replay.

    Contract: `set` is final (there is no `clear`); `wait` returns True once `set` was called, from
    any thread, whether it came before or during the wait."""

    __slots__ = ("_flag", "_event")

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        with _DONE_LOCK:
            if self._event is None:
                self._event = threading.Event()
        if self._flag:  # a `set` between the first look and the event's birth did not see the event
            self._event.set()
        return self._event.wait(timeout)


@dataclass(eq=False)
class TransferOp:
    """One node's pages moving from tier `src` to tier `dst` (see the module docstring).

    `executed` is set when the bytes have been copied (or the copy failed, see `error`);
    `applied` once the cache has recorded the outcome in the tree.
    """

    node: TreeNode
    src: str
    dst: str
    src_handles: list[Handle]
    dst_handles: list[Handle]
    nbytes: int
    kind: str  # "demand" | "prefetch" | "predict" | "promote" | "demote" | "backup"
    error: BaseException | None = None
    seconds: float = 0.0
    executed: DoneFlag = field(default_factory=DoneFlag)
    applied: bool = False
    cancelled: bool = False
    submitted: bool = False  # handed to a transfer engine, which will set `executed`
    # tensor parallelism: a gated op's outcome counts only once every rank agreed on it
    # (`sglang/rank_consensus.py` sets `agreed`, and the error every rank records)
    gated: bool = False
    agreed: bool = False
    # a gated copy into a tier every rank shares (one host buffer, one directory: `tiers/replicated.py`):
    # its destination pages may be freed, even when cancelled, only once every rank has stopped moving
    # its bytes, i.e. once agreed (a rank freeing them earlier could hand the slots to another page)
    shared_dst: bool = False
    locks_path: bool = False  # a background write-back: the node's path is locked until `complete`
    # pages found corrupt while copying: chunks of one op run on several workers, and each may meet one
    corrupt_pages: int = 0

    def record_error(self, exc: BaseException) -> None:
        """Note a failed copy (of the whole op or of one chunk): the first error is the op's outcome,
        and every corrupt page is counted. Callers serialise calls for one op."""
        if isinstance(exc, PageCorruptError):
            self.corrupt_pages += 1
        if self.error is None:
            self.error = exc

    @property
    def source_lost(self) -> bool:
        """The copy failed because a source page is gone for good (corrupt, not stored, removed by
        another process or on another rank), not for an I/O error that may pass."""
        err = self.error
        return err is not None and (
            self.corrupt_pages > 0
            or isinstance(err, (PageCorruptError, KeyError))
            or bool(getattr(err, "page_gone", False))
        )

    @property
    def settled(self) -> bool:
        """Its outcome may be recorded: the bytes are copied (or it failed) and, if gated, every rank
        agreed on that. A cancel is decided alike on every rank, so a cancelled op settles locally,
        unless its destination is shared by the ranks (`shared_dst`: then only once agreed)."""
        return self.executed.is_set() and (not self.gated or self.agreed or (self.cancelled and not self.shared_dst))

    @property
    def stopped(self) -> bool:
        """Its bytes stopped moving wherever they land: executed here and, for a `shared_dst` op, on
        every rank (agreed). Only then may its destination pages be freed."""
        return self.executed.is_set() and (not self.shared_dst or self.agreed)

    @property
    def link(self) -> str:
        """The link's name (`LINKS`), or "src->dst" for a mover registered beside the KV links."""
        return LINKS.get((self.src, self.dst)) or f"{self.src}->{self.dst}"


class Cancelled(Exception):
    """A transfer was cancelled before its bytes were used (not an I/O error)."""


@dataclass(eq=False)
class NodeStage:
    """The ops that bring one node of a promotion up (disk->host then host->device, or just
    host->device), or, when another job is already bringing the node up, that job's op to wait for."""

    node: TreeNode
    ops: list[TransferOp]
    waits_for: TransferOp | None = None


@dataclass(eq=False)
class PromotionJob:
    """An asynchronous promotion of a matched path to the device tier, root first.

    Made by `TieredCache.plan_promotion` (destinations allocated, path locked), executed by anyone
    (the transfer engine's workers, or inline), advanced by `TieredCache.advance` which applies the
    stages in path order (device residency stays prefix-closed), and ended by `release`.
    """

    kind: str
    anchor: TreeNode
    stages: list[NodeStage]
    page_size: int
    target: str = DEVICE
    applied: int = 0
    failed: bool = False
    released: bool = False

    @property
    def finished(self) -> bool:
        return self.failed or self.applied == len(self.stages)

    def ops(self) -> list[TransferOp]:
        return [op for st in self.stages for op in st.ops]

    def runnable(self) -> list[TransferOp]:
        """Ops whose predecessor in their stage has executed and that have not executed themselves."""
        out = []
        for st in self.stages:
            for i, op in enumerate(st.ops):
                if not op.executed.is_set() and (i == 0 or st.ops[i - 1].executed.is_set()):
                    out.append(op)
        return out

    @property
    def tokens(self) -> int:
        return sum(st.node.num_pages for st in self.stages) * self.page_size

    def remaining_bytes(self) -> dict[str, int]:
        """Bytes still to copy, per link."""
        out: dict[str, int] = {}
        for op in self.ops():
            if not op.executed.is_set():
                out[op.link] = out.get(op.link, 0) + op.nbytes
        return out
