"""Model and hardware presets for the embedded engine's cost model (see `cost.py`, docs/calibration.md).

Every figure is a public spec or a documented, physically plausible sustained rate; the same preset
values serve every experiment (no per-figure correction). Bandwidths are bytes/s, rates FLOP/s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ..config import KVLayout

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a decoder-only transformer, enough to cost it.

    `total_params` are all weights (read from memory once per forward pass); `active_params` are the
    weights one token multiplies through (equal to total for a dense model, the routed share for a
    MoE). Embedding tables are counted as published (a few % of a dense model).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    total_params: float
    active_params: float
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelPreset.{f} must be a positive integer, got {v!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"ModelPreset.dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if not (0 < self.active_params <= self.total_params):
            raise ValueError(
                f"ModelPreset needs 0 < active_params <= total_params, got {self.active_params} / {self.total_params}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("ModelPreset.num_attention_heads must be a multiple of num_kv_heads")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.active_params < self.total_params

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (equals `kv_layout().bytes_per_token`)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            architecture=self.architecture,
        )

    def replace(self, **changes: Any) -> ModelPreset:
        return dataclasses.replace(self, **changes)


def llama_params(
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    tied: bool = False,
) -> int:
    """Exact parameter count of a Llama-architecture config (RMSNorm weights included)."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o + k, v
    mlp = 3 * hidden * intermediate
    per_layer = attn + mlp + 2 * hidden
    return layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)


@dataclass(frozen=True)
class HardwarePreset:
    """One serving node: `num_gpus` identical accelerators working tensor-parallel on one model.

    - `peak_flops`: dense bf16 peak per GPU; `mfu`: the sustained fraction reached by prefill.
    - `hbm_bandwidth`: sustained device-memory bandwidth per GPU (what memory-bound decode reads at).
    - `host_link_bandwidth`: effective host<->device copy bandwidth per GPU (PCIe Gen5 x16 ~ 50-55
      GB/s); with tensor parallelism each GPU moves its own shard, so the node moves `num_gpus` times this.
    - `disk_read_bandwidth` / `disk_write_bandwidth`: the node's storage tier, in aggregate.
    - `device_memory_bytes`: per GPU.
    """

    name: str
    num_gpus: int
    peak_flops: float
    mfu: float
    hbm_bandwidth: float
    host_link_bandwidth: float
    disk_read_bandwidth: float
    disk_write_bandwidth: float
    device_memory_bytes: float

    def __post_init__(self) -> None:
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"HardwarePreset.num_gpus must be an integer >= 1, got {self.num_gpus!r}")
        if not (0 < self.mfu <= 1):
            raise ValueError(f"HardwarePreset.mfu must be in (0, 1], got {self.mfu!r}")
        for f in (
            "peak_flops",
            "hbm_bandwidth",
            "host_link_bandwidth",
            "disk_read_bandwidth",
            "disk_write_bandwidth",
            "device_memory_bytes",
        ):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"HardwarePreset.{f} must be > 0, got {v!r}")

    @property
    def sustained_flops(self) -> float:
        """Whole node: peak * mfu * num_gpus."""
        return self.peak_flops * self.mfu * self.num_gpus

    def link_bandwidth(self, src: str, dst: str) -> float:
        """Node-wide bandwidth of a tier link, bytes/s: device<->host over the host links (all GPUs
        in parallel), host<->disk at the disk's read (disk->host) or write (host->disk) rate."""
        pair = (src, dst)
        if pair in (("device", "host"), ("host", "device")):
            return self.host_link_bandwidth * self.num_gpus
        if pair == ("disk", "host"):
            return self.disk_read_bandwidth
        if pair == ("host", "disk"):
            return self.disk_write_bandwidth
        raise ValueError(f"no link from {src!r} to {dst!r}; links: device<->host, host<->disk")

    def replace(self, **changes: Any) -> HardwarePreset:
        return dataclasses.replace(self, **changes)


GB = 1e9
TB = 1e12

_TINY = llama_params(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=1024)
_BENCH = llama_params(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, head_dim=64, vocab=1024)

