"""Device <-> host moves for SGLang's pool layout (a K and a V buffer per layer), in the core venv.

`SGLangDevicePool` imports no sglang; a pool with SGLang's attribute names and shapes stands in for
`MHATokenToKVPool` (the sglang-marked tests run the same moves on the real one). Both paths of
`layered_device_host` are exercised: the per-layer gather/scatter and the small-range fallback.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.sglang.device_pool import SGLangDevicePool
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.tiers.memory import HostKVBuffer
from sgl_hicache.transfer import handlers
from sgl_hicache.transfer.ops import TransferOp
from sgl_hicache.tree.node import TreeNode

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16")
PAGE, DEVICE_PAGES, HOST_PAGES = 4, 20, 30


def _sglang_like_pool() -> SGLangDevicePool:
    rows = (DEVICE_PAGES + 1) * PAGE  # SGLang adds one padding page
    mk = lambda: [torch.zeros(rows, 2, 4, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]  # noqa: E731
    kv = SimpleNamespace(k_buffer=mk(), v_buffer=mk(), dtype=torch.bfloat16)
    alloc = SimpleNamespace(
        page_size=PAGE, size=DEVICE_PAGES * PAGE, get_kvcache=lambda: kv, available_size=lambda: DEVICE_PAGES * PAGE
    )
    return SGLangDevicePool(alloc)


def _op(src: str, src_handles: list[int], dst_handles: list[int]) -> TransferOp:
    dst = HOST if src == DEVICE else DEVICE
    return TransferOp(TreeNode(None, (), [], 0), src, dst, src_handles, dst_handles, 0, "demote")


@pytest.mark.parametrize("min_bytes", [0, 1 << 40], ids=["layered", "small-range-fallback"])
def test_round_trip_to_scattered_slots_is_bit_exact(monkeypatch, min_bytes: int) -> None:
    monkeypatch.setattr(handlers, "_LAYERED_MIN_BYTES", min_bytes)
    dev, host = _sglang_like_pool(), HostKVBuffer(LAYOUT, PAGE, HOST_PAGES)
    stores = {DEVICE: dev, HOST: host}
    to_host = handlers.layered_device_host(stores, DEVICE, HOST)
    to_device = handlers.layered_device_host(stores, HOST, DEVICE)
    rng = random.Random(7)
    d_pages = rng.sample(range(1, DEVICE_PAGES + 1), 9)
    h_pages = rng.sample(range(HOST_PAGES), 9)
    data = torch.randn(9, *dev.page_shape).to(torch.bfloat16)
    dev.write(d_pages, data)
    host_before = host.buffer.clone()

    to_host(_op(DEVICE, d_pages, h_pages), 0, 9)
    assert torch.equal(host.read(h_pages), data)
    untouched = [s for s in range(HOST_PAGES) if s not in h_pages]
    assert torch.equal(host.buffer[untouched], host_before[untouched])

    back = rng.sample([p for p in range(1, DEVICE_PAGES + 1) if p not in d_pages], 9)
    to_device(_op(HOST, h_pages, back), 2, 9)  # a sub-range, as the engine's chunks call it
    assert torch.equal(dev.read(back[2:]), data[2:])
    assert torch.equal(dev.read(back[:2]), torch.zeros_like(data[:2]))
    assert torch.equal(dev.read(d_pages), data)  # the source pages are read, never written


def test_default_handlers_pick_per_layer_moves_for_sglang_layout_only() -> None:
    dev, host = _sglang_like_pool(), HostKVBuffer(LAYOUT, PAGE, HOST_PAGES)
    chosen = handlers.default_handlers({DEVICE: dev, HOST: host})[(DEVICE, HOST)]
    assert chosen.__qualname__.startswith("layered_device_host")
    from sgl_hicache.tiers.memory import DeviceKVPool

    embedded = handlers.default_handlers({DEVICE: DeviceKVPool(LAYOUT, PAGE, 4, device="cpu"), HOST: host})
    assert embedded[(DEVICE, HOST)].__qualname__.startswith("page_to_page")
