"""Host-tier copy bandwidth against a plain torch copy of the same bytes, side by side in one run.

    .venv/bin/python -m benchmarks.io.host --json host_bw.json          # ~30 s here
    .venv/bin/python -m benchmarks.io.host --quick --json host_bw.json  # ~1 s

N pages (default layout 8 layers x 8 KV heads x 64 dim x 16 tokens, bf16 = 256 KiB a page; 256 pages =
64 MiB). Every round runs each pair back to back (ours, then the plain copy of the same bytes; the order
alternates between rounds), `--repeats` rounds, medians; ratio = ours / plain (1.0 is the limit).

- `host_write`: `HostKVBuffer.write(slots, pages)` against `dst.copy_(src)` into a preallocated tensor.
- `host_read`: `HostKVBuffer.read(slots)` (returns a new tensor) against `src.clone()`.
- `device_to_host` / `host_to_device`: the cache's own handlers (`TieredCache.handlers`, the code
  the transfer engine runs) moving whole `TransferOp`s between `DeviceKVPool` and `HostKVBuffer`,
  against `dst.copy_(src)` between a device tensor and a host tensor of the same bytes. The `_chunked`
  variants call the handler per `--chunk-pages` pages, as the transfer engine's workers do.
- `sglang_layout_*`: the same moves for SGLang's pool layout (a separate K and V buffer per layer,
  `SGLangDevicePool` over them): the per-layer gather/scatter handler the backend uses
  (`layered_device_host`) and, as `*_generic`, the read-into-one-tensor path it replaced
  (`copy_via_tensor`); `layered_over_generic` is their speed ratio (> 1: the layered handler is faster).
- On CUDA only (`"cuda": true`): pinned host -> device `copy_(non_blocking=True)` against plain
  `tensor.to(device, non_blocking=True)` from pageable memory, and device -> pinned host against
  `tensor.to("cpu")`. On a CPU-only machine the device pool is an ordinary CPU tensor, so
  device<->host is a memory-to-memory copy and the JSON says `"cuda": false`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.sglang.device_pool import SGLangDevicePool
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.transfer.handlers import copy_via_tensor, layered_device_host
from sgl_hicache.transfer.ops import TransferOp


class _LayerListPool:
    """SGLang's MHA pool layout: per layer a K and a V buffer `[slots + page, heads, dim]` (page 0 is
    SGLang's padding page)."""

    def __init__(self, layout: KVLayout, page_size: int, pages: int, device: torch.device) -> None:
        shape = ((pages + 1) * page_size, layout.num_kv_heads, layout.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=layout.torch_dtype, device=device) for _ in range(layout.num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=layout.torch_dtype, device=device) for _ in range(layout.num_layers)]
        self.dtype = layout.torch_dtype