MODELS: dict[str, ModelPreset] = {
    # meta-llama/Meta-Llama-3-8B config.json; 8.03 B parameters
    "llama3-8b": ModelPreset("llama3-8b", 32, 4096, 32, 8, 128, "bfloat16", 8.03e9, 8.03e9),
    # Qwen/Qwen2.5-32B config.json; 32.5 B parameters
    "qwen2.5-32b": ModelPreset("qwen2.5-32b", 64, 5120, 40, 8, 128, "bfloat16", 32.5e9, 32.5e9, architecture="qwen2"),
    # Qwen/Qwen3-Coder-480B-A35B-Instruct config.json: 62 layers, 96 query heads, 8 KV heads, head_dim 128
    "qwen3-coder-480b-a35b": ModelPreset(
        "qwen3-coder-480b-a35b", 62, 6144, 96, 8, 128, "bfloat16", 480e9, 35e9, architecture="qwen3_moe"
    ),
    # openai/gpt-oss-120b config.json: 36 layers (every other one a 128-token window layer), 64 query
    # heads, 8 KV heads, head_dim 64; 116.8 B parameters, 5.1 B active. The SGLang backend tiers every
    # layer of a page, window layers included (SWAPoolAdapter), so a page costs every layer's K and V
    "gpt-oss-120b": ModelPreset(
        "gpt-oss-120b", 36, 2880, 64, 8, 64, "bfloat16", 116.8e9, 5.1e9, architecture="gpt_oss"
    ),
    # /work/shared/reference/sglang-cpu-probe/tiny-llama/config.json (557,696 parameters)
    "tiny-llama": ModelPreset("tiny-llama", 2, 128, 4, 2, 32, "bfloat16", float(_TINY), float(_TINY)),
    # scripts/cpu/bench-llama/config.json: the CPU benchmark model (dummy weights; 96,486,400 parameters)
    "bench-llama": ModelPreset("bench-llama", 8, 1024, 16, 8, 64, "bfloat16", float(_BENCH), float(_BENCH)),
}
MODELS["qwen3-480b"] = MODELS["qwen3-coder-480b-a35b"]  # short alias

_H200 = dict(
    peak_flops=989e12,  # H200 SXM dense BF16 (the 1,979 TFLOPS figure is with 2:4 sparsity)
    mfu=0.40,  # sustained prefill utilisation over long sequences, a typical serving-engine figure
    hbm_bandwidth=4.0 * TB,  # 4.8 TB/s HBM3e spec, ~83 % sustained
    host_link_bandwidth=52 * GB,  # PCIe Gen5 x16: 64 GB/s raw, 50-55 GB/s effective with pinned memory
    device_memory_bytes=141 * GB,
)

HARDWARE: dict[str, HardwarePreset] = {
    # one H200 with one local NVMe Gen4 SSD (~7 GB/s sequential read, ~5 GB/s write)
    "h200": HardwarePreset("h200", 1, disk_read_bandwidth=7 * GB, disk_write_bandwidth=5 * GB, **_H200),
    # an 8-GPU H200 node (DGX/HGX class: 8 NVMe U.2 Gen4 drives, ~50 GB/s raw sequential); 25 GB/s is a
    # conservative sustained aggregate for page-sized reads through a file system
    "8xh200": HardwarePreset("8xh200", 8, disk_read_bandwidth=25 * GB, disk_write_bandwidth=15 * GB, **_H200),
    # this 2-core CPU box, from `measure_local()` on it: bf16 512^3 matmul 0.83-0.94 TFLOP/s, a 64 MiB
    # copy ~23 GB/s (rounded down: the box is shared). mfu 0.45 puts a 2,048-token bench-llama prefill
    # at ~1.2 s, inside the 1.1-1.5 s SGLang's own prefill measured here. "device" and "host" are the
    # same DRAM, so the host link is the memcpy rate. Disk figures are placeholders for a VM's SSD.
    "cpu-local": HardwarePreset(
        "cpu-local",
        1,
        peak_flops=0.85e12,
        mfu=0.45,
        hbm_bandwidth=20 * GB,
        host_link_bandwidth=20 * GB,
        disk_read_bandwidth=1.5 * GB,
        disk_write_bandwidth=1.0 * GB,
        device_memory_bytes=8 * GB,
    ),
}


def get_model(name: str) -> ModelPreset:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODELS))}") from None


def get_hardware(name: str) -> HardwarePreset:
    """A preset by name; ``"cpu-measured"`` runs `measure_local()` (about 0.1 s)."""
    if name == "cpu-measured":
        return measure_local()
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; choose one of {', '.join(sorted(HARDWARE))}, cpu-measured"
        ) from None


def measure_local(
    *, matmul_size: int = 512, copy_mib: int = 64, repeats: int = 3, mfu: float = 0.45, name: str = "cpu-measured"
) -> HardwarePreset:
    """A `cpu-local`-style preset from a quick measurement of this machine (about 0.1 s).

    peak_flops = best of `repeats` bf16 matmuls (n x n x n, 2 n^3 FLOPs); hbm and host-link bandwidth =
    best of `repeats` copies of a `copy_mib` MiB tensor (bytes copied / time). Disk figures are kept from
    `cpu-local` (measuring a disk honestly takes longer than a preset should; `benchmarks/` measures it).
    Noisy by nature: use it for a report's context, never in a test's assertion.
    """
    import torch

    n = matmul_size
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    flops = 2 * n**3 / max(best, 1e-9)
    src = torch.ones(copy_mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    copy_bw = src.numel() / max(best, 1e-9)
    return HARDWARE["cpu-local"].replace(
        name=name, peak_flops=flops, mfu=mfu, hbm_bandwidth=copy_bw, host_link_bandwidth=copy_bw
    )


__all__ = [
    "HARDWARE",
    "MODELS",
    "HardwarePreset",
    "ModelPreset",
    "get_hardware",
    "get_model",
    "llama_params",
    "measure_local",
]
