"""The tiers of a tensor-parallel group whose ranks hold the same KV (MLA's latent): one copy for all.

Every rank of such a group runs the same tree and takes the same decisions (`sglang/rank_consensus.py`),
but only the *leader* (rank 0) moves bytes into the host and disk tiers; the *followers* read:

- `SharedHostBuffer`: the host tier as ONE buffer in shared memory, mapped by every rank, so the host
  budget is the group's, not multiplied by the TP size. Its slots are allocated lowest first
  (`LowestFirstSlots`): equal trees free and allocate the same pages, in whatever order a step's
  frees come, so a handle names the same slot on every rank.
- `MirrorDiskStore`: a follower's disk tier, an index of the page keys the leader's files hold (no
  file is read, written or deleted here), kept equal to the leader's by the same decisions.

Which copies a follower skips is the byte mover's business (`transfer/handlers.follower_handlers`).
"""

from __future__ import annotations

import heapq
import os
import secrets
import tempfile
from array import array
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ..config import KVLayout
from ..hashing import PageKey
from .base import SlotAllocator, TierIOError, page_shape
from .memory import HostKVBuffer
from .metadata import _STORED, MetadataDiskStore


class LowestFirstSlots(SlotAllocator):
    """A `SlotAllocator` that hands out the lowest free slots, so the slots given depend only on the set
    of free slots, not on the order earlier frees came in. Contract: `SlotAllocator`'s."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._free = list(range(capacity))  # a heap

    @property
    def free_count(self) -> int:
        return len(self._free)

    def _free_slots(self) -> list[int]:
        return self._free

    def _take(self, n: int) -> array:
        return array("q", [heapq.heappop(self._free) for _ in range(n)])

    def _give(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            heapq.heappush(self._free, s)


def shared_memory_dir() -> Path:
    """Where the shared host buffer's file is made: /dev/shm when there is one, else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def new_shared_file(nbytes: int, directory: Path | None = None) -> Path:
    """Create a file of `nbytes` to map as the shared host buffer, its memory reserved now (a tmpfs
    that runs out later would kill the server with SIGBUS on a write); the caller unlinks it once
    every rank has mapped it (`unlink_shared_file`). TierIOError, naming the sizes and what to do,
    when the directory (/dev/shm) has not that much room."""
    where = directory or shared_memory_dir()
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise TierIOError(_no_room(nbytes, free, where))
    path = where / f"sgl_hicache-host-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise TierIOError(_no_room(nbytes, free, where) + f" ({exc})") from exc
    finally:
        os.close(fd)
    return path


def _no_room(nbytes: int, free: int, where: Path) -> str:
    gib = 1 << 30
    return (
        f"host tier: the host buffer shared by the TP ranks needs {nbytes / gib:.2f} GiB in {where}, which has "
        f"{free / gib:.2f} GiB free; give it more room (a container's --shm-size) or lower host_tokens / host_ratio"
    )


def unlink_shared_file(path: str | os.PathLike[str]) -> None:
    """Remove the name of the shared file (the mappings stay valid; the memory goes with the last one)."""
    Path(path).unlink(missing_ok=True)


class SharedHostBuffer(HostKVBuffer):
    """The host tier of a replicated TP group: `HostKVBuffer` over a file mapped shared by every rank
    (see the module docstring). Contract: `HostKVBuffer`'s, with `LowestFirstSlots` allocation; the
    bytes a rank writes are visible to every rank that mapped the file. Unpinned (on CUDA its memory
    is registered with the driver where that works, so host -> device copies can be asynchronous)."""

    def __init__(self, layout: KVLayout, page_size: int, capacity_pages: int, path: str | os.PathLike[str]) -> None:
        shape = (capacity_pages, *page_shape(layout, page_size))
        nbytes = capacity_pages * page_size * layout.bytes_per_token
        if os.path.getsize(path) != nbytes:
            raise ValueError(f"host: shared buffer file {path} has {os.path.getsize(path)} bytes, expected {nbytes}")
        raw = (
            torch.from_file(os.fspath(path), shared=True, size=nbytes, dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )  # (an empty file cannot be mapped)
        buffer = raw.view(layout.torch_dtype).view(shape)
        pinned = _register_with_cuda(buffer)
        super().__init__(layout, page_size, capacity_pages, pin_memory=pinned, buffer=buffer)
        self._slots = LowestFirstSlots(capacity_pages)
        self.path = Path(path)


def _register_with_cuda(buffer: torch.Tensor) -> bool:
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    except (RuntimeError, AttributeError):
        return False
    return int(getattr(err, "value", err)) == 0


class MirrorDiskStore(MetadataDiskStore):
    """A follower's disk tier: the leader's page keys without their files (see the module docstring).
    Contract: `MetadataDiskStore`'s; `adopt(keys)` indexes pages the leader held at start (a restart),
    beyond capacity if need be (`overfull_pages` then says how many must go, as the leader's store does)."""

    def adopt(self, keys: Iterable[PageKey]) -> int:
        n = 0
        for k in keys:
            if k not in self._index:
                self._index[k] = _STORED
                n += 1
        return n

    @property
    def overfull_pages(self) -> int:  # type: ignore[override]
        return max(0, len(self._index) - self.capacity_pages)

    @property
    def free_pages(self) -> int:
        return max(0, self.capacity_pages - len(self._index))


__all__ = [
    "LowestFirstSlots",
    "MirrorDiskStore",
    "SharedHostBuffer",
    "new_shared_file",
    "shared_memory_dir",
    "unlink_shared_file",
]
