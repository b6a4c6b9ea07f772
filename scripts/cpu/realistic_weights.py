"""Write the tiny Llama (`scripts/cpu/tiny-llama`) with random weights of a realistic scale.

    .venv-sglang/bin/python scripts/cpu/realistic_weights.py OUT_DIR [--seed 0] [--tokenizer]

SGLang's `--load-format dummy` draws weights in +-1e-3, with which the output hardly depends on the
context, so a check that cached KV gives the same greedy output as recomputing would pass even with
wrong KV. These weights are N(0, ~1/sqrt(fan_in)) in bf16 safetensors: the output depends on every
token of the context. Serve OUT_DIR without `--load-format dummy`. Needs torch and safetensors (both in
the SGLang environment). The same seed gives the same files.

`--tokenizer` (`make_model(..., tokenizer=True)`) adds a tokenizer made here, nothing downloaded: a
word-level one whose 1,024 words are the model's ids (`<unk>` `<s>` `</s>` `<pad>`, four role
markers `<|system|>` `<|user|>` `<|assistant|>` `<|tool|>`, then `t8` ... `t1023`, id i spelled
`t<i>`), words split on whitespace, with a chat template. A server started without
`--skip-tokenizer-init` then serves `/v1/chat/completions` and text prompts: the text `"t40 t977"`
is the ids [40, 977] (`tiny_text`), and a chat renders as `<s>` then `<|role|> content` per
message, then `<|assistant|>`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY = Path(__file__).resolve().parent / "tiny-llama"
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_text(ids) -> str:
    """The text the tiny tokenizer encodes as `ids` (each >= 8, below the special ids' end)."""
    assert all(i >= len(SPECIAL) for i in ids), ids
    return " ".join(f"t{i}" for i in ids)


def write_tokenizer(dst: Path, vocab_size: int) -> None:
    """`tokenizer.json` + `tokenizer_config.json` of the tiny word-level tokenizer (module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL)}
    vocab |= {f"t{i}": i for i in range(len(SPECIAL), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in SPECIAL])
    tok.save(str(dst / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_model(dst: Path, seed: int = 0, tokenizer: bool = False) -> Path:
    """The tiny Llama config with N(0, ~1/sqrt(fan_in)) weights in bf16 safetensors, written to `dst`;
    with `tokenizer`, its tokenizer and chat template too (module doc)."""
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
    if tokenizer:
        write_tokenizer(dst, V)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the model folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", action="store_true", help="write its tokenizer and chat template too")
    a = ap.parse_args(argv)
    print(make_model(a.out, a.seed, a.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
