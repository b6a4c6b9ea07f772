"""One copy of the KV for a TP group whose ranks hold the same KV (MLA at --tp > 1), without SGLang:
the shared host buffer, lowest-first slots, the follower's disk index and its byte movers
(`tiers/replicated.py`, `transfer/handlers.follower_handlers`). The real two-rank server runs in
`tests/server/test_sglang_e2e_mla.py::test_mla_tp2_one_rank_writes_both_read`."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import DEVICE, DISK, HOST, SlotAllocator, TierIOError
from sgl_hicache.tiers.disk import DiskPageStore
from sgl_hicache.tiers.memory import DeviceKVPool
from sgl_hicache.tiers.replicated import (
    LowestFirstSlots,
    MirrorDiskStore,
    SharedHostBuffer,
    new_shared_file,
    unlink_shared_file,
)
from sgl_hicache.transfer.handlers import default_handlers, execute, follower_handlers
from sgl_hicache.transfer.ops import TransferOp

# MLA-shaped: one plane (latent + rope), one "head"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=24, dtype="bfloat16", kv_planes=1)
PAGE = 4
NS = Namespace.for_model(LAYOUT, PAGE)


def _frees_then_allocate(alloc: SlotAllocator, order: list[int]) -> list[int]:
    got = alloc.allocate(6)
    alloc.free([got[i] for i in order])
    return alloc.allocate(3)


def test_lowest_first_slots_do_not_depend_on_the_order_of_frees():
    a = _frees_then_allocate(LowestFirstSlots(8), [0, 2, 4])
    b = _frees_then_allocate(LowestFirstSlots(8), [4, 0, 2])
    assert list(a) == list(b) == [0, 2, 4]
    # the plain free list hands out what was freed last first: another order, other slots
    assert _frees_then_allocate(SlotAllocator(8), [0, 2, 4]) != _frees_then_allocate(SlotAllocator(8), [4, 0, 2])
    with pytest.raises(KeyError):
        LowestFirstSlots(4).free([1])


def test_shared_host_buffer_is_one_memory_for_every_mapping(tmp_path):
    nbytes = 8 * PAGE * LAYOUT.bytes_per_token
    path = new_shared_file(nbytes)
    try:
        leader = SharedHostBuffer(LAYOUT, PAGE, 8, path)
        follower = SharedHostBuffer(LAYOUT, PAGE, 8, path)
    finally:
        unlink_shared_file(path)
    assert not path.exists()  # the mappings outlive the name
    data = torch.randn((2, *leader.page_shape)).to(torch.bfloat16)
    slots = leader.allocate([b"a", b"b"])
    assert follower.allocate([b"a", b"b"]) == slots
    leader.write(slots, data)
    assert torch.equal(follower.read(slots).view(torch.int16), data.view(torch.int16))
    (tmp_path / "short").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="bytes, expected"):
        SharedHostBuffer(LAYOUT, PAGE, 8, tmp_path / "short")


def test_a_shared_buffer_larger_than_the_room_in_dev_shm_fails_at_start_naming_both(tmp_path):
    small = tmp_path / "small"  # a tmpfs of 1 MiB would need root: a file system's free room is read the same way
    small.mkdir()
    free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
    with pytest.raises(TierIOError, match=r"needs .* GiB in .*small, which has .* GiB free; .*--shm-size"):
        new_shared_file(free + (1 << 30), directory=small)
    assert not list(small.iterdir())
    path = new_shared_file(1 << 20, directory=small)
    assert path.stat().st_size == 1 << 20 and path.stat().st_blocks * 512 >= 1 << 20  # reserved, not sparse
    unlink_shared_file(path)


class Rank:
    """One rank's stores and movers, over the group's shared host file and disk directory."""

    def __init__(self, leader: bool, host_file, disk_dir, device_bytes: torch.Tensor) -> None:
        self.device = DeviceKVPool(LAYOUT, PAGE, 8, device="cpu")
        self.device.kv.copy_(device_bytes)
        self.host = SharedHostBuffer(LAYOUT, PAGE, 8, host_file)
        self.disk = DiskPageStore(LAYOUT, PAGE, 16, disk_dir, NS) if leader else MirrorDiskStore(LAYOUT, PAGE, 16)
        self.stores = {DEVICE: self.device, HOST: self.host, DISK: self.disk}
        self.skipped: dict[str, int] = {}
        handlers = default_handlers(self.stores)
        self.handlers = handlers if leader else follower_handlers(handlers, self.stores, self.skipped)

    def op(self, src: str, dst: str, src_h, dst_h, gated: bool = True) -> TransferOp:
        op = TransferOp(None, src, dst, list(src_h), list(dst_h), 0, "backup", gated=gated)  # type: ignore[arg-type]
        execute(op, self.handlers)
        return op


@pytest.fixture
def group(tmp_path):
    path = new_shared_file(8 * PAGE * LAYOUT.bytes_per_token)
    kv = torch.randn((LAYOUT.num_layers, 1, 8 * PAGE, 1, LAYOUT.head_dim)).to(torch.bfloat16)
    try:
        ranks = Rank(True, path, tmp_path / "disk", kv), Rank(False, path, tmp_path / "disk", kv)
    finally:
        unlink_shared_file(path)
    yield ranks
    ranks[0].disk.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_follower_leaves_every_gated_write_to_the_leader_and_reads_the_shared_copy(group, tmp_path):
    leader, follower = group
    keys = [page_key(NS.root, [i] * PAGE) for i in range(3)]
    dev = [1, 4, 6]
    slots = leader.host.allocate(keys)
    assert follower.host.allocate(keys) == slots
    # device -> host (a background write-through): the follower copies nothing, the leader fills the slots
    assert follower.op(DEVICE, HOST, dev, slots).error is None
    assert follower.skipped == {"device->host": 3}
    assert not _bits(follower.host.read(slots)).any()
    assert leader.op(DEVICE, HOST, dev, slots).error is None
    assert torch.equal(_bits(follower.host.read(slots)), _bits(leader.device.read(dev)))
    # host -> disk: the leader writes the files, the follower only indexes the keys
    assert leader.disk.allocate(keys) == follower.disk.allocate(keys) == keys
    assert follower.op(HOST, DISK, slots, keys).error is None
    assert all(follower.disk.contains(k) for k in keys) and not list((tmp_path / "disk").rglob("*.page"))
    assert leader.op(HOST, DISK, slots, keys).error is None
    assert len(list((tmp_path / "disk").rglob("*.page"))) == 3
    # disk -> host into fresh slots: only the leader reads the files
    leader.host.free(slots)
    follower.host.free(slots)
    again = leader.host.allocate(keys)
    assert follower.host.allocate(keys) == again
    leader.host.buffer.zero_()
    assert follower.op(DISK, HOST, keys, again).error is None and follower.skipped["disk->host"] == 3
    assert leader.op(DISK, HOST, keys, again).error is None
    # host -> device on the follower: its own device pages, from the leader's bytes
    follower.device.kv.zero_()
    assert follower.op(HOST, DEVICE, again, dev, gated=False).error is None
    assert torch.equal(_bits(follower.device.read(dev)), _bits(leader.device.read(dev)))
    # inline copies are not agreed: device -> host is made by the follower itself, disk -> host cannot be
    follower.host.buffer.zero_()
    assert follower.op(DEVICE, HOST, dev, again, gated=False).error is None
    assert torch.equal(_bits(leader.host.read(again)), _bits(leader.device.read(dev)))
    err = follower.op(DISK, HOST, keys, again, gated=False).error
    assert isinstance(err, TierIOError) and "only the leader" in str(err)


def test_mirror_disk_store_adopts_the_leaders_pages_beyond_capacity():
    mirror = MirrorDiskStore(LAYOUT, PAGE, 2)
    keys = [page_key(NS.root, [i] * PAGE) for i in range(3)]
    assert mirror.adopt(keys) == 3 and mirror.adopt(keys[:1]) == 0
    assert sorted(mirror.keys()) == sorted(keys) and all(map(mirror.contains, keys))
    new = page_key(NS.root, [9] * PAGE)
    assert mirror.overfull_pages == 1 and mirror.free_pages == 0 and mirror.allocate([new]) is None
    mirror.free(keys[:2])
    assert mirror.overfull_pages == 0 and mirror.free_pages == 1
