"""Quantised and MLA-shaped pages in the core tiers (no sglang): fp8 pages move host <-> disk bit for
bit; the page header names the dtype, and a page whose header names another dtype is a miss,
counted (`dtype_mismatch`), never served, on the disk tier (at start and on read) and in a shared
store's codec. fp8 e4m3 and e5m2 pages have the same shape and length, so only the dtype tells them apart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import PageCorruptError
from sgl_hicache.tiers.codec import DTYPE_MISMATCH, PageCodec
from sgl_hicache.tiers.disk import DiskPageStore
from sgl_hicache.tiers.memory import INDEX_COPY_BELOW_BYTES, HostKVBuffer

PAGE = 4
E4M3 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float8_e4m3fn")
E5M2 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float8_e5m2")
MLA = KVLayout(num_layers=2, num_kv_heads=1, head_dim=40, dtype="bfloat16", kv_planes=1)
# one namespace for both dtypes: what a page file of another dtype under our own key looks like
# (a namespace built from the layout differs by dtype, so a real server never even asks for it)
SHARED_NS = Namespace.for_model(E4M3, PAGE)


def _keys(n: int) -> list[bytes]:
    return [page_key(SHARED_NS.root, [i] * PAGE) for i in range(n)]


def _random_pages(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
    shape = (n, layout.num_layers, layout.kv_planes, PAGE, layout.num_kv_heads, layout.head_dim)
    g = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=layout.torch_dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * elem), generator=g, dtype=torch.uint8)
    return raw.view(layout.torch_dtype)  # every bit pattern, NaNs included


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _written(directory: Path, layout: KVLayout, n: int, seed: int = 0):
    store = DiskPageStore(layout, PAGE, 16, directory, SHARED_NS)
    keys = _keys(n)
    assert store.allocate(keys) == keys
    data = _random_pages(layout, n, seed)
    store.write(keys, data)
    return store, keys, data


@pytest.mark.parametrize("layout", [E4M3, E5M2, MLA], ids=["fp8_e4m3", "fp8_e5m2", "mla"])
def test_pages_move_host_disk_host_bit_for_bit(tmp_path, layout):
    host = HostKVBuffer(layout, PAGE, 8, pin_memory=False)
    assert host.page_shape[1] == layout.kv_planes
    data = _random_pages(layout, 3, seed=5)
    slots = host.allocate(_keys(3))
    host.write(slots, data)
    disk = DiskPageStore(layout, PAGE, 16, tmp_path, Namespace.for_model(layout, PAGE))
    keys = _keys(3)
    disk.allocate(keys)
    disk.write_from(keys, [host.page_view(s) for s in slots])
    disk.close()
    again = DiskPageStore(layout, PAGE, 16, tmp_path, Namespace.for_model(layout, PAGE))  # a restart
    back = host.allocate(keys)
    for k, s in zip(keys, back):
        again.read_into(k, host.page_view(s))
    assert torch.equal(_raw(host.read(back)), _raw(data))
    again.close()


def test_namespace_names_dtype_and_planes_and_keeps_kv_layouts_keys():
    assert Namespace.for_model(E4M3, PAGE).root != Namespace.for_model(E5M2, PAGE).root
    mla2 = KVLayout(num_layers=2, num_kv_heads=1, head_dim=40, dtype="bfloat16", kv_planes=2)
    assert Namespace.for_model(MLA, PAGE).root != Namespace.for_model(mla2, PAGE).root
    assert "planes" not in Namespace.for_model(mla2, PAGE).description  # K/V layouts: keys as before
    assert MLA.bytes_per_token * 2 == mla2.bytes_per_token


def test_a_page_of_another_dtype_found_at_start_is_a_counted_miss(tmp_path):
    writer, keys, _ = _written(tmp_path, E5M2, 3)
    writer.close()
    reader = DiskPageStore(E4M3, PAGE, 16, tmp_path, SHARED_NS)
    assert not any(reader.contains(k) for k in keys)
    assert reader.counters["dtype_mismatch"] == 3 and reader.counters["corrupt_removed"] == 3
    assert reader.counters["pages_restored"] == 0
    reader.close()


def test_a_page_replaced_by_another_dtype_after_indexing_is_never_served(tmp_path):
    reader, keys, data = _written(tmp_path / "ours", E4M3, 2, seed=1)
    other, other_keys, _ = _written(tmp_path / "theirs", E5M2, 2, seed=2)
    assert other_keys == keys
    shutil.copyfile(other.page_path(keys[0]), reader.page_path(keys[0]))  # same size, same key, other dtype
    out = torch.empty(reader.page_shape, dtype=reader.dtype)
    with pytest.raises(PageCorruptError, match=DTYPE_MISMATCH):
        reader.read_into(keys[0], out)
    assert reader.counters["dtype_mismatch"] == 1 and not reader.contains(keys[0])
    reader.read_into(keys[1], out)  # the page of our dtype is still served
    assert torch.equal(_raw(out), _raw(data[1]))
    reader.close()
    other.close()


def test_the_shared_store_codec_names_the_dtype():
    shape = (2, 2, PAGE, 2, 8)
    nbytes = 2 * 2 * PAGE * 2 * 8
    e4m3 = PageCodec(SHARED_NS, shape, "float8_e4m3fn", nbytes, "store")
    e5m2 = PageCodec(SHARED_NS, shape, "float8_e5m2", nbytes, "store")
    key = _keys(1)[0]
    value = e5m2.encode(key, bytes(range(256)) * (nbytes // 256))
    assert e5m2.decode(value, key)[0] is not None
    payload, reason = e4m3.decode(value, key)
    assert payload is None and reason == DTYPE_MISMATCH


BIG_BF16 = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB pages
BIG_E4M3 = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float8_e4m3fn")


@pytest.mark.parametrize(
    "layout", [E4M3, MLA, BIG_BF16, BIG_E4M3], ids=["small_fp8", "small_mla", "large_bf16", "large_fp8"]
)
def test_host_write_puts_every_page_where_its_handle_says(layout):
    """Small pages are written in one call, large ones page by page: both land each page at its own
    slot, bit for bit, and leave the other slots untouched."""
    host = HostKVBuffer(layout, PAGE, 8, pin_memory=False)
    assert (host.page_bytes < INDEX_COPY_BELOW_BYTES) == (layout in (E4M3, MLA))
    before = _raw(host.buffer.clone())
    data = _random_pages(layout, 3, seed=7)
    slots = [6, 1, 4]
    host.write(slots, data)
    for i, s in enumerate(slots):
        assert torch.equal(_raw(host.buffer[s]), _raw(data[i]))
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(_raw(host.buffer[untouched]), before[untouched])
    assert torch.equal(_raw(host.read(slots)), _raw(data))


def test_host_write_converts_data_of_another_dtype():
    """Small pages of another dtype take the copy that converts, never a reinterpretation of bits."""
    host = HostKVBuffer(MLA, PAGE, 4, pin_memory=False)
    data = torch.randn((2, *host.page_shape), dtype=torch.float32)
    host.write([3, 0], data)
    assert torch.equal(host.buffer[3], data[0].to(MLA.torch_dtype))
    assert torch.equal(host.buffer[0], data[1].to(MLA.torch_dtype))
