"""The GPU check: the device tier on CUDA with a pinned host tier, moved by the project's
own code, bit-exact, and layer-wise loads overlapped with compute. Run it whenever a GPU is lent:

    scripts/gpu_check.sh                # ~1 min on one H200 (budget 4 min); JSON to $OUT/gpu_check.json
    scripts/gpu_check.sh --cpu-smoke    # tiny sizes on CPU, no streams: proves the script runs (~2 s)

Needs torch and xxhash only (no SGLang, no network, no pip install): `sgl_hicache` is imported from
the repository root. JSON goes to `$OUT/gpu_check.json` when `$OUT` is set, else to `--json PATH`,
else to `./gpu_check.json`; it is rewritten after each size, so a run cut short keeps what it measured.
Exit status: 0 all checks passed; 1 a check failed (bit-exact, overlap result) or a size raised;
2 no CUDA device (and no `--cpu-smoke`).

Per size (KV of `--layers` x `--kv-heads` x `--head-dim` bf16, `--page-size` tokens a page; default
32 x 8 x 128 = Llama-3-8B's 128 KiB a token, 64-token pages of 8 MiB; 128 MiB and 1 GiB):

1. Stores: `TieredCache`'s own `DeviceKVPool` (on CUDA) and `HostKVBuffer` (pinned when CUDA is present).
   Bit-exact round trips, host -> device -> host, through the cache's handlers (`cache.handlers`,
   what the transfer engine runs) and through `LayerwiseLoader` (also with a reversed slot map).
2. Bandwidth, GB/s, median of `--repeats` interleaved rounds timed with CUDA events, against a plain
   pinned `copy_(non_blocking=True)` of the same bytes in one call (ratio = ours / plain):
   `handler_*` (whole op, one page a copy), `loader_*` (`LayerwiseLoader` as it runs by default: one
   stream per link, one event per layer; on CUDA `method="staged"`: the layers in groups, one copy per
   page of a group to a device staging buffer, then one indexed copy per layer and K/V into the pool),
   `loader_per_page_*` (`method="per_page"`: one copy per page, layer and K/V) and `loader_gather_*`
   (`method="gather"`: one indexed copy per layer and K/V reading the pinned host buffer in place),
   `strided_*` (for information: one `copy_` per layer
   and K/V of the strided host view, which torch stages through a pageable temporary).
3. Overlap: a synthetic per-layer compute on the default stream (`--matmul` square bf16 matmuls,
   calibrated so one layer's compute ~ one layer's copy, then an exact int64 checksum of layer i's
   loaded KV) that waits only for layer i's event. Times (CUDA events, medians, interleaved):
   copy only, compute only, overlapped with all layers queued at start, and overlapped with the
   loader `--ahead` layers ahead of the compute. hidden = 1 - (t_overlapped - t_compute) / t_copy
   (1: the load is fully hidden; 0: none of it). `issue_ms` is the host time spent queueing the copies
   of one load: when it is close to t_copy the load is bound by the host, not by the link.
0. Pool kinds (`gpu_kinds.py`): an MLA-shaped pool (DeepSeek's 576-wide latent row,
   one plane) and fp8 pools (e4m3, e5m2), each device -> host -> disk -> host -> device bit for bit
   (`kinds` in the JSON).
4. Correctness under overlap: every overlapped run's per-layer checksums equal the serial run's (load
   all, then compute) and the source's; the pool is zeroed before each run. A run without the waits
   is reported (`race_visible_without_wait`), not asserted: it shows the check can see a missing wait.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.io.gpu_kinds import check_kinds
from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.tiers.base import DEVICE, HOST
from sgl_hicache.tiers.memory import DeviceKVPool, HostKVBuffer
from sgl_hicache.transfer.layerwise import LayerwiseLoader, as_bits
from sgl_hicache.transfer.ops import TransferOp

NO_CUDA = 2


class Clock:
    """Seconds a callable takes: CUDA events on the current stream, or wall time on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _sig(x: float) -> float:
    """Four significant digits (the smoke sizes' GB/s are far below 0.001)."""
    return float(f"{x:.4g}")


