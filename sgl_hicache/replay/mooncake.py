"""Mooncake-style JSONL traces: one request a line, prompts given as chained block hash ids.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
(extra fields are ignored). ``hash_ids`` holds one id per `block_size`-token block of the prompt, and
``len(hash_ids) == ceil(input_length / block_size)`` must hold (it does on every line of the shipped
trace); a mismatch is an error, never silently patched.

Token synthesis. Every hash id expands into `block_tokens` pseudo-random token ids drawn from
``random.Random(f"{seed}:{hash_id}")`` (string seeding is SHA-512 based, so the stream is the same on
every run, machine and Python >= 3.2), mapped into ``[token_offset, vocab_size)``; the prompt is the
concatenation, truncated to the input length. Equal ids give equal tokens; each id is expanded once
per load (a per-call cache, no global state).

Scaling. ``scale=None`` keeps ``block_tokens = block_size``. ``scale=s`` shrinks every block to ``s``
tokens and the input length to ``ceil(input_length * s / block_size)`` (so the last block keeps its
proportional share and the block count is unchanged); output lengths are not scaled.

Sessions. Mooncake lines carry no conversation id, so one is inferred. A follow-up turn's prompt is
the previous turn's prompt + its answer + a new message: it repeats every *full* block of the
previous prompt (the previous partial last block is re-cut, so its id changes). Rule: a request joins
the session of the most recent earlier request whose full-block id prefix
(``hash_ids[:input_length // block_size]``) is the *longest* prefix of this request's ids, provided
that prefix is longer than `system_prefix_blocks` (default 1: the shipped trace starts every prompt
with the same block, id 0, a shared system prompt). Otherwise the request opens a new session. Sessions
are named ``s0, s1, ...`` in order of first appearance. This is a heuristic: two conversations that
share a long template, where one prompt is exactly that template, would be merged.
"""

from __future__ import annotations

import random
from array import array
from pathlib import Path

from .trace import (
    Request,
    TraceError,
    check_positive_int,
    get_int,
    get_number,
    parse_json_object,
    read_lines,
)
from .trace import _short


class _TokenSynth:
    """Expands hash ids into token blocks, caching each id (one instance per load)."""

    def __init__(self, block_tokens: int, vocab_size: int, token_offset: int, seed: int) -> None:
        self.block_tokens = block_tokens
        self.span = vocab_size - token_offset
        self.offset = token_offset
        self.seed = seed
        self.cache: dict[int, array] = {}

    def block(self, hash_id: int) -> array:
        got = self.cache.get(hash_id)
        if got is None:
            n = self.block_tokens
            bits = random.Random(f"{self.seed}:{hash_id}").getrandbits(32 * n)
            raw = array("I")
            if raw.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte 'I'
                raw = array("L")
            raw.frombytes(bits.to_bytes(4 * n, "little"))
            span, off = self.span, self.offset
            got = array("q", [x % span + off for x in raw])
            self.cache[hash_id] = got
        return got

    def tokens(self, hash_ids: list[int], length: int) -> array:
        out = array("q")
        for h in hash_ids:
            out += self.block(h)
        del out[length:]
        return out


class _SessionIndex:
    """Trie over hash ids; a node remembers the session of the latest request whose full-block prefix ends there."""

    def __init__(self, system_prefix_blocks: int) -> None:
        self.root: dict = {}
        self.min_depth = system_prefix_blocks + 1
        self.count = 0

    _END = object()  # key of the "ends here" marker inside a trie node

    def assign(self, hash_ids: list[int], full_blocks: int) -> str:
        node = self.root
        best: str | None = None
        for depth, h in enumerate(hash_ids, start=1):
            child = node.get(h)
            if child is None:
                break
            node = child
            if depth >= self.min_depth:
                ended = node.get(self._END)
                if ended is not None:
                    best = ended
        if best is None:
            best = f"s{self.count}"
            self.count += 1
        # insert this request's full-block prefix and mark its end
        node = self.root
        for h in hash_ids[:full_blocks]:
            node = node.setdefault(h, {})
        if full_blocks >= self.min_depth:
            node[self._END] = best
        return best


def read_mooncake(
    path: str | Path,
    *,
    block_size: int = 512,
    scale: int | None = None,
    limit: int | None = None,
    vocab_size: int = 32000,
    token_offset: int = 16,
    seed: int = 0,
    system_prefix_blocks: int = 1,
    infer_sessions: bool = True,
) -> list[Request]:
    """Read a Mooncake-style JSONL trace. See the module docstring for synthesis, scaling and sessions.

    `limit` keeps the first N requests of the file. Timestamps (ms) become `arrival_s` in seconds.
    Raises TraceError (``FILE:LINE: reason``) for anything malformed, ValueError for a bad option.
    """
    check_positive_int("block_size", block_size)
    if scale is not None:
        check_positive_int("scale", scale)
    if limit is not None:
        check_positive_int("limit", limit, minimum=0)
    check_positive_int("token_offset", token_offset, minimum=0)
    check_positive_int("vocab_size", vocab_size, minimum=token_offset + 2)
    check_positive_int("system_prefix_blocks", system_prefix_blocks, minimum=0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")

    block_tokens = scale if scale is not None else block_size
    synth = _TokenSynth(block_tokens, vocab_size, token_offset, seed)
    sessions = _SessionIndex(system_prefix_blocks)
    out: list[Request] = []
    if limit == 0:
        return out
    for line, text in read_lines(path):
        obj = parse_json_object(path, line, text)
        ts = get_number(path, line, obj, "timestamp")
        input_length = get_int(path, line, obj, "input_length", minimum=1)
        output_length = get_int(path, line, obj, "output_length", minimum=0)
        if "hash_ids" not in obj:
            raise TraceError(path, line, "missing field 'hash_ids'")
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list):
            raise TraceError(path, line, f"field 'hash_ids' must be an array of integers, got {type(hash_ids).__name__}")
        for i, h in enumerate(hash_ids):
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise TraceError(path, line, f"field 'hash_ids'[{i}] must be a non-negative integer, got {_short(h)}")
        expected = -(-input_length // block_size)
        if len(hash_ids) != expected:
            raise TraceError(
                path,
                line,
                f"hash_ids has {len(hash_ids)} ids but input_length {input_length} needs "
                f"ceil({input_length}/{block_size}) = {expected} blocks of {block_size} tokens",
            )
        length = input_length if scale is None else -(-input_length * scale // block_size)
        session = sessions.assign(hash_ids, input_length // block_size) if infer_sessions else None
        out.append(
            Request(
                request_id=f"L{line}",
                session=session,
                arrival_s=ts / 1000.0,
                input_ids=synth.tokens(hash_ids, length),
                output_length=output_length,
                line=line,
            )
        )
        if limit is not None and len(out) >= limit:
            break
    out.sort(key=lambda r: r.arrival_s)
    return out


__all__ = ["read_mooncake"]
