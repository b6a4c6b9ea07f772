"""LayerwiseLoader's contract (sgl_hicache/transfer/layerwise.py) on CPU; on CUDA when one is present."""

from __future__ import annotations

import pytest
import torch

from sgl_hicache.config import KVLayout
from sgl_hicache.tiers.memory import DeviceKVPool, HostKVBuffer
from sgl_hicache.transfer.layerwise import LayerwiseLoader, as_bits, pinned_cuda_view

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 4


def _stores(device: str = "cpu", pages: int = 8):
    dev = DeviceKVPool(LAYOUT, PAGE, pages, device=device)
    host = HostKVBuffer(LAYOUT, PAGE, pages, pin_memory=device != "cpu")
    return dev, host


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16)


def _random_pages(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn((n, *page_shape()), generator=g).to(torch.bfloat16)


def page_shape():
    return (LAYOUT.num_layers, 2, PAGE, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def _round_trip(device: str, method: str | None = None, stage_layers: int | None = None) -> None:
    dev, host = _stores(device)
    host_slots, dev_slots = [5, 0, 3, 6, 2], [1, 7, 4, 0, 6]  # neither side consecutive, different orders
    pages = _random_pages(len(host_slots))
    host.write(host_slots, pages)
    loader = LayerwiseLoader(dev, host, dev_slots, host_slots, method=method, stage_layers=stage_layers).start()
    # the default stages on CUDA (pinned host buffer) and copies per page on a CPU
    assert loader.method == (method or ("per_page" if device == "cpu" else "staged"))
    for layer in range(LAYOUT.num_layers):
        loader.wait_layer(layer)
        # what runs after wait_layer(i) on the current stream sees layer i (and the ones before it)
        got = dev.pages[layer][:, dev_slots].clone()
        assert torch.equal(_bits(got), _bits(pages[:, layer].transpose(0, 1)))
    loader.synchronize()
    assert torch.equal(_bits(dev.read(dev_slots)), _bits(pages))

    host.write(host_slots, torch.zeros_like(pages))
    back = LayerwiseLoader(
        dev, host, dev_slots, host_slots, to_device=False, method=method, stage_layers=stage_layers
    ).start()
    back.synchronize()
    assert torch.equal(_bits(host.read(host_slots)), _bits(pages))
    untouched = [s for s in range(host.capacity_pages) if s not in host_slots]
    assert not host.read(untouched).any()


# staged in groups of 1, 3 (a partial last group of the 4 layers) and 4 (one group)
METHODS = [(None, None), ("per_page", None), ("gather", None), ("staged", 1), ("staged", 3), ("staged", 4)]


@pytest.mark.parametrize("method,stage_layers", METHODS)
def test_round_trip_layer_by_layer_cpu(method: str | None, stage_layers: int | None) -> None:
    _round_trip("cpu", method, stage_layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("method,stage_layers", METHODS)
def test_round_trip_layer_by_layer_cuda(method: str | None, stage_layers: int | None) -> None:
    _round_trip("cuda", method, stage_layers)


def test_pinned_cuda_view_only_for_pinned_memory_on_cuda() -> None:
    plain = torch.zeros(4, dtype=torch.bfloat16)
    assert pinned_cuda_view(plain, torch.device("cpu")) is None
    if torch.cuda.is_available():
        assert pinned_cuda_view(plain, torch.device("cuda")) is None  # pageable: no device address
        pinned = torch.arange(4, dtype=torch.int16).view(torch.bfloat16).pin_memory()
        view = pinned_cuda_view(pinned, torch.device("cuda"))
        assert view is not None and view.is_cuda and view.data_ptr() == pinned.data_ptr()
        view[0] = 7  # a kernel's write lands in the host's bytes
        torch.cuda.synchronize()
        assert as_bits(pinned)[0].item() == 7


def test_as_bits_keeps_the_bytes() -> None:
    t = torch.randn(6).to(torch.bfloat16)
    b = as_bits(t)
    assert b.dtype == torch.int16 and b.data_ptr() == t.data_ptr()
    assert as_bits(torch.zeros(3, dtype=torch.float32)).dtype == torch.int32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gather_and_staged_on_cuda_need_a_pinned_host_buffer() -> None:
    dev = DeviceKVPool(LAYOUT, PAGE, 8, device="cuda")
    host = HostKVBuffer(LAYOUT, PAGE, 8, pin_memory=False)
    for method in ("gather", "staged"):
        with pytest.raises(ValueError, match="pinned host buffer"):
            LayerwiseLoader(dev, host, [0], [0], method=method)
    assert LayerwiseLoader(dev, host, [0], [0]).method == "per_page"  # the default falls back


def test_staged_groups_cover_the_layers() -> None:
    dev, host = _stores()
    assert LayerwiseLoader(dev, host, [0], [0], method="staged").group == 1  # 4 layers in at most 8 groups
    assert LayerwiseLoader(dev, host, [0], [0], method="staged", stage_layers=3).group == 3
    assert LayerwiseLoader(dev, host, [0], [0], method="gather").group == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ahead_queues_layers_lazily_cuda() -> None:
    dev, host = _stores("cuda")
    loader = LayerwiseLoader(dev, host, [0, 1], [0, 1], ahead=1).start()
    assert loader._issued == 1
    loader.wait_layer(0)
    assert loader._issued == 2
    loader.synchronize()
    assert loader._issued == LAYOUT.num_layers


def test_misuse_is_refused() -> None:
    dev, host = _stores()
    with pytest.raises(ValueError, match="2 device handles for 1 host"):
        LayerwiseLoader(dev, host, [0, 1], [0])
    with pytest.raises(ValueError, match="device handle 8 not in"):
        LayerwiseLoader(dev, host, [8], [0])
    with pytest.raises(ValueError, match="ahead"):
        LayerwiseLoader(dev, host, [0], [0], ahead=0)
    with pytest.raises(ValueError, match="method must be one of"):
        LayerwiseLoader(dev, host, [0], [0], method="dma")
    with pytest.raises(ValueError, match="stage_layers"):
        LayerwiseLoader(dev, host, [0], [0], method="staged", stage_layers=0)
    loader = LayerwiseLoader(dev, host, [0], [0])
    with pytest.raises(RuntimeError, match="not started"):
        loader.wait_layer(0)
    with pytest.raises(RuntimeError, match="not started"):
        loader.synchronize()
    loader.start()
    with pytest.raises(RuntimeError, match="already started"):
        loader.start()
    with pytest.raises(IndexError):
        loader.wait_layer(LAYOUT.num_layers)
    loader.synchronize()


def test_worker_failure_reaches_the_waiter() -> None:
    dev, host = _stores()
    loader = LayerwiseLoader(dev, host, [0], [0])
    pages = loader._dev_pages
    loader._dev_pages = lambda layer, kv: pages(layer, kv)[
        :, :1
    ]  # a destination of the wrong shape: the first copy fails
    loader.start()
    with pytest.raises(RuntimeError):
        loader.wait_layer(LAYOUT.num_layers - 1)
    with pytest.raises(RuntimeError):
        loader.synchronize()


def test_no_pages_is_a_no_op() -> None:
    dev, host = _stores()
    loader = LayerwiseLoader(dev, host, [], []).start()
    loader.wait_layer(LAYOUT.num_layers - 1)
    loader.synchronize()
