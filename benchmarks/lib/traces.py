"""Requests and traces rewritten for a small server: token ids folded into a model's vocabulary
(`fold_into_vocab`), a plain-text trace cut into Mooncake-style blocks (`as_block_trace`)."""

from __future__ import annotations

import json
from array import array
from dataclasses import replace
from pathlib import Path

from sgl_hicache.replay.trace import Request

FLOOR = 16  # folded ids start here (below: special tokens of the tiny model)


def fold_into_vocab(requests: list[Request], vocab: int) -> list[Request]:
    """The requests with every token id (prompts and hints' prefixes) mapped into [FLOOR, vocab) by a
    fixed function of the id (Knuth's multiplicative hash), so that equal prefixes stay equal and
    different ones differ (up to a collision of a whole page of ids)."""
    span = vocab - FLOOR

    def fold(ids) -> array:
        return array("q", (FLOOR + (int(t) * 2654435761 >> 7) % span for t in ids))

    out = []
    for r in requests:
        hints = tuple(replace(h, input_ids=tuple(fold(h.input_ids))) if h.input_ids else h for h in r.hints)
        out.append(
            Request(r.request_id, r.session, r.arrival_s, fold(r.input_ids), r.output_length, r.line, hints=hints)
        )
    return out


CHARS_PER_BLOCK = 2048  # ~512 tokens of English / JSON text (4 characters a token)


def as_block_trace(text_trace: Path, out: Path) -> Path:
    """A plain-text JSONL trace (`prompt`, `output_length`, `timestamp` in s) rewritten as a
    Mooncake-style block trace: each prompt cut into 2,048-character blocks (~512 tokens), each
    block named by a chained id (equal prefixes, equal ids), so `--scale 16` shrinks it like the
    shipped trace. The agentic prompts (4k-27k tokens of tool documentation and history) would not
    fit the README's 1,024-token pool and 4,096-token context otherwise; the sharing is kept."""
    ids: dict[tuple[int, str], int] = {}
    lines = []
    for raw in text_trace.read_text().splitlines():
        if not raw.strip():
            continue
        row = json.loads(raw)
        text = row["prompt"]
        blocks = [text[i : i + CHARS_PER_BLOCK] for i in range(0, len(text), CHARS_PER_BLOCK)] or [""]
        parent, hash_ids = -1, []
        for b in blocks:
            parent = ids.setdefault((parent, b), len(ids))
            hash_ids.append(parent)
        tail_tokens = max(1, -(-len(blocks[-1]) // 4))
        lines.append(
            {
                "timestamp": int(float(row.get("timestamp", 0)) * 1000),
                "output_length": int(row.get("output_length", 16)),
                "input_length": 512 * (len(blocks) - 1) + min(tail_tokens, 512),
                "hash_ids": hash_ids,
            }
        )
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out
