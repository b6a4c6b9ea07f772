"""What a client needs to know of the served model and SGLang's HTTP API does not publish (no sglang import).

The plugin adds `model_facts(...)` to SGLang's internal-state report as `sgl_hicache_model`
(`plugin._add_internal_state`, built in the scheduler from its `model_config`); the HTTP replayer
(`replay.http.probe_server`) reads it back, or falls back to `special_token_ids` of a local
`config.json`.
"""

from __future__ import annotations

from typing import Any


def special_token_ids(config: dict[str, Any]) -> list[int]:
    """Ids a model config names as special (``*_token_id`` / ``*_token_ids`` keys, also in a
    ``text_config``), sorted."""
    out: set[int] = set()
    text_config = config.get("text_config")
    for cfg in (config, text_config if isinstance(text_config, dict) else {}):
        for key, value in cfg.items():
            if not key.endswith(("_token_id", "_token_ids", "_token_index")):
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    out.add(v)
    return sorted(out)


def model_facts(vocab_size: int, context_len: int | None, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The `sgl_hicache_model` entry the plugin adds to `/server_info` (built in the scheduler)."""
    return {
        "vocab_size": int(vocab_size),
        "context_len": None if context_len is None else int(context_len),
        "special_token_ids": special_token_ids(hf_config),
    }


__all__ = ["model_facts", "special_token_ids"]
