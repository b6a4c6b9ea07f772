#!/usr/bin/env python
"""Which hybrid model kinds SGLang 0.5.23 itself serves on this CPU: tiny configs, dummy weights, SGLang's
default radix cache (not this backend), one greedy request each. Prints one line per kind and writes
JSON (`--out`): "serves" or the error that stopped it and where (file:line).

    .venv-sglang/bin/python scripts/cpu/probe_kinds.py --out /tmp/probe_kinds.json [--only qwen3-next]

Run one server at a time (each takes ~30-60 s to fail or serve on 2 cores). Findings:
docs/coverage.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

_COMMON = {
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "eos_token_id": 2,
    "bos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}

_V3 = json.loads((Path(__file__).parent / "tiny-deepseek-v3" / "config.json").read_text())

KINDS: dict[str, tuple[dict, list[str]]] = {
    # hybrid sliding window, attention sinks, MoE
    "gpt-oss": (
        {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "experts_per_token": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "swiglu_limit": 7.0,
            "hidden_act": "silu",
        },
        [],
    ),
    # hybrid sliding window, dense, attention sinks
    "granite-swa": (
        {
            "architectures": ["GraniteSWAForCausalLM"],
            "model_type": "granite_swa",
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "layer_rope_theta": [10000.0, 10000.0],
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "pad_token_id": 0,
        },
        [],
    ),
    # hybrid linear attention (gated delta net) + MoE; SGLang's CPU path needs its no_buffer mamba strategy
    "qwen3-next": (
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "attention_bias": False,
        },
        ["--mamba-radix-cache-strategy", "no_buffer", "--page-size", "1", "--disable-overlap-schedule"],
    ),
    # DSA (DeepSeek V3.2): scripts/cpu/tiny-deepseek-v3's MLA + MoE with the indexer's fields (index_topk
    # makes SGLang take the DSA pool and attention); 64-token pages, as SGLang's DSA pool asserts
    "deepseek-v32": (
        {
            **{k: v for k, v in _V3.items() if k not in ("num_nextn_predict_layers", "num_key_value_heads")},
            "architectures": ["DeepseekV32ForCausalLM"],
            "num_key_value_heads": 4,
            "index_topk": 64,
            "index_n_heads": 4,
            "index_head_dim": 128,
        },
        ["--page-size", "64"],
    ),
}


def _first_error(log: str) -> str:
    """The last exception line of a server log, with the innermost sglang frame it came from."""
    frames = re.findall(r'File "[^"]*/site-packages/(sglang/[^"]+)", line (\d+)', log)
    errors = [ln for ln in log.splitlines() if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    where = f" ({frames[-1][0]}:{frames[-1][1]})" if frames else ""
    return (errors[-1] if errors else "no exception in the log") + where


def probe(name: str, workdir: Path) -> dict:
    from sgl_hicache.client.server import ServerStartError, SGLangServer

    cfg, args = KINDS[name]
    model = workdir / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**_COMMON, **cfg}, indent=1))
    log = workdir / f"{name}.log"
    try:
        srv = SGLangServer.start(
            model,
            log_path=log,
            timeout_s=300,
            extra_args=["--max-total-tokens", "1024", "--log-level", "warning", *args],
        )
    except ServerStartError:
        return {"kind": name, "serves": False, "error": _first_error(log.read_text(errors="replace")), "stage": "start"}
    try:
        body = json.dumps(
            {"input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        )
        req = urllib.request.Request(
            srv.url + "/generate", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            out = json.loads(urllib.request.urlopen(req, timeout=120).read())
            return {"kind": name, "serves": True, "output_ids": out.get("output_ids")}
        except OSError as exc:
            return {
                "kind": name,
                "serves": False,
                "stage": "first request",
                "error": _first_error(log.read_text(errors="replace")) or str(exc),
            }
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the findings")
    ap.add_argument("--only", choices=sorted(KINDS), action="append", help="probe only these kinds")
    a = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="probe_kinds-") as tmp:
        for name in a.only or sorted(KINDS):
            r = probe(name, Path(tmp))
            print(f"{name}: {'serves' if r['serves'] else 'fails at ' + r['stage'] + ': ' + r['error']}", flush=True)
            results.append(r)
    a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