def _random_kv(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    """Finite bf16 values from random bit patterns (exponent below all-ones: no NaN, no inf)."""
    g = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(0, 0x7F00, shape, generator=g, device=device, dtype=torch.int32)
    return bits.to(torch.int16).view(torch.bfloat16)


def check_size(args: argparse.Namespace, device: torch.device, pages_n: int, clock: Clock) -> dict:
    cuda = device.type == "cuda"
    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="bfloat16")
    ps, n, L = args.page_size, pages_n, args.layers
    cfg = CacheConfig(layout, device_tokens=n * ps, host_tokens=n * ps, page_size=ps)
    # the stores TieredCache builds by default, with the device named so --cpu-smoke stays on the CPU
    cache = TieredCache(
        cfg, device=DeviceKVPool(layout, ps, n, device=device), host=HostKVBuffer(layout, ps, n, pin_memory=cuda)
    )
    dev, host = cache.stores[DEVICE], cache.stores[HOST]
    assert isinstance(dev, DeviceKVPool) and isinstance(host, HostKVBuffer)
    nbytes = n * dev.page_bytes
    dev_slots, host_slots = dev.allocate([b""] * n), host.allocate([b""] * n)
    assert list(dev_slots) == list(range(n)) and list(host_slots) == list(range(n))

    ref_dev = _random_kv((n, *dev.page_shape), device, seed=n)  # (pages, layers, K/V, tokens, heads, dim)
    ref = ref_dev.cpu()
    host.write(host_slots, ref)
    expected_sums = as_bits(ref).transpose(0, 1).reshape(L, -1).sum(dim=1, dtype=torch.int64)

    def dev_matches(slot_order: list[int] | None = None) -> bool:
        pool = dev.pages if slot_order is None else dev.pages[:, :, slot_order]
        return torch.equal(as_bits(pool.permute(2, 0, 1, 3, 4, 5)), as_bits(ref_dev))

    def host_matches() -> bool:
        return torch.equal(as_bits(host.buffer), as_bits(ref))

    h2d, d2h = cache.handlers[(HOST, DEVICE)], cache.handlers[(DEVICE, HOST)]

    def op(src: str) -> TransferOp:
        s, d = (host_slots, dev_slots) if src == HOST else (dev_slots, host_slots)
        return TransferOp(cache.tree.root, src, DEVICE if src == HOST else HOST, list(s), list(d), nbytes, "demand")

    def load(
        ahead: int | None = None, dev_handles: list[int] | None = None, method: str | None = None
    ) -> LayerwiseLoader:
        return LayerwiseLoader(
            dev, host, dev_handles or dev_slots, host_slots, to_device=True, ahead=ahead, method=method
        ).start()

    def store(method: str | None = None) -> LayerwiseLoader:
        return LayerwiseLoader(dev, host, dev_slots, host_slots, to_device=False, method=method).start()

    # ---- 1. bit-exact round trips -------------------------------------------------------------------
    exact: dict[str, bool] = {}
    dev.kv.zero_()
    h2d(op(HOST), 0, n)
    to_dev = dev_matches()
    host.buffer.zero_()
    d2h(op(DEVICE), 0, n)
    clock.sync()
    exact["handler_round_trip"] = to_dev and host_matches()
    dev.kv.zero_()
    load().synchronize()
    to_dev = dev_matches()
    host.buffer.zero_()
    store().synchronize()
    exact["loader_round_trip"] = to_dev and host_matches()
    dev.kv.zero_()
    reverse = dev_slots[::-1]
    load(dev_handles=reverse).synchronize()
    exact["loader_reversed_slots"] = dev_matches(reverse)
    for method in ("per_page", "gather", "staged"):  # each way the loader can move layers
        dev.kv.zero_()
        load(dev_handles=reverse, method=method).synchronize()
        exact[f"loader_{method}_reversed_slots"] = dev_matches(reverse)
        dev.kv.zero_()
        load(method=method).synchronize()
        to_dev = dev_matches()
        host.buffer.zero_()
        store(method=method).synchronize()
        exact[f"loader_{method}_round_trip"] = to_dev and host_matches()
    load().synchronize()  # back to the identity map: the timed moves below copy the pool both ways
    clock.sync()

    # ---- 2. bandwidth -----------------------------------------------------------------------------
    plain_host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=cuda)
    plain_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)

    # the strided rows move the plain buffers' bytes, seen in the pool's and the buffer's layouts: for
    # information only, they never touch the stores the checks read
    strided_dev, strided_host = plain_dev.view(dev.pages.shape), plain_host.view(host.buffer.shape)

    def strided(to_device: bool) -> None:
        for layer in range(L):
            for kv in (0, 1):
                d, h = strided_dev[layer, kv], strided_host[:, layer, kv]
                (d.copy_(h, non_blocking=True) if to_device else h.copy_(d, non_blocking=True))

    def loader_h2d() -> None:
        load().wait_layer(L - 1)

    def loader_d2h() -> None:
        store().wait_layer(L - 1)

    ours = {
        "handler_h2d": lambda: h2d(op(HOST), 0, n),
        "handler_d2h": lambda: d2h(op(DEVICE), 0, n),
        "loader_h2d": loader_h2d,
        "loader_d2h": loader_d2h,
        **{
            f"loader_{m}_{link}": (
                lambda m=m, link=link: (load(method=m) if link == "h2d" else store(method=m)).wait_layer(L - 1)
            )
            for m in ("per_page", "gather")
            for link in ("h2d", "d2h")
        },
        "strided_h2d": lambda: strided(True),
        "strided_d2h": lambda: strided(False),
    }
    fns: dict[str, Callable[[], object]] = {
        "plain_h2d": lambda: plain_dev.copy_(plain_host, non_blocking=True),
        "plain_d2h": lambda: plain_host.copy_(plain_dev, non_blocking=True),
        **ours,
    }
    for fn in fns.values():  # warm up (allocators, cuBLAS, host-allocator events)
        fn()
    clock.sync()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rnd in range(args.repeats):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:  # rotated order each round
            samples[name].append(clock.time(fns[name]))
    clock.sync()
    exact["intact_after_timed_moves"] = dev_matches() and host_matches()
    med = {k: statistics.median(v) for k, v in samples.items()}
    gbps = {k: _sig(nbytes / t / 1e9) for k, t in med.items()}
    ratios = {f"{k} / plain_{k[-3:]}": _sig(gbps[k] / gbps[f"plain_{k[-3:]}"]) for k in ours}

    # ---- 3. overlap ------------------------------------------------------------------------------------
    m = args.matmul
    a = torch.randn((m, m), device=device).to(torch.bfloat16)
    b = torch.randn((m, m), device=device).to(torch.bfloat16)
    c = torch.empty((m, m), device=device, dtype=torch.bfloat16)
    sums = torch.zeros(L, dtype=torch.int64, device=device)
    reps = [1]

    def compute(layer: int) -> None:
        for _ in range(reps[0]):
            torch.mm(a, b, out=c)
        sums[layer] = as_bits(dev.kv[layer]).sum(dtype=torch.int64)

    for _ in range(3):
        compute(0)
    per_mm = statistics.median(clock.time(lambda: [torch.mm(a, b, out=c) for _ in range(10)]) for _ in range(5)) / 10
    per_layer_copy = med["loader_h2d"] / L
    reps[0] = max(1, min(args.max_matmuls, round(per_layer_copy / per_mm))) if args.matmuls is None else args.matmuls

    def serial() -> None:
        load().synchronize()
        for layer in range(L):
            compute(layer)

    def overlapped(ahead: int | None, method: str | None = None) -> Callable[[], None]:
        def run() -> None:
            loader = load(ahead, method=method)
            for layer in range(L):
                loader.wait_layer(layer)
                compute(layer)

        return run

    def compute_only() -> None:
        for layer in range(L):
            compute(layer)

    issue: list[float] = []

    def copy_only() -> None:
        t0 = time.perf_counter()
        loader = load()
        issue.append(time.perf_counter() - t0)
        loader.wait_layer(L - 1)

    dev.kv.zero_()
    serial()
    clock.sync()
    serial_sums = sums.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
    others = ("per_page", "gather")  # the loader's other methods, for comparison with its default
    runs = {
        "copy_only": copy_only,
        "compute_only": compute_only,
        "overlapped": overlapped(None),
        "overlapped_ahead": overlapped(args.ahead),
        **{f"copy_only_{m}": (lambda m=m: load(method=m).wait_layer(L - 1)) for m in others},
        **{f"overlapped_ahead_{m}": overlapped(args.ahead, m) for m in others},
    }
    checked = {"overlapped", "overlapped_ahead", *(f"overlapped_ahead_{m}" for m in others)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    overlap_ok = True
    for rnd in range(args.repeats + 1):  # round 0 warms up
        order = list(runs)[rnd % len(runs) :] + list(runs)[: rnd % len(runs)]
        for name in order:
            dev.kv.zero_()
            sums.zero_()
            t = clock.time(runs[name])
            if rnd:
                times[name].append(t)
            if name in checked:  # what the compute read, and what the pool holds after the run
                overlap_ok &= torch.equal(sums.cpu(), serial_sums) and dev_matches()
    t = {k: statistics.median(v) for k, v in times.items()}

    dev.kv.zero_()
    sums.zero_()
    clock.sync()
    loader = load()
    compute_only()  # no waits: the compute may read pages still in flight
    loader.synchronize()
    clock.sync()
    race_visible = not torch.equal(sums.cpu(), serial_sums)

    exact["overlap_matches_serial"] = overlap_ok
    exact["serial_matches_source"] = torch.equal(serial_sums, expected_sums)

    def hidden(name: str, copy: str = "copy_only") -> float:
        return round(1 - (t[name] - t["compute_only"]) / t[copy], 3)

    return {
        "pages": n,
        "loader_method": LayerwiseLoader(dev, host, dev_slots, host_slots).method,
        "page_bytes": dev.page_bytes,
        "bytes": nbytes,
        "mib": round(nbytes / 2**20, 3),
        "device_pool": str(dev.kv.device),
        "host_pinned": bool(host.pinned and host.buffer.is_pinned()) if cuda else False,
        "handlers": {"h2d": getattr(h2d, "__qualname__", "?"), "d2h": getattr(d2h, "__qualname__", "?")},
        "bit_exact": exact,
        "gbps": gbps,
        "ratios": ratios,
        "overlap": {
            "ms": {k: round(v * 1e3, 3) for k, v in t.items()},
            "hidden": hidden("overlapped"),
            "hidden_ahead": hidden("overlapped_ahead"),
            "hidden_ahead_by_method": {m: hidden(f"overlapped_ahead_{m}", f"copy_only_{m}") for m in others},
            "ahead": args.ahead,
            "issue_ms": round(statistics.median(issue) * 1e3, 3),
            "matmul": m,
            "matmuls_per_layer": reps[0],
            "per_layer_copy_ms": round(per_layer_copy * 1e3, 4),
            "per_matmul_ms": round(per_mm * 1e3, 4),
            "race_visible_without_wait": race_visible,
        },
    }


def _environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": str(device),
        "cpus": os.cpu_count(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    return env


def _summary(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name}: ERROR {r['error']}"
    g, o = r["gbps"], r["overlap"]
    lines = [
        f"{name} ({r['pages']} pages x {r['page_bytes'] / 2**20:.2f} MiB, pool on {r['device_pool']}, host pinned {r['host_pinned']})",
        f"  bit-exact: {r['bit_exact']}; loader method: {r.get('loader_method')}",
    ]
    for link in ("h2d", "d2h"):
        row = "  ".join(
            f"{k} {g[k + '_' + link]:.2f}"
            for k in ("plain", "handler", "loader", "loader_per_page", "loader_gather", "strided")
        )
        lines.append(f"  {link} GB/s: {row}")
    lines.append(f"  ratios: {r['ratios']}")
    lines.append(
        f"  overlap ms {o['ms']}; hidden {o['hidden']} (all queued), {o['hidden_ahead']} (ahead {o['ahead']}); "
        f"issue {o['issue_ms']} ms; others ahead {o.get('hidden_ahead_by_method')}; {o['matmuls_per_layer']} matmuls/layer; race visible without wait: {o['race_visible_without_wait']}"
    )
    return "\n".join(lines)


def _out_path(args: argparse.Namespace) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return Path(args.json) if args.json else Path("gpu_check.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU tensors, no streams/events (for the test suite)"
    )
    p.add_argument("--json", help="output path when $OUT is not set (default ./gpu_check.json)")
    p.add_argument("--sizes-mib", default="128,1024", help="KV sizes to move, MiB, comma separated")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ahead", type=int, default=2, help="layers the loader keeps queued beyond the one waited for")
    p.add_argument("--matmul", type=int, default=2048, help="side of the square bf16 matmul of the synthetic compute")
    p.add_argument(
        "--matmuls", type=int, default=None, help="matmuls per layer (default: calibrated to one layer's copy)"
    )
    p.add_argument("--max-matmuls", type=int, default=1000)
    p.add_argument("--budget-s", type=float, default=200.0, help="skip the sizes not started by then")
    args = p.parse_args(argv)
    out = _out_path(args)
    t_start = time.perf_counter()

    if args.cpu_smoke:
        device = torch.device("cpu")
        args.layers, args.kv_heads, args.head_dim, args.page_size = 4, 2, 16, 4
        args.repeats, args.matmul = min(args.repeats, 2), 16
        page_counts = [6]
    else:
        if not torch.cuda.is_available():
            msg = "gpu_check: no CUDA device (torch.cuda.is_available() is false); nothing measured. Use --cpu-smoke to run the code path on CPU."
            print(msg, file=sys.stderr)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(
                json.dumps(
                    {"benchmark": "gpu_check", "ok": False, "error": msg, "env": _environment(torch.device("cpu"))},
                    indent=2,
                )
                + "\n"
            )
            return NO_CUDA
        device = torch.device("cuda", torch.cuda.current_device())
        page_bytes = args.page_size * KVLayout(args.layers, args.kv_heads, args.head_dim).bytes_per_token
        page_counts = [max(1, int(float(s) * 2**20) // page_bytes) for s in args.sizes_mib.split(",")]

    clock = Clock(device.type == "cuda")
    result: dict = {
        "benchmark": "gpu_check",
        "mode": "cpu_smoke" if args.cpu_smoke else "cuda",
        "env": _environment(device),
        "config": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": "bfloat16",
            "repeats": args.repeats,
            "ahead": args.ahead,
            "matmul": args.matmul,
        },
        "sizes": {},
        "ok": False,
    }

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

    ok = True
    try:  # the pool kinds first: small, and they must not be lost to the budget
        result["kinds"] = check_kinds(device, *((3, 4) if args.cpu_smoke else (16, 64)))
        ok &= all(k["bit_exact"] for k in result["kinds"].values())
    except Exception as exc:
        traceback.print_exc()
        result["kinds"] = {"error": f"{type(exc).__name__}: {exc}"}
        ok = False
    print(
        "kinds: "
        + ", ".join(
            f"{k} {'bit-exact' if v.get('bit_exact') else 'MISMATCH'}"
            for k, v in result["kinds"].items()
            if isinstance(v, dict)
        ),
        flush=True,
    )
    write()
    for n in page_counts:
        page_bytes = args.page_size * KVLayout(args.layers, args.kv_heads, args.head_dim).bytes_per_token
        name = f"{n * page_bytes / 2**20:g}MiB"
        if time.perf_counter() - t_start > args.budget_s:
            result["sizes"][name] = {"skipped": f"budget of {args.budget_s} s spent"}
            continue
        try:
            r = check_size(args, device, n, clock)
            ok &= all(r["bit_exact"].values())
        except Exception as exc:  # record and go on: a lent GPU's minutes are too dear to lose the other sizes
            traceback.print_exc()
            r = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
        result["sizes"][name] = r
        print(_summary(name, r), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["ok"], result["seconds"] = ok, round(time.perf_counter() - t_start, 1)
        write()
    result["ok"], result["seconds"] = ok, round(time.perf_counter() - t_start, 1)
    write()
    print(f"gpu_check: {'ok' if ok else 'FAILED'} in {result['seconds']} s; JSON: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
