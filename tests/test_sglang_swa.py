"""End to end with a hybrid sliding-window pool: the real SGLang 0.5.23 CPU server, a tiny Granite SWA
config (`scripts/cpu/tiny-granite-swa`: 3 layers, window, full, window; a 64-token window; attention
sinks in every layer), random weights of realistic scale. SGLang builds an `SWAKVPool` (the full
layer's KV in one sub-pool, the window layers' in another, reached through SGLang's full -> window
slot mapping); the CPU test layer's reference attention (`sglang/cpu_attention.py`) gives
`torch_native` the sinks and the window-layer reads it lacks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import NEEDS_SGLANG

pytestmark = NEEDS_SGLANG

REPO = Path(__file__).resolve().parent.parent
TINY_SWA = REPO / "scripts" / "cpu" / "tiny-granite-swa"
PAGE, HIT, VOCAB = 16, 304, 1024


def make_swa_model(dst: Path, seed: int = 0) -> Path:
    """The tiny Granite SWA config with N(0, ~1/sqrt(fan_in)) weights and N(0, 1) sinks, bf16 safetensors."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((TINY_SWA / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, inter, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(out_f, in_f, gain=1.0):
        return (torch.randn(out_f, in_f, generator=g) * gain / in_f**0.5).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": torch.randn(V, h, generator=g).to(torch.bfloat16),
         "model.norm.weight": ones(h), "lm_head.weight": w(V, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(nh * hd, h, 2.0)
        t[p + "self_attn.k_proj.weight"] = w(nkv * hd, h, 2.0)
        t[p + "self_attn.v_proj.weight"] = w(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        t[p + "self_attn.sinks"] = torch.randn(nh, generator=g).to(torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
    save_file(t, str(dst / "model.safetensors"))
    return dst
