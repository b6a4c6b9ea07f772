"""The GPU check's pool kinds: an MLA-shaped pool (one latent + rope plane per layer,
DeepSeek V3's 576-wide row) and fp8 pools (e4m3, e5m2), each round-tripped bit for bit through the
project's own stores and movers: device (`DeviceKVPool`, on CUDA) -> pinned host (the cache's
handler) -> disk (`DiskPageStore.write_from`) -> host (`read_into`, after a reopen) -> device
(`LayerwiseLoader`), compared as raw bytes (every bit pattern, NaNs included). Torch only, no SGLang.

`check_kinds(device, pages)` returns `{kind: {"bit_exact": bool, "page_bytes": int, "layout": str}}`.
"""

from __future__ import annotations

import tempfile

import torch

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.hashing import Namespace, page_key
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.tiers.disk import DiskPageStore
from sgl_hicache.tiers.memory import DeviceKVPool, HostKVBuffer
from sgl_hicache.transfer.layerwise import LayerwiseLoader
from sgl_hicache.transfer.ops import TransferOp

KINDS = {
    # DeepSeek V3 / R1's MLA row: kv_lora_rank 512 + rope 64, one plane; 8 of its 61 layers
    "mla_bf16": KVLayout(num_layers=8, num_kv_heads=1, head_dim=576, dtype="bfloat16", kv_planes=1),
    "mla_fp8_e4m3": KVLayout(num_layers=8, num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn", kv_planes=1),
    "mha_fp8_e4m3": KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float8_e4m3fn"),
    "mha_fp8_e5m2": KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float8_e5m2"),
}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _random_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    elem = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * elem), generator=g, device=device, dtype=torch.uint8)
    return raw.view(dtype)


def round_trip(layout: KVLayout, device: torch.device, pages: int, page_size: int, seed: int = 0) -> bool:
    """device -> host -> disk -> (reopen) -> host -> device, bit for bit (see the module docstring)."""
    cuda = device.type == "cuda"
    cfg = CacheConfig(layout, device_tokens=pages * page_size, host_tokens=pages * page_size, page_size=page_size)
    cache = TieredCache(
        cfg,
        device=DeviceKVPool(layout, page_size, pages, device=device),
        host=HostKVBuffer(layout, page_size, pages, pin_memory=cuda),
    )
    dev, host = cache.stores[DEVICE], cache.stores[HOST]
    dev_slots, host_slots = dev.allocate([b""] * pages), host.allocate([b""] * pages)
    ref = _random_pages((pages, *dev.page_shape), layout.torch_dtype, device, seed)
    dev.write(dev_slots, ref)
    op = TransferOp(cache.tree.root, DEVICE, HOST, list(dev_slots), list(host_slots), pages * dev.page_bytes, "demote")
    cache.handlers[(DEVICE, HOST)](op, 0, pages)
    if cuda:
        torch.cuda.synchronize()
    ns = Namespace.for_model(layout, page_size)
    keys = [page_key(ns.root, [i] * page_size) for i in range(pages)]
    with tempfile.TemporaryDirectory(prefix="gpu_check_kinds-") as d:
        disk = DiskPageStore(layout, page_size, pages, d, ns)
        disk.allocate(keys)
        disk.write_from(keys, [host.page_view(s) for s in host_slots])
        disk.close()
        host.buffer.zero_()
        dev.kv.zero_()
        disk = DiskPageStore(layout, page_size, pages, d, ns)  # a restart: the pages come back from files
        for k, s in zip(keys, host_slots):
            disk.read_into(k, host.page_view(s))
        disk.close()
    LayerwiseLoader(dev, host, dev_slots, host_slots, to_device=True).start().synchronize()
    return torch.equal(_raw(dev.read(dev_slots)), _raw(ref))


def check_kinds(device: torch.device, pages: int = 16, page_size: int = 64) -> dict:
    out = {}
    for i, (name, layout) in enumerate(KINDS.items()):
        ok = round_trip(layout, device, pages, page_size, seed=i)
        out[name] = {
            "bit_exact": ok,
            "page_bytes": page_size * layout.bytes_per_token,
            "layout": f"{layout.num_layers}x{layout.kv_planes}x{layout.num_kv_heads}x{layout.head_dim} {layout.dtype}",
        }
    return out


__all__ = ["KINDS", "check_kinds", "round_trip"]
