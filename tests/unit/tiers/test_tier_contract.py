"""One contract, every store: the TierStore protocol checked over device, host and disk stores and
the shared store tier on both of its backends (a real Mooncake Store and a real redis-server,
started once per session by the fixtures in conftest.py).

A new store joins by adding one entry to STORES; every test below then runs against it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import TIERS, RepeatCheck, SlotAllocator, TierStore, page_shape
from sgl_hicache.tiers.disk import DiskPageStore
from sgl_hicache.tiers.memory import DeviceKVPool, HostKVBuffer
from sgl_hicache.tiers.replicated import SharedHostBuffer
from sgl_hicache.tiers.shared_store import STORE, SharedStoreTier
from sgl_hicache.tiers.store_backends import open_backend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 4
NS = Namespace.for_model(LAYOUT, PAGE)


def _device(capacity: int, tmp_path) -> TierStore:
    return DeviceKVPool(LAYOUT, PAGE, capacity, device="cpu")


def _host(capacity: int, tmp_path) -> TierStore:
    return HostKVBuffer(LAYOUT, PAGE, capacity, pin_memory=False)


def _host_shared(capacity: int, tmp_path) -> TierStore:
    path = tmp_path / f"host-shared-{next(_SALTS)}"  # (the shared-memory file, here under the test's temp dir)
    path.write_bytes(bytes(capacity * PAGE * LAYOUT.bytes_per_token))
    return SharedHostBuffer(LAYOUT, PAGE, capacity, path)


def _disk(capacity: int, tmp_path) -> TierStore:
    return DiskPageStore(LAYOUT, PAGE, capacity, tmp_path / "disk", NS)


def _shared(service: str):
    def make(capacity: int, tmp_path, request) -> TierStore:
        url = request.getfixturevalue(service).url
        ns = Namespace.for_model(LAYOUT, PAGE, tenant_salt=f"contract-{next(_SALTS)}")  # a cold key space per store
        store = SharedStoreTier(LAYOUT, PAGE, capacity, open_backend(url), ns)
        request.addfinalizer(store.close)
        return store

    return make


_SALTS = itertools.count()
STORES = {
    "device": _device,
    "host": _host,
    "host-shared": _host_shared,
    "disk": _disk,
    "store-mooncake": _shared("mooncake_service"),
    "store-redis": _shared("redis_service"),
}


class Harness:
    def __init__(self, factory, tmp_path, request) -> None:
        self._factory = factory
        self._tmp_path = tmp_path
        self._request = request
        self._counter = itertools.count()

    def store(self, capacity: int) -> TierStore:
        if self._factory in (_device, _host, _host_shared, _disk):
            return self._factory(capacity, self._tmp_path)
        return self._factory(capacity, self._tmp_path, self._request)

    def keys(self, n: int) -> list[bytes]:
        """Fresh, distinct page keys (as the cache would compute them)."""
        return [page_key(NS.root, [next(self._counter)] * PAGE) for _ in range(n)]

    @staticmethod
    def never_allocated(store: TierStore, fresh_key: bytes):
        return fresh_key if store.content_addressed else store.capacity_pages + 7


@pytest.fixture(params=sorted(STORES))
def h(request, tmp_path) -> Harness:
    return Harness(STORES[request.param], tmp_path, request)


def _pages(store: TierStore, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *store.page_shape), generator=g).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _check_accounting(store: TierStore) -> None:
    assert store.free_pages + store.used_pages == store.capacity_pages
    assert 0 <= store.free_pages <= store.capacity_pages


def test_identity(h: Harness) -> None:
    s = h.store(2)
    assert s.name in (*TIERS, STORE)
    assert s.page_shape == page_shape(LAYOUT, PAGE)
    assert s.page_bytes == PAGE * LAYOUT.bytes_per_token
    assert isinstance(s.persistent, bool) and isinstance(s.content_addressed, bool)


def test_allocate_all_or_nothing(h: Harness) -> None:
    s = h.store(4)
    a = s.allocate(h.keys(3))
    assert a is not None and len(a) == 3 and len(set(a)) == 3
    assert s.free_pages == 1 and s.used_pages == 3
    assert s.allocate(h.keys(2)) is None
    assert s.free_pages == 1  # nothing reserved by the failed call
    b = s.allocate(h.keys(1))
    assert b is not None and len(b) == 1 and b[0] not in a
    assert s.free_pages == 0
    assert s.allocate(h.keys(1)) is None
    assert list(s.allocate([])) == []  # (a slot store answers an int64 array)
    _check_accounting(s)


def test_free_used_accounting(h: Harness) -> None:
    s = h.store(5)
    _check_accounting(s)
    assert s.free_pages == 5 and s.used_pages == 0
    a = s.allocate(h.keys(2))
    b = s.allocate(h.keys(3))
    assert a is not None and b is not None
    _check_accounting(s)
    s.write(a, _pages(s, 2, 1))  # written pages count as used too
    s.free(a)
    assert s.free_pages == 2
    _check_accounting(s)
    s.free(b)
    assert s.free_pages == 5 and s.used_pages == 0
    c = s.allocate(h.keys(5))  # freed pages are reusable
    assert c is not None
    _check_accounting(s)


def test_free_unknown_handle_raises_keyerror(h: Harness) -> None:
    s = h.store(3)
    with pytest.raises(KeyError):
        s.free([h.never_allocated(s, h.keys(1)[0])])
    a = s.allocate(h.keys(2))
    s.free(a[:1])
    with pytest.raises(KeyError):  # double free
        s.free(a[:1])
    with pytest.raises(KeyError):  # a batch with one bad handle frees nothing
        s.free([a[1], a[0]])
    assert s.free_pages == 2
    s.free(a[1:])
    assert s.free_pages == 3
    _check_accounting(s)


def test_round_trip_bit_exact_bfloat16(h: Harness) -> None:
    s = h.store(6)
    a = s.allocate(h.keys(4))
    data = _pages(s, 4, 7)
    s.write(a, data)
    out = s.read(a)
    assert out.dtype == torch.bfloat16
    assert tuple(out.shape) == (4, *s.page_shape)
    assert torch.equal(_bits(out.cpu()), _bits(data))
    # any order, any subset
    sub = [a[3], a[0]]
    assert torch.equal(_bits(s.read(sub).cpu()), _bits(data[[3, 0]]))
    # writing one page leaves the others alone
    other = _pages(s, 1, 8)
    s.write(a[1:2], other)
    out = s.read(a).cpu()
    assert torch.equal(_bits(out[1:2]), _bits(other))
    assert torch.equal(_bits(out[[0, 2, 3]]), _bits(data[[0, 2, 3]]))


def test_special_values_survive(h: Harness) -> None:
    s = h.store(1)
    a = s.allocate(h.keys(1))
    data = _pages(s, 1, 3)
    flat = data.view(-1)
    flat[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")], dtype=torch.bfloat16)
    s.write(a, data)
    assert torch.equal(_bits(s.read(a).cpu()), _bits(data))


@pytest.mark.parametrize("bad", ["fewer_pages", "more_pages", "wrong_tokens", "flat"])
def test_shape_mismatch_raises_valueerror(h: Harness, bad: str) -> None:
    s = h.store(2)
    a = s.allocate(h.keys(2))
    shape = {
        "fewer_pages": (1, *s.page_shape),
        "more_pages": (3, *s.page_shape),
        "wrong_tokens": (2, *s.page_shape[:2], PAGE + 1, *s.page_shape[3:]),
        "flat": (2, s.page_bytes // 2),
    }[bad]
    with pytest.raises(ValueError):
        s.write(a, torch.zeros(shape, dtype=torch.bfloat16))


def test_capacity_zero(h: Harness) -> None:
    s = h.store(0)
    assert s.capacity_pages == 0 and s.free_pages == 0 and s.used_pages == 0
    assert s.allocate(h.keys(1)) is None
    assert list(s.allocate([])) == []  # (a slot store answers an int64 array)
    s.write([], torch.zeros((0, *s.page_shape), dtype=torch.bfloat16))
    out = s.read([])
    assert tuple(out.shape) == (0, *s.page_shape)
    s.free([])
    _check_accounting(s)


def test_negative_capacity_rejected(h: Harness) -> None:
    with pytest.raises(ValueError):
        h.store(-1)


# every batch "large" (checked by a count); small ones (a set); at 20,000 also a 40-slot one (`RepeatCheck`)
@pytest.mark.parametrize("capacity", [8, 4096, 20000])
def test_slot_allocator_refuses_bad_frees_whole_and_keeps_its_books(capacity: int) -> None:
    a = SlotAllocator(capacity)
    slots = a.allocate(capacity)
    assert sorted(slots) == list(range(capacity))
    a.free(slots[:2])
    bad_batches = [
        [slots[2], slots[3], slots[2]],  # the same slot twice
        *([list(slots[10:50]) + [slots[30]]] if capacity > 50 else []),  # twice, in a batch of 41
        [slots[3], slots[0]],  # one already free
        [slots[4], capacity],  # out of range
        [slots[4], -1],  # negative
        [slots[4], "x"],  # not an int
    ]
    for bad in bad_batches:
        with pytest.raises(KeyError):
            a.free(bad)
        with pytest.raises(KeyError):
            a.free_runs([slots[5:7], bad])
        assert a.free_count == 2  # nothing of a refused batch was freed
        assert a.is_allocated(slots[3]) and a.is_allocated(slots[5]) and not a.is_allocated(slots[0])
    a.free_runs([slots[2:4], list(slots[4:])])  # every other slot, a list run among them
    assert a.free_count == capacity
    with pytest.raises(KeyError):
        a.free(slots[2:3])  # freed twice
    again = a.allocate(capacity)
    assert list(again[:3]) == [slots[-1], slots[-2], slots[-3]]  # the last freed go first
    assert sorted(again) == list(range(capacity))


def test_repeat_check_agrees_with_a_sort_across_batches_that_reuse_its_scratch() -> None:
    """The O(n) repeat check: a batch repeats a page exactly when a sort finds two equal neighbours,
    on batches above a set's size, as an int64 array or a numpy one, call after call on one scratch
    (a page in two batches is no repeat); pages outside its pool fall back to the sort."""
    import random
    from array import array

    import numpy as np

    rng = random.Random(5)
    check = RepeatCheck(5000)
    repeats = 0
    for _ in range(300):
        n = rng.randint(RepeatCheck.SMALL + 1, 3000)
        batch = rng.sample(range(5000), n)
        if rng.random() < 0.5:
            batch[rng.randrange(n)] = batch[rng.randrange(n)]
        ordered = sorted(batch)
        expected = any(x == y for x, y in zip(ordered, ordered[1:]))
        repeats += expected
        assert check(array("q", batch)) is expected
        assert check(np.array(batch, dtype=np.int64)) is expected
    assert 100 < repeats < 200  # both answers were asked for
    assert check(array("q", [5000, 5001, *range(40)])) is False
    assert check(array("q", [-1, -1, *range(40)])) is True
    assert check(array("q", [-(2**63), -1, *range(40)])) is False  # negative ids, none repeated
