"""Mooncake-style JSONL traces: one request a line, prompts given as chained block hash ids.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
(extra fields are ignored). ``hash_ids`` holds one id per block of the prompt.

Block coverage. In the Mooncake traces every id covers `block_size` tokens, so
``len(hash_ids) == ceil(input_length / block_size)`` on every line (the shipped trace holds to it).
Other producers (LMBench's published traces) cut blocks of a varying size (~32-36 tokens there), so
the ids do not fit any block size. `block_coverage` says what to do: ``"fixed"`` refuses a line that
does not fit (``FILE:LINE``); ``"varying"`` takes ``input_length`` as truth and gives each hash id
the token count it is first seen with (see `_VaryingSynth`); ``"auto"`` (default) is ``"fixed"`` when
every line read fits and ``"varying"`` otherwise, with a note naming the first line that does not.

Token synthesis. Every hash id expands into pseudo-random token ids drawn from
a counter-based generator keyed by ``f"{seed}:{hash_id}"`` (`TokenSynth`), mapped into ``[token_offset, vocab_size)``;
the prompt is the concatenation, truncated to the input length. Equal ids give equal tokens; each id
is expanded once per load (a per-call cache, no global state).

Timestamps are milliseconds from the trace start, or (noted) absolute times since the epoch in s, ms,
us or ns told apart by magnitude, written as numbers or strings of digits (`timestamps_to_seconds`).

Scaling. ``scale=None`` keeps ``block_tokens = block_size``. ``scale=s`` shrinks every block to ``s``
tokens and the input length to ``ceil(input_length * s / block_size)`` (so the last block keeps its
proportional share and the block count is unchanged); output lengths are not scaled.

Sessions. Mooncake lines carry no conversation id, so one is inferred. A follow-up turn's prompt is
the previous turn's prompt + its answer + a new message: it repeats every *full* block of the
previous prompt (the previous partial last block is re-cut, so its id changes). Rule: a request joins
the session of the most recent earlier request whose full-block id prefix
(``hash_ids[:input_length // block_size]``; with varying blocks every id but the last) is the
*longest* prefix of this request's ids, provided that prefix is longer than `system_prefix_blocks`
(default 1: the shipped trace starts every prompt with the same block, id 0, a shared system prompt).
Otherwise the request opens a new session. Sessions are named ``s0, s1, ...`` in order of first
appearance. This is a heuristic: two conversations that share a long template, where one prompt is
exactly that template, would be merged.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from pathlib import Path

from .trace import (
    ReadNotes,
    Request,
    TokenSynth,
    Trace,
    TraceError,
    check_positive_int,
    check_synth_options,
    get_hash_ids,
    get_int,
    get_timestamp,
    parse_json_object,
    read_lines,
    sort_by_arrival,
    timestamps_to_seconds,
)

COVERAGES = ("auto", "fixed", "varying")


class _FixedSynth:
    """Every hash id is `block_tokens` tokens (cached per id; with `max_blocks`, the most recently
    used `max_blocks` ids only, so a streamed trace's memory does not grow with its length)."""

    def __init__(self, synth: TokenSynth, block_tokens: int, max_blocks: int | None = None) -> None:
        self.synth = synth
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        # an OrderedDict, not a dict: dropping a dict's first key over and over leaves a run of deleted
        # slots that `next(iter(d))` walks every time (40 % of a streamed trace's reading)
        self.cache: OrderedDict[int, array] = OrderedDict()

    def tokens(self, hash_ids: list[int], length: int) -> array:
        blocks = []
        cache, bounded = self.cache, self.max_blocks is not None
        # the ids not cached, drawn together (one vectorised mapping for all of them)
        new = [h for h in dict.fromkeys(hash_ids) if h not in cache]
        fresh = dict(zip(new, self.synth.tokens_many(new, self.block_tokens))) if new else {}
        for h in hash_ids:
            block = cache.pop(h, None) if bounded else cache.get(h)
            if block is None:
                block = fresh.get(h)
                if block is None:  # cached a moment ago, but pushed out by this very request's ids
                    block = self.synth.tokens(h, self.block_tokens)
                if bounded and len(cache) >= self.max_blocks:  # type: ignore[operator]
                    cache.popitem(last=False)  # the least recently used id
            cache[h] = block
            blocks.append(block)
        out = array("q")
        out.frombytes(memoryview(b"".join(blocks))[: 8 * length])  # two copies, no regrowth
        return out


class _VaryingSynth:
    """Hash ids that cover a varying number of tokens; the request's length is the truth.

    Each id keeps the token count it is first given, so two requests that share their first k ids
    share the tokens of those k blocks. A request's ids not seen before share what its known ids leave
    of its length, as evenly as possible, the earlier ones taking the remainder (so the last block is
    the shorter one), each at least 1 token. The prompt is the concatenation, cut to the length; when
    the ids fall short (all known, and smaller than this request says) it is padded with tokens drawn
    for ``"<last id>+pad"``.
    """

    def __init__(self, synth: TokenSynth) -> None:
        self.synth = synth
        self.cache: dict[int, array] = {}

    def tokens(self, hash_ids: list[int], length: int) -> array:
        cache = self.cache
        new = list(dict.fromkeys(h for h in hash_ids if h not in cache))
        left = length - sum(len(cache[h]) for h in hash_ids if h in cache)
        if new and left > 0:
            q, r = divmod(left, len(new))
            for j, h in enumerate(new):
                cache[h] = self.synth.tokens(h, max(1, q + (j < r)))
        out = array("q")
        for h in hash_ids:
            block = cache.get(h)
            if block is None:  # the known ids already fill the prompt: this id is not reached
                break
            out += block
            if len(out) >= length:
                break
        del out[length:]
        if len(out) < length:
            out += self.synth.tokens(f"{hash_ids[-1]}+pad", length - len(out))
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


def check_options(
    block_size: int, scale: int | None, limit: int | None, vocab_size: int, token_offset: int, seed: int
) -> None:
    """The options every Mooncake reader takes (ValueError naming the bad one)."""
    check_positive_int("block_size", block_size)
    if scale is not None:
        check_positive_int("scale", scale)
    if limit is not None:
        check_positive_int("limit", limit, minimum=0)
    check_synth_options(vocab_size, token_offset, seed)


def parse_row(
    path: str | Path, line: int, text: str, notes: ReadNotes, block_size: int, block_coverage: str
) -> tuple[int | float, int, int, list[int], bool]:
    """One line: (raw timestamp, input_length, output_length, hash_ids, whether the ids fit
    `block_size`). Raises TraceError for anything malformed, and for a misfit under "fixed"."""
    obj = parse_json_object(path, line, text)
    ts = get_timestamp(path, line, obj, "timestamp", notes)
    input_length = get_int(path, line, obj, "input_length", minimum=1)
    output_length = get_int(path, line, obj, "output_length", minimum=0)
    hash_ids = get_hash_ids(path, line, obj)
    expected = -(-input_length // block_size)
    fits = len(hash_ids) == expected
    if not fits and (block_coverage == "fixed" or not hash_ids):
        raise TraceError(
            path,
            line,
            f"hash_ids has {len(hash_ids)} ids but input_length {input_length} needs "
            f"ceil({input_length}/{block_size}) = {expected} blocks of {block_size} tokens",
        )
    return ts, input_length, output_length, hash_ids, fits


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
    block_coverage: str = "auto",
) -> Trace:
    """Read a Mooncake-style JSONL trace. See the module docstring for coverage, synthesis, scaling
    and sessions.

    `limit` keeps the first N requests of the file. Timestamps become `arrival_s` in seconds.
    Raises TraceError (``FILE:LINE: reason``) for anything malformed, ValueError for a bad option.
    The returned `Trace` carries the read's notes.
    """
    check_options(block_size, scale, limit, vocab_size, token_offset, seed)
    check_positive_int("system_prefix_blocks", system_prefix_blocks, minimum=0)
    if block_coverage not in COVERAGES:
        raise ValueError(f"block_coverage must be one of {', '.join(COVERAGES)}, got {block_coverage!r}")

    notes = ReadNotes()
    if limit == 0:
        return Trace([], notes)
    rows: list[tuple[int, int | float, int, int, list[int]]] = []
    misfit: tuple[int, int, int] | None = None  # (line, ids, input_length) of the first line that does not fit
    for line, text in read_lines(path):
        ts, input_length, output_length, hash_ids, fits = parse_row(path, line, text, notes, block_size, block_coverage)
        if not fits and misfit is None:
            misfit = (line, len(hash_ids), input_length)
        rows.append((line, ts, input_length, output_length, hash_ids))
        if limit is not None and len(rows) >= limit:
            break

    varying = block_coverage == "varying" or (block_coverage == "auto" and misfit is not None)
    if varying and misfit is not None:
        line, n, length = misfit
        notes.add(
            "varying-blocks",
            path,
            line,
            f"hash_ids cover a varying number of tokens ({n} ids for input_length {length}, not "
            f"ceil({length}/{block_size}) = {-(-length // block_size)}): input_length is taken as truth "
            f"and each hash id keeps the token count it is first seen with",
        )
    synth = TokenSynth(vocab_size, token_offset, seed)
    blocks = _VaryingSynth(synth) if varying else _FixedSynth(synth, scale if scale is not None else block_size)
    arrivals = timestamps_to_seconds(path, [(r[0], r[1]) for r in rows], "ms", notes)
    sessions = _SessionIndex(system_prefix_blocks)
    out: list[Request] = []
    for (line, _, input_length, output_length, hash_ids), arrival in zip(rows, arrivals):
        length = input_length if scale is None else -(-input_length * scale // block_size)
        full_blocks = len(hash_ids) - 1 if varying else input_length // block_size
        session = sessions.assign(hash_ids, full_blocks) if infer_sessions else None
        out.append(
            Request(
                request_id=f"L{line}",
                session=session,
                arrival_s=arrival,
                input_ids=blocks.tokens(hash_ids, length),
                output_length=output_length,
                line=line,
            )
        )
    return sort_by_arrival(out, notes)


__all__ = ["read_mooncake"]
