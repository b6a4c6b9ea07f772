"""Cost model against hand-computed figures, and the presets against their sources."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from sgl_hicache.config import KVLayout
from sgl_hicache.sim.cost import (
    attention_flops,
    batch_prefill_seconds,
    decode_step_seconds,
    kv_transfer_seconds,
    prefill_flops,
    prefill_seconds,
    transfer_seconds,
    weight_read_bytes,
)
from sgl_hicache.sim.presets import (
    HARDWARE,
    MODELS,
    HardwarePreset,
    ModelPreset,
    get_hardware,
    get_model,
    llama_params,
    measure_local,
)

# A toy model and machine whose figures are easy to work by hand.
# L=2, H=2, d=4 -> 4*L*H*d = 64; P = 1000 params, bf16 -> 2000 weight bytes; KV/token = 2*2*1*4*2 = 32 B.
TOY = ModelPreset(
    "toy",
    num_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    num_kv_heads=1,
    head_dim=4,
    dtype="bfloat16",
    total_params=1000,
    active_params=1000,
)
# sustained 1e6 * 0.5 = 5e5 FLOP/s; HBM 1e5 B/s
HW = HardwarePreset(
    "toy-hw",
    1,
    peak_flops=1e6,
    mfu=0.5,
    hbm_bandwidth=1e5,
    host_link_bandwidth=1e4,
    disk_read_bandwidth=2e3,
    disk_write_bandwidth=1e3,
    device_memory_bytes=1e9,
)


def test_prefill_hand_computed():
    # n=10, c=20: 2*1000*10 = 20,000 + 64*(10*20 + 100/2) = 16,000 -> 36,000 FLOPs -> 0.072 s
    assert attention_flops(TOY, 10, 20) == 16_000
    assert prefill_flops(TOY, 10, 20) == 36_000
    assert prefill_seconds(TOY, HW, 10, 20) == pytest.approx(0.072)
    # weight floor: n=1 -> 2,032 FLOPs = 0.004064 s, but 2,000 B / 1e5 B/s = 0.02 s
    assert prefill_seconds(TOY, HW, 1, 0) == pytest.approx(0.02)
    assert prefill_seconds(TOY, HW, 0, 50) == 0.0
    # two GPUs: twice the FLOP/s and the HBM bandwidth
    assert prefill_seconds(TOY, HW.replace(num_gpus=2), 10, 20) == pytest.approx(0.036)
    # the cache only helps: more cached tokens never makes the new ones cheaper, fewer new ones never dearer
    assert prefill_seconds(TOY, HW, 30, 0) > prefill_seconds(TOY, HW, 10, 20)


def test_batch_prefill_reads_weights_once():
    # (10, 20) + (5, 0): FLOPs 36,000 + (10,000 + 64*12.5 = 800) = 46,800 -> 0.0936 s; weights 0.02 s
    assert batch_prefill_seconds(TOY, HW, [(10, 20), (5, 0)]) == pytest.approx(0.0936)
    assert batch_prefill_seconds(TOY, HW, []) == 0.0


def test_decode_hand_computed():
    # B=4, T=100: FLOPs 2*1000*4 + 64*100 = 14,400 -> 0.0288 s; bytes 2,000 + 100*32 = 5,200 -> 0.052 s
    assert decode_step_seconds(TOY, HW, 100, 4) == pytest.approx(0.052)
    # compute-bound when HBM is fast: 1e7 B/s -> 0.00052 s < 0.0288 s
    assert decode_step_seconds(TOY, HW.replace(hbm_bandwidth=1e7), 100, 4) == pytest.approx(0.0288)
    assert decode_step_seconds(TOY, HW, 0, 0) == 0.0


def test_moe_reads_only_touched_weights():
    moe = TOY.replace(name="toy-moe", active_params=100)
    assert moe.is_moe and not TOY.is_moe
    assert weight_read_bytes(moe, 3) == 600  # 3 tokens x 100 params x 2 B
    assert weight_read_bytes(moe, 50) == 2000  # capped at every weight
    assert weight_read_bytes(TOY, 1) == 2000
    # FLOPs use the active parameters: n=10, c=0 -> 2*100*10 + 64*50 = 5,200
    assert prefill_flops(moe, 10, 0) == 5_200


def test_transfers():
    assert transfer_seconds(1e9, 5e8) == pytest.approx(2.0)
    assert transfer_seconds(1e9, 5e8, latency_s=0.1) == pytest.approx(2.1)
    assert transfer_seconds(0, 5e8, latency_s=0.1) == 0.0
    for bad in (0, -1.0, None):
        with pytest.raises(ValueError):
            transfer_seconds(10, bad)
    with pytest.raises(ValueError):
        transfer_seconds(-1, 10)
    # 100 tokens x 32 B over the disk read link (2,000 B/s) = 1.6 s; host->device 1e4 B/s = 0.32 s
    assert kv_transfer_seconds(TOY, HW, 100, "disk", "host") == pytest.approx(1.6)
    assert kv_transfer_seconds(TOY, HW, 100, "host", "device") == pytest.approx(0.32)
    assert kv_transfer_seconds(TOY, HW, 100, "host", "disk") == pytest.approx(3.2)
    with pytest.raises(ValueError):
        HW.link_bandwidth("device", "disk")


def test_bad_inputs():
    with pytest.raises(ValueError):
        prefill_seconds(TOY, HW, -1, 0)
    with pytest.raises(ValueError):
        decode_step_seconds(TOY, HW, -5, 2)
    with pytest.raises(ValueError):
        ModelPreset("x", 0, 8, 2, 1, 4, "bfloat16", 10, 10)
    with pytest.raises(ValueError):
        ModelPreset("x", 1, 8, 2, 1, 4, "bfloat16", 10, 20)  # active > total
    with pytest.raises(ValueError):
        HW.replace(mfu=1.5)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_model("gpt-9")
    with pytest.raises(ValueError, match="unknown hardware preset"):
        get_hardware("tpu")


def test_presets_match_their_sources():
    for m in MODELS.values():
        layout = m.kv_layout()
        assert isinstance(layout, KVLayout) and layout.bytes_per_token == m.kv_bytes_per_token
    assert MODELS["llama3-8b"].kv_bytes_per_token == 128 * 1024  # the well-known 128 KiB/token
    assert MODELS["qwen2.5-32b"].kv_bytes_per_token == 256 * 1024
    big = MODELS["qwen3-coder-480b-a35b"]
    assert (big.num_layers, big.num_kv_heads, big.head_dim, big.active_params) == (62, 8, 128, 35e9) and big.is_moe
    assert MODELS["bench-llama"].total_params == 96_486_400
    # the tiny model the SGLang tests serve must agree with the preset
    for tiny_cfg in (REPO / "scripts" / "cpu" / "tiny-llama" / "config.json",):
        c = json.loads(tiny_cfg.read_text())
        t = MODELS["tiny-llama"]
        assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_kv_heads, t.head_dim) == (
            c["num_hidden_layers"],
            c["hidden_size"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        ), tiny_cfg
        assert t.total_params == llama_params(
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            vocab=c["vocab_size"],
        ), tiny_cfg
    for name in ("h200", "8xh200", "cpu-local"):
        assert get_hardware(name) is HARDWARE[name]
    assert HARDWARE["8xh200"].link_bandwidth("host", "device") == 8 * HARDWARE["h200"].link_bandwidth("host", "device")
    assert 50e9 <= HARDWARE["h200"].host_link_bandwidth <= 55e9  # PCIe Gen5 x16 effective


def test_cpu_local_preset_matches_the_measured_prefill():
    # measured: a 2,048-token bench-llama prefill takes ~1.1-1.5 s in SGLang on this machine
    assert 1.0 <= prefill_seconds(MODELS["bench-llama"], HARDWARE["cpu-local"], 2048, 0) <= 1.6


def test_measure_local_returns_a_usable_preset():
    hw = measure_local(matmul_size=128, copy_mib=4, repeats=1)
    assert hw.peak_flops > 0 and hw.hbm_bandwidth > 0 and hw.num_gpus == 1
    assert prefill_seconds(MODELS["tiny-llama"], hw, 16, 0) > 0