class _FixedAllocator:
    """Just what `SGLangDevicePool` reads at construction; the benchmark addresses pages directly."""

    def __init__(self, pool: _LayerListPool, page_size: int, pages: int) -> None:
        self.pool, self.page_size, self.size = pool, page_size, pages * page_size

    def get_kvcache(self) -> _LayerListPool:
        return self.pool

    def available_size(self) -> int:
        return self.size


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="bfloat16")
    n = args.pages
    cfg = CacheConfig(
        layout, device_tokens=n * args.page_size, host_tokens=n * args.page_size, page_size=args.page_size
    )
    cache = TieredCache(cfg)
    dev, host = cache.stores[DEVICE], cache.stores[HOST]
    page_bytes = dev.page_bytes
    nbytes = n * page_bytes
    cuda = torch.cuda.is_available()
    device = dev.device

    g = torch.Generator().manual_seed(0)
    pages = torch.randn((n, *dev.page_shape), generator=g).to(torch.bfloat16)
    dev_slots = dev.allocate([b""] * n)
    host_slots = host.allocate([b""] * n)
    assert dev_slots is not None and host_slots is not None
    dev.write(dev_slots, pages)
    host.write(host_slots, pages)

    # plain tensors of exactly the same bytes
    plain_host_src = pages.clone()
    plain_host_dst = torch.empty_like(pages)
    plain_dev = pages.to(device)
    plain_dev_dst = torch.empty_like(plain_dev)
    plain_host_pinned = torch.empty_like(pages, pin_memory=cuda)

    d2h = cache.handlers[(DEVICE, HOST)]
    h2d = cache.handlers[(HOST, DEVICE)]

    def op(src: str, dst: str) -> TransferOp:
        s, d = (dev_slots, host_slots) if src == DEVICE else (host_slots, dev_slots)
        return TransferOp(cache.tree.root, src, dst, list(s), list(d), nbytes, "demand")

    def chunked(handler, o: TransferOp) -> None:
        for start in range(0, n, args.chunk_pages):
            handler(o, start, min(n, start + args.chunk_pages))

    pairs: dict[str, tuple] = {
        "host_write": (lambda: host.write(host_slots, pages), lambda: plain_host_dst.copy_(plain_host_src)),
        "host_read": (lambda: host.read(host_slots), lambda: plain_host_src.clone()),
        "device_to_host": (lambda: d2h(op(DEVICE, HOST), 0, n), lambda: plain_host_pinned.copy_(plain_dev)),
        "host_to_device": (lambda: h2d(op(HOST, DEVICE), 0, n), lambda: plain_dev_dst.copy_(plain_host_pinned)),
        "device_to_host_chunked": (lambda: chunked(d2h, op(DEVICE, HOST)), lambda: plain_host_pinned.copy_(plain_dev)),
        "host_to_device_chunked": (
            lambda: chunked(h2d, op(HOST, DEVICE)),
            lambda: plain_dev_dst.copy_(plain_host_pinned),
        ),
    }
    # SGLang's layout: pages 1..n of a per-layer-list pool <-> the same host slots
    sgl_dev = SGLangDevicePool(_FixedAllocator(_LayerListPool(layout, args.page_size, n, device), args.page_size, n))
    sgl_stores = {DEVICE: sgl_dev, HOST: host}
    sgl_slots = list(range(1, n + 1))
    sgl_dev.write(sgl_slots, pages)

    def sgl_op(src: str) -> TransferOp:
        s, d = (sgl_slots, host_slots) if src == DEVICE else (host_slots, sgl_slots)
        return TransferOp(cache.tree.root, src, DEVICE if src == HOST else HOST, list(s), list(d), nbytes, "demand")

    sgl_d2h, sgl_h2d = layered_device_host(sgl_stores, DEVICE, HOST), layered_device_host(sgl_stores, HOST, DEVICE)
    generic = copy_via_tensor(sgl_stores)
    pairs["sglang_layout_device_to_host"] = (
        lambda: sgl_d2h(sgl_op(DEVICE), 0, n),
        lambda: plain_host_pinned.copy_(plain_dev),
    )
    pairs["sglang_layout_host_to_device"] = (
        lambda: sgl_h2d(sgl_op(HOST), 0, n),
        lambda: plain_dev_dst.copy_(plain_host_pinned),
    )
    pairs["sglang_layout_device_to_host_generic"] = (
        lambda: generic(sgl_op(DEVICE), 0, n),
        lambda: plain_host_pinned.copy_(plain_dev),
    )
    pairs["sglang_layout_host_to_device_generic"] = (
        lambda: generic(sgl_op(HOST), 0, n),
        lambda: plain_dev_dst.copy_(plain_host_pinned),
    )
    pairs["sglang_layout_device_to_host_chunked"] = (
        lambda: chunked(sgl_d2h, sgl_op(DEVICE)),
        lambda: plain_host_pinned.copy_(plain_dev),
    )
    pairs["sglang_layout_device_to_host_chunked_generic"] = (
        lambda: chunked(generic, sgl_op(DEVICE)),
        lambda: plain_host_pinned.copy_(plain_dev),
    )

    if cuda:
        pinned = pages.pin_memory()
        pageable = pages.clone()
        pairs["cuda_pinned_h2d_vs_to_device"] = (
            lambda: plain_dev_dst.copy_(pinned, non_blocking=True),
            lambda: pageable.to(device, non_blocking=True),
        )
        pairs["cuda_d2h_pinned_vs_to_cpu"] = (
            lambda: plain_host_pinned.copy_(plain_dev, non_blocking=True),
            lambda: plain_dev.to("cpu"),
        )

    for ours, plain in pairs.values():  # warm up allocators and caches
        ours()
        plain()
    samples: dict[str, dict[str, list[float]]] = {k: {"ours": [], "plain": []} for k in pairs}
    gc.collect()
    for rnd in range(args.repeats):
        for name, (ours, plain) in pairs.items():
            order = (("ours", ours), ("plain", plain)) if rnd % 2 == 0 else (("plain", plain), ("ours", ours))
            for side, fn in order:
                samples[name][side].append(_time(fn))

    # the handlers moved the right bytes (a benchmark that copies garbage measures nothing)
    d2h(op(DEVICE, HOST), 0, n)
    assert torch.equal(host.read(host_slots).view(torch.int16), pages.view(torch.int16))
    h2d(op(HOST, DEVICE), 0, n)
    assert torch.equal(dev.read(dev_slots).cpu().view(torch.int16), pages.view(torch.int16))
    host.write(host_slots, torch.zeros_like(pages))
    sgl_d2h(sgl_op(DEVICE), 0, n)
    assert torch.equal(host.read(host_slots).view(torch.int16), pages.view(torch.int16))
    sgl_dev.write(sgl_slots, torch.zeros_like(pages))
    sgl_h2d(sgl_op(HOST), 0, n)
    assert torch.equal(sgl_dev.read(sgl_slots).cpu().view(torch.int16), pages.view(torch.int16))

    gbps = {
        name: {side: round(nbytes / statistics.median(v) / 1e9, 3) for side, v in s.items()}
        for name, s in samples.items()
    }
    ratios = {name: round(g_["ours"] / g_["plain"], 3) if g_["plain"] else None for name, g_ in gbps.items()}
    layered_over_generic = {
        name: round(gbps[name]["ours"] / gbps[name + "_generic"]["ours"], 3)
        for name in (
            "sglang_layout_device_to_host",
            "sglang_layout_host_to_device",
            "sglang_layout_device_to_host_chunked",
        )
    }
    return {
        "benchmark": "host_bandwidth",
        "config": {
            "pages": n,
            "page_bytes": page_bytes,
            "bytes_per_copy": nbytes,
            "layout": {
                "layers": args.layers,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "page_size": args.page_size,
                "dtype": "bfloat16",
            },
            "repeats": args.repeats,
            "chunk_pages": args.chunk_pages,
            "quick": args.quick,
        },
        "cuda": cuda,
        "device": str(device),
        "host_pinned": bool(getattr(host, "pinned", False)),
        "torch_threads": torch.get_num_threads(),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()},
        "gbps_median": gbps,
        "ratio_ours_over_plain": ratios,
        "layered_over_generic": layered_over_generic,
        "samples_s": {name: {side: [round(x, 6) for x in v] for side, v in s.items()} for name, s in samples.items()},
        "note": (
            "ratio = ours / plain torch copy of the same bytes (1.0 = the limit). "
            + (
                "CUDA present: device<->host crosses PCIe/NVLink."
                if cuda
                else "No CUDA: the device pool is a CPU tensor, so device<->host is memory to memory; no pinned-copy figures."
            )
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256, help="pages per copy (default 256 = 64 MiB)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds; figures are medians (default 7)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--chunk-pages",
        type=int,
        default=4,
        help="pages per handler call in the _chunked variants (the engine's default)",
    )
    ap.add_argument("--quick", action="store_true", help="smallest size: 8 pages of a small layout, 2 rounds")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.pages, args.repeats, args.layers, args.kv_heads, args.head_dim = 8, 2, 2, 2, 16
    t0 = time.perf_counter()
    result = run(args)
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("cuda", "gbps_median", "ratio_ours_over_plain", "wall_s")}, indent=2))
    return result


if __name__ == "__main__":
    main()
