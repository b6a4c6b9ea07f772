"""Write the tiny Qwen3-Next (`scripts/cpu/tiny-qwen3-next`: one gated-delta-net linear-attention layer,
one gated full-attention layer, a 4-expert MoE with a shared expert) with random weights of a
realistic scale.

    .venv-sglang/bin/python scripts/cpu/realistic_weights_qwen3_next.py OUT_DIR [--seed 0]

As for the tiny Llama (realistic_weights.py): SGLang's `--load-format dummy` weights (+-1e-3) make the
output hardly depend on the context, so equal outputs would prove nothing. These are N(0, ~1/sqrt(fan_in))
in bf16 safetensors, under the checkpoint names SGLang's `Qwen3NextForCausalLM.load_weights` reads
(the fused `in_proj_qkvz` / `in_proj_ba` layout). Serve OUT_DIR without `--load-format dummy` and with
`--mamba-radix-cache-strategy no_buffer --page-size 1 --disable-overlap-schedule` on CPU. The same seed
gives the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY = Path(__file__).resolve().parent / "tiny-qwen3-next"


def make_model(dst: Path, seed: int = 0) -> Path:
    """The tiny Qwen3-Next config with N(0, ~1/sqrt(fan_in)) weights in bf16 safetensors, written to `dst`."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((TINY / "config.json").read_text())
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd, conv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    E, moe, shared = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    key_dim, value_dim = kh * kd, vh * vd

    def w(*shape, gain=1.0):
        return (torch.randn(*shape, generator=g) * gain / shape[-1] ** 0.5).to(torch.bfloat16)

    def small(*shape):  # Gemma-style norms store weight - 1; near 0 keeps them near 1
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": torch.randn(V, h, generator=g).to(torch.bfloat16),
        "model.norm.weight": small(h),
        "lm_head.weight": w(V, h),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        if (i + 1) % cfg["full_attention_interval"] == 0:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = w(nh * hd * 2, h, gain=2.0)  # query and its output gate
            t[a + "k_proj.weight"] = w(nkv * hd, h, gain=2.0)
            t[a + "v_proj.weight"] = w(nkv * hd, h)
            t[a + "o_proj.weight"] = w(h, nh * hd)
            t[a + "q_norm.weight"] = small(hd)
            t[a + "k_norm.weight"] = small(hd)
        else:
            a = p + "linear_attn."
            t[a + "in_proj_qkvz.weight"] = w(2 * key_dim + 2 * value_dim, h, gain=2.0)
            t[a + "in_proj_ba.weight"] = w(2 * vh, h)
            t[a + "conv1d.weight"] = w(2 * key_dim + value_dim, 1, conv)
            t[a + "A_log"] = (torch.rand(vh, generator=g) * 2 - 1.5).to(torch.float32)  # decay exp(A) in ~(0.2, 1.6)
            t[a + "dt_bias"] = torch.randn(vh, generator=g).to(torch.float32)
            t[a + "norm.weight"] = torch.ones(vd, dtype=torch.bfloat16)
            t[a + "out_proj.weight"] = w(h, value_dim)
        m = p + "mlp."
        t[m + "gate.weight"] = w(E, h)
        for e in range(E):
            t[m + f"experts.{e}.gate_proj.weight"] = w(moe, h)
            t[m + f"experts.{e}.up_proj.weight"] = w(moe, h)
            t[m + f"experts.{e}.down_proj.weight"] = w(h, moe)
        t[m + "shared_expert.gate_proj.weight"] = w(shared, h)
        t[m + "shared_expert.up_proj.weight"] = w(shared, h)
        t[m + "shared_expert.down_proj.weight"] = w(h, shared)
        t[m + "shared_expert_gate.weight"] = w(1, h)
        t[p + "input_layernorm.weight"] = small(h)
        t[p + "post_attention_layernorm.weight"] = small(h)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_model(args.out_dir, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
