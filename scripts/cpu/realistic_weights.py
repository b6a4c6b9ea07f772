"""Write the tiny Llama (`scripts/cpu/tiny-llama`) with random weights of a realistic scale.

    .venv-sglang/bin/python scripts/cpu/realistic_weights.py OUT_DIR [--seed 0]

SGLang's `--load-format dummy` draws weights in +-1e-3, with which the output hardly depends on the
context, so a check that cached KV gives the same greedy output as recomputing would pass even with
wrong KV. These weights are N(0, ~1/sqrt(fan_in)) in bf16 safetensors: the output depends on every
token of the context. Serve OUT_DIR without `--load-format dummy`. Needs torch and safetensors (both in
the SGLang environment). The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY = Path(__file__).resolve().parent / "tiny-llama"


def make_model(dst: Path, seed: int = 0) -> Path:
    """The tiny Llama config with N(0, ~1/sqrt(fan_in)) weights in bf16 safetensors, written to `dst`."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((TINY / "config.json").read_text())
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv, hd, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]

    def w(out_f, in_f, gain=1.0):
        return (torch.randn(out_f, in_f, generator=g) * gain / in_f**0.5).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": torch.randn(V, h, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(V, h),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(nh * hd, h, 2.0)
        t[p + "self_attn.k_proj.weight"] = w(nkv * hd, h, 2.0)
        t[p + "self_attn.v_proj.weight"] = w(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the model folder to write")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(make_model(a.out, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
