"""Requests and traces rewritten for a small server: token ids folded into a model's vocabulary
(`fold_into_vocab`), a plain-text trace cut into Mooncake-style blocks (`as_block_trace`), a slice
of recorded agent sessions (`agent_session_slice`)."""

from __future__ import annotations

import json
import shutil
import tempfile
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

from sgl_hicache.replay.agent_sessions import read_agent_sessions, session_files
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
        out.append(replace(r, input_ids=fold(r.input_ids), hints=hints))
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


def agent_session_slice(
    path: str | Path, pick: list[str] | None, calls: int | None, workdir: Path, **read: Any
) -> tuple[list[Request], list[Request]]:
    """(the calls without hints, the same calls with the framework's hints) of the recorded sessions
    at `path` (`read_agent_sessions`, its options in `read`): only the sessions named in `pick`
    (file names without ``.json``; all when None), each cut to its first `calls` calls (all when
    None). The picked files are linked into a folder under `workdir`, so the session start spread
    counts only them."""
    files = session_files(path)
    if pick is not None:
        by_name = {f.stem: f for f in files}
        missing = [n for n in pick if n not in by_name]
        if missing:
            raise ValueError(f"no session file {missing} in {path}")
        files = [by_name[n] for n in pick]
    folder = Path(tempfile.mkdtemp(prefix="sessions-", dir=workdir))
    try:
        for f in files:
            (folder / f.name).symlink_to(f.resolve())
        plain = read_agent_sessions(folder, hints=False, **read)
        hinted = read_agent_sessions(folder, hints=True, **read)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    def cut(reqs: list[Request]) -> list[Request]:
        return [r for r in reqs if calls is None or int(r.request_id.rsplit("#", 1)[1]) < calls]

    plain, hinted = cut(plain), cut(hinted)
    assert [r.request_id for r in plain] == [r.request_id for r in hinted]
    return plain, hinted
