"""Fuzz: whatever bytes a trace file holds, a reader either succeeds or raises TraceError, nothing else."""

from __future__ import annotations

import json
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_hicache.replay import (
    Request,
    TraceError,
    load_trace,
    read_agent_sessions,
    read_azure,
    read_mooncake,
    read_plain,
    read_sglang_bench,
    read_sharegpt,
)

GOOD_MOONCAKE = [
    '{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}',
    '{"timestamp": 10, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}',
]
GOOD_LMBENCH = [
    '{"timestamp": "1753780607550317897", "input_length": 101, "output_length": 5, "hash_ids": [2843241808, 137021281, 38]}',
    '{"timestamp": "1753780583232023294", "input_length": 95, "output_length": 3, "hash_ids": [2843241808, 137021281]}',
]
GOOD_AZURE = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:15:46.6805900,374,44",
    "2023-11-16 18:15:50.9951690,39,109",
]
GOOD_BENCH = [
    '{"request_rate": 4.0, "input_lens": [12, 30], "output_lens": [5, 0]}',
    '{"timestamp": 5012.25, "user_data": {"user_id": 0, "current_round": 0, "prompt": "hi", "return_tokens": 4}}',
]
GOOD_PLAIN = [
    '{"session": "a", "prompt": "hello", "output_length": 4, "timestamp": 0.5}',
    '{"session": 2, "input_ids": [1, 2, 3], "output_length": 0}',
]
GOOD_SHAREGPT = [
    '[{"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},',
    ' {"id": "y", "conversations": [{"from": "system", "value": "s"}, {"from": "user", "value": "q"}]}]',
]
GOOD_AGENT = [
    '{"id": "s", "block_size": 4, "hash_id_scope": "local", "requests": [{"t": 0, "type": "n", "in": 9, "out": 2, '
    '"hash_ids": [1, 2], "input_types": ["text"], "stop": "tool_use", "api_time": 1.5}, {"t": 3, "type": "s", '
    '"in": 13, "out": 1, "hash_ids": [1, 2, 3, 4], "stop": "end_turn"}, {"t": 4, "type": "subagent"}]}',
]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
        "session",
        "prompt",
        "input_ids",
        "id",
        "conversations",
        "from",
        "value",
        "messages",
        "role",
        "content",
        "input_lens",
        "output_lens",
        "request_rate",
        "details",
        "user_data",
        "summary",
        "requests",
        "block_size",
        "hash_id_scope",
        "type",
        "stop",
        "in",
        "t",
    ]
)
# objects with the right keys and random values: reach the validation code, not just the JSON parser
keyed_objects = st.dictionaries(field_names, json_values, max_size=6)


@st.composite
def mutated(draw, lines):
    text = "\n".join(lines)
    b = bytearray(text.encode())
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[i] = (
                draw(st.sampled_from(list(b'{}[],:"-0123456789.eE \n\xff')))
                if draw(st.booleans())
                else draw(st.integers(0, 255))
            )
        elif op == "delete":
            del b[i : i + draw(st.integers(1, 8))]
        elif op == "insert":
            b[i:i] = draw(
                st.sampled_from([b"-", b"1e999", b"NaN", b'"', b"[", b"]", b"9" * 30, b"null", b"true", b"\n"])
            )
        else:
            del b[i:]
    return bytes(b)


def lines_of(values) -> bytes:
    return "\n".join(json.dumps(v, allow_nan=True) for v in values).encode()


def run_all(data: bytes) -> None:
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for call in (
            lambda: read_mooncake(path),
            lambda: read_mooncake(path, block_size=16, scale=4),
            lambda: read_plain(path),
            lambda: read_mooncake(path, block_size=16, block_coverage="varying"),
            lambda: read_sharegpt(path),
            lambda: read_azure(path),
            lambda: read_sglang_bench(path),
            lambda: read_agent_sessions(path),
            lambda: read_agent_sessions(path, block_scale=2, gap_cap_s=1.0, hint_estimate_error=0.5),
            lambda: load_trace(path),
        ):
            try:
                got = call()
            except TraceError as e:
                assert str(e).startswith(f"{path}:"), str(e)
            else:
                assert isinstance(got, list) and all(isinstance(r, Request) for r in got)
                assert all(r.output_length >= 0 and len(r.input_ids) > 0 and r.arrival_s >= 0 for r in got)
                assert all(isinstance(n.message, str) and n.count >= 1 for n in got.notes)
    finally:
        os.unlink(path)


fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(
    st.one_of(
        mutated(GOOD_MOONCAKE),
        mutated(GOOD_LMBENCH),
        mutated(GOOD_PLAIN),
        mutated(GOOD_SHAREGPT),
        mutated(GOOD_AZURE),
        mutated(GOOD_BENCH),
        mutated(GOOD_AGENT),
    )
)
def test_mutated_good_files(data):
    run_all(data)


@fuzz
@given(st.lists(st.one_of(keyed_objects, json_values), min_size=0, max_size=4))
def test_random_json_lines(values):
    run_all(lines_of(values))


@fuzz
@given(st.binary(max_size=200))
def test_random_bytes(data):
    run_all(data)


@fuzz
@given(
    st.lists(
        st.fixed_dictionaries(
            {"from": st.one_of(st.sampled_from(["human", "gpt", "system"]), json_values), "value": json_values}
        ),
        max_size=4,
    ),
    json_values,
)
def test_random_conversations(turns, cid):
    run_all(json.dumps([{"id": cid, "conversations": turns}]).encode())
