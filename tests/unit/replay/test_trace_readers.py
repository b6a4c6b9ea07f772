"""Trace readers: good input, bad input (each error names file and line), determinism, the shipped trace."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest
from conftest import mooncake_trace

from sgl_hicache.replay import (
    ByteTokenizer,
    Request,
    TraceError,
    detect_format,
    load_trace,
    read_mooncake,
    read_plain,
    read_sharegpt,
)


def write(tmp_path: Path, name: str, lines: list) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def mc(ts=0, n=1000, out=10, ids=(0, 1)):
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids)}


def assert_trace_error(excinfo, path: Path, line: int, *words: str) -> None:
    msg = str(excinfo.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    assert excinfo.value.line == line
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------- Mooncake


def test_mooncake_good(tmp_path):
    p = write(tmp_path, "t.jsonl", [mc(0, 1000, 10, [0, 1]), mc(1500, 513, 3, [0, 2])])
    reqs = read_mooncake(p)
    assert [r.request_id for r in reqs] == ["L1", "L2"]
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert [len(r.input_ids) for r in reqs] == [1000, 513]
    assert [r.output_length for r in reqs] == [10, 3]
    assert isinstance(reqs[0].input_ids, array) and reqs[0].input_ids.typecode == "q"
    # equal leading id -> equal leading 512 tokens; different ids differ
    assert reqs[0].input_ids[:512] == reqs[1].input_ids[:512]
    assert reqs[0].input_ids[512:1000] != reqs[1].input_ids[512:1000]
    assert all(16 <= t < 32000 for r in reqs for t in r.input_ids)


def test_mooncake_block_size_scale_and_vocab(tmp_path):
    p = write(tmp_path, "t.jsonl", [mc(0, 100, 1, [5, 6, 7, 8]), mc(0, 65, 1, [5, 6, 9])])
    reqs = read_mooncake(p, block_size=32)
    assert [len(r.input_ids) for r in reqs] == [100, 65]
    scaled = read_mooncake(p, block_size=32, scale=4, vocab_size=100, token_offset=10)
    assert [len(r.input_ids) for r in scaled] == [13, 9]  # ceil(100*4/32), ceil(65*4/32)
    assert scaled[0].input_ids[:8] == scaled[1].input_ids[:8]
    assert all(10 <= t < 100 for r in scaled for t in r.input_ids)


def test_mooncake_equal_ids_equal_tokens_across_positions_and_loads(tmp_path):
    p = write(tmp_path, "t.jsonl", [mc(0, 1024, 1, [3, 4]), mc(0, 1024, 1, [4, 3])])
    a, b = read_mooncake(p)
    assert a.input_ids[:512] == b.input_ids[512:] and a.input_ids[512:] == b.input_ids[:512]
    again = read_mooncake(p)
    assert [r.input_ids for r in again] == [a.input_ids, b.input_ids]
    assert read_mooncake(p, seed=1)[0].input_ids != a.input_ids


def test_mooncake_sessions(tmp_path):
    lines = [
        mc(0, 1100, 1, [0, 1, 2]),  # s0: full blocks (0, 1)
        mc(1, 1100, 1, [0, 5, 6]),  # only the system block in common -> s1
        mc(2, 2000, 1, [0, 1, 7, 8]),  # extends s0's full blocks -> s0
        mc(3, 2600, 1, [0, 1, 7, 8, 9, 10]),  # extends the previous turn -> s0
        mc(4, 600, 1, [0, 5]),  # s1's full blocks are (0, 5)... this one *is* that prefix, but 600 < 1024 -> joins s1
    ]
    reqs = read_mooncake(write(tmp_path, "t.jsonl", lines))
    assert [r.session for r in reqs] == ["s0", "s1", "s0", "s0", "s1"]
    assert all(r.session is None for r in read_mooncake(write(tmp_path, "u.jsonl", lines), infer_sessions=False))


def test_mooncake_limit_and_blank_lines(tmp_path):
    p = write(tmp_path, "t.jsonl", [mc(0), "", "   ", mc(5), mc(9)])
    assert [r.line for r in read_mooncake(p)] == [1, 4, 5]
    assert [r.line for r in read_mooncake(p, limit=2)] == [1, 4]


@pytest.mark.parametrize(
    "bad, words",
    [
        ('{"timestamp": 0, "input_length": 1000, "output_', ["not valid JSON"]),  # truncated line
        ("[1, 2]", ["expected a JSON object"]),
        ({"input_length": 1000, "output_length": 1, "hash_ids": [0, 1]}, ["missing field 'timestamp'"]),
        ({"timestamp": 0, "output_length": 1, "hash_ids": [0, 1]}, ["missing field 'input_length'"]),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1}, ["missing field 'hash_ids'"]),
        (
            {"timestamp": "soon", "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]},
            ["'timestamp'", "number"],
        ),
        (
            {"timestamp": "1e999", "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]},
            ["'timestamp'", "finite"],
        ),
        (
            {"timestamp": "9" * 30, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]},
            ["'timestamp'", "number"],
        ),
        (
            {"timestamp": 10**19, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]},
            ["'timestamp'", "out of range"],
        ),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": []}, ["hash_ids has 0 ids"]),
        (
            {"timestamp": 0, "input_length": "1000", "output_length": 1, "hash_ids": [0, 1]},
            ["'input_length'", "integer"],
        ),
        (
            {"timestamp": 0, "input_length": 1000, "output_length": 1.5, "hash_ids": [0, 1]},
            ["'output_length'", "integer"],
        ),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": "0,1"}, ["'hash_ids'", "array"]),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0, "1"]}, ["'hash_ids'[1]"]),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0, True]}, ["'hash_ids'[1]"]),
        ({"timestamp": -5, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]}, ["'timestamp'", "negative"]),
        (
            {"timestamp": 0, "input_length": -1000, "output_length": 1, "hash_ids": [0, 1]},
            ["'input_length'", "negative"],
        ),
        (
            {"timestamp": 0, "input_length": 1000, "output_length": -1, "hash_ids": [0, 1]},
            ["'output_length'", "negative"],
        ),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0, -1]}, ["'hash_ids'[1]"]),
        (
            {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0]},
            ["hash_ids has 1 ids", "2 blocks"],
        ),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1, 2]}, ["hash_ids has 3 ids"]),
        ("NaN", ["expected a JSON object"]),
        ('{"timestamp": NaN, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]}', ["'timestamp'", "finite"]),
    ],
)
def test_mooncake_bad_line_names_file_and_line(tmp_path, bad, words):
    p = write(tmp_path, "t.jsonl", [mc(0), mc(1), bad, mc(3)])
    # a line whose ids do not fit the block size is an error only when blocks are declared fixed
    coverage = "fixed" if any(w.startswith("hash_ids has") and "0 ids" not in w for w in words) else "auto"
    with pytest.raises(TraceError) as e:
        read_mooncake(p, block_coverage=coverage)
    assert_trace_error(e, p, 3, *words)


def test_empty_files(tmp_path):
    for reader, name in ((read_mooncake, "a.jsonl"), (read_plain, "b.jsonl"), (read_sharegpt, "c.json")):
        for content in ("", "\n\n  \n"):
            p = tmp_path / name
            p.write_text(content)
            with pytest.raises(TraceError) as e:
                reader(p)
            assert_trace_error(e, p, 1, "empty")
            with pytest.raises(TraceError):
                load_trace(p)


def test_bad_utf8_is_a_trace_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(json.dumps(mc()).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError) as e:
        read_mooncake(p)
    assert_trace_error(e, p, 2, "UTF-8")


def test_bad_options_are_value_errors(tmp_path):
    p = write(tmp_path, "t.jsonl", [mc()])
    for kwargs in ({"block_size": 0}, {"scale": -1}, {"limit": -1}, {"vocab_size": 10, "token_offset": 16}):
        with pytest.raises(ValueError):
            read_mooncake(p, **kwargs)
    with pytest.raises(ValueError, match="no option"):
        load_trace(p, think_time_s=1.0)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(p, fmt="csv")


# ---------------------------------------------------------------- ShareGPT


def sharegpt_doc():
    return [
        {
            "id": "conv-a",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "What is 2+2?"},
                {"from": "gpt", "value": "4."},
                {"from": "human", "value": "And 3+3?"},
                {"from": "gpt", "value": "6, naturally."},
            ],
        },
        {
            "id": "conv-b",
            "conversations": [
                {"from": "user", "value": "héllo"},
                {"from": "assistant", "value": "hi"},
                {"from": "human", "value": "bye"},
            ],
        },
    ]


def test_sharegpt_good_history_prefix_and_arrivals(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(sharegpt_doc(), indent=1))
    reqs = read_sharegpt(p, think_time_s=10.0, conversation_interval_s=1.0, missing_output_length=7)
    by_id = {r.request_id: r for r in reqs}
    assert set(by_id) == {"conv-a#0", "conv-a#1", "conv-b#0", "conv-b#1"}
    a0, a1 = by_id["conv-a#0"], by_id["conv-a#1"]
    assert a0.session == a1.session == "conv-a"
    assert a1.input_ids[: len(a0.input_ids)] == a0.input_ids  # the history is an exact token prefix
    tok = ByteTokenizer()
    assert a0.output_length == len(tok.encode("4."))
    assert a0.input_ids.tolist() == tok.encode("System: ") + tok.encode("Be brief.") + tok.encode("\n") + tok.encode(
        "User: "
    ) + tok.encode("What is 2+2?") + tok.encode("\n")
    assert by_id["conv-b#0"].output_length == 2 and by_id["conv-b#1"].output_length == 7
    assert [(r.request_id, r.arrival_s) for r in reqs] == [
        ("conv-a#0", 0.0),
        ("conv-b#0", 1.0),
        ("conv-a#1", 10.0),
        ("conv-b#1", 11.0),
    ]
    assert by_id["conv-a#0"].line == 2 and by_id["conv-b#0"].line > 2
    assert detect_format(p) == "sharegpt" and len(load_trace(p)) == 4


def test_sharegpt_jsonl_and_limit(tmp_path):
    p = write(tmp_path, "s.jsonl", sharegpt_doc())
    assert detect_format(p) == "sharegpt"
    reqs = load_trace(p, limit=3)
    assert len(reqs) == 3
    assert read_sharegpt(p) == read_sharegpt(p)


def test_sharegpt_with_tokenizers_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "User": 3, "Assistant": 4, ":": 5}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    p = tmp_path / "s.json"
    p.write_text(
        json.dumps(
            [{"id": 1, "conversations": [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "hello"}]}]
        )
    )
    (r,) = read_sharegpt(p, tokenizer=folder)
    assert r.input_ids.tolist() == [3, 5, 1, 2] and r.output_length == 1 and r.session == "1"


@pytest.mark.parametrize(
    "text, line, words",
    [
        (
            '[\n{"id": "a", "conversations": [{"from": "human", "value": "x"}]},\n{"id": "b", "conv',
            3,
            ["not valid JSON"],
        ),
        ('[\n{"id": "a", "conversations": [{"from": "human", "value": "x"}]}\n', 2, ["not closed"]),
        ('[\n{"id": "a", "conversations": [{"from": "human", "value": 5}]}\n]', 2, ["'value' must be a string"]),
        ('[\n{"id": "a", "conversations": [{"from": "robot", "value": "x"}]}\n]', 2, ["unknown role"]),
        ('[\n{"id": "a"}\n]', 2, ["missing field 'conversations'"]),
        ('[\n{"id": "a", "conversations": {}}\n]', 2, ["must be an array"]),
        ('[\n{"id": [1], "conversations": []}\n]', 2, ["'id'"]),
        ("[\n7\n]", 2, ["must be a JSON object"]),
        ("[]", 1, ["empty"]),
        (
            '[\n{"id": "a", "conversations": [{"from": "gpt", "value": "x"}]}\n]',
            1,
            ["no conversation has a human turn"],
        ),
    ],
)
def test_sharegpt_bad(tmp_path, text, line, words):
    p = tmp_path / "s.json"
    p.write_text(text)
    with pytest.raises(TraceError) as e:
        read_sharegpt(p)
    assert_trace_error(e, p, line, *words)


# ---------------------------------------------------------------- plain


def test_plain_good(tmp_path):
    p = write(
        tmp_path,
        "p.jsonl",
        [
            {"session": "s", "prompt": "hi there", "output_length": 4, "timestamp": 2.5},
            {"session": 7, "input_ids": [5, 6, 7], "output_length": 0},
            {"prompt": "x", "output_length": 1, "timestamp": 1, "id": "custom"},
        ],
    )
    assert detect_format(p) == "plain"
    reqs = load_trace(p)
    assert [(r.request_id, r.session, r.arrival_s) for r in reqs] == [
        ("custom", None, 1.0),
        ("L1", "s", 2.5),
        ("L2", "7", 2.5),
    ]
    assert reqs[1].input_ids.tolist() == ByteTokenizer().encode("hi there")
    assert reqs[2].input_ids.tolist() == [5, 6, 7] and reqs[2].output_length == 0


@pytest.mark.parametrize(
    "bad, words",
    [
        ('{"prompt": "x", "output_length": 1', ["not valid JSON"]),
        ({"output_length": 1}, ["exactly one of"]),
        ({"prompt": "x", "input_ids": [1], "output_length": 1}, ["exactly one of"]),
        ({"prompt": 5, "output_length": 1}, ["'prompt' must be a string"]),
        ({"prompt": "", "output_length": 1}, ["empty prompt"]),
        ({"input_ids": [], "output_length": 1}, ["empty prompt"]),
        ({"input_ids": [1, "2"], "output_length": 1}, ["'input_ids'[1]"]),
        ({"input_ids": [1, -2], "output_length": 1}, ["'input_ids'[1]"]),
        ({"input_ids": "12", "output_length": 1}, ["array"]),
        ({"prompt": "x"}, ["missing field 'output_length'"]),
        ({"prompt": "x", "output_length": -3}, ["negative"]),
        ({"prompt": "x", "output_length": "3"}, ["integer"]),
        ({"prompt": "x", "output_length": 1, "timestamp": -1}, ["negative"]),
        ({"prompt": "x", "output_length": 1, "timestamp": "soon"}, ["number"]),
        ({"prompt": "x", "output_length": 1, "session": [1]}, ["'session'"]),
        ({"prompt": "x", "output_len": 1}, ["unknown field", "output_len"]),
        ({"prompt": "x", "output_length": 1, "id": "L1"}, ["duplicate request id"]),
    ],
)
def test_plain_bad(tmp_path, bad, words):
    p = write(tmp_path, "p.jsonl", [{"prompt": "a", "output_length": 1}, {"prompt": "b", "output_length": 1}, bad])
    with pytest.raises(TraceError) as e:
        read_plain(p)
    assert_trace_error(e, p, 3, *words)


def test_plain_vocab_bound(tmp_path):
    p = write(tmp_path, "p.jsonl", [{"input_ids": [1, 2000], "output_length": 1}])
    with pytest.raises(TraceError, match="outside the vocabulary"):
        read_plain(p, vocab_size=1024)


# ---------------------------------------------------------------- the shipped trace


def test_shipped_trace_first_200_lines():
    SHIPPED = mooncake_trace()
    assert detect_format(SHIPPED) == "mooncake"
    a = load_trace(SHIPPED, limit=200)
    b = load_trace(SHIPPED, limit=200)
    assert len(a) == 200 and a == b
    assert all(isinstance(r, Request) for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    first = json.loads(SHIPPED.open().readline())
    assert len(a[0].input_ids) == first["input_length"] and a[0].output_length == first["output_length"]
    # every prompt starts with the shared block 0 -> the same 512 tokens
    assert all(r.input_ids[:512] == a[0].input_ids[:512] for r in a)
    # multi-turn chains were found: some session holds several requests
    sessions = [r.session for r in a]
    assert len(set(sessions)) < len(sessions)
    scaled = load_trace(SHIPPED, limit=200, scale=32)
    assert len(scaled[0].input_ids) == -(-first["input_length"] * 32 // 512)
    assert [r.session for r in scaled] == sessions


def test_token_synth_ids_follow_their_definition():
    """`TokenSynth`'s vectorised draws (numpy, all keys at once) are the ids of its documented
    definition, computed here from scratch (xxh3 of the key string, splitmix64 per position);
    `tokens_many` equals `tokens` key by key; a shorter draw is a prefix; ids stay in the vocabulary
    and differ between keys and seeds."""
    import xxhash

    from sgl_hicache.replay.trace import TokenSynth

    mask = (1 << 64) - 1

    def splitmix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    synth = TokenSynth(vocab_size=32000, token_offset=10, seed=3)
    keys = [0, 7, 123456789012, "x+pad", "unique:4:2"]
    for key in keys:
        h = xxhash.xxh3_64_intdigest(f"3:{key}".encode())
        ref = [(splitmix((h + (j + 1) * 0x9E3779B97F4A7C15) & mask) >> 32) % 31990 + 10 for j in range(300)]
        assert list(synth.tokens(key, 300)) == ref
        assert list(synth._reference(key, 300)) == ref
        assert list(synth.tokens(key, 17)) == ref[:17]
    many = synth.tokens_many(keys, 300)
    assert many == [synth.tokens(k, 300) for k in keys]
    assert all(10 <= t < 32000 for ids in many for t in ids)
    assert len({tuple(ids) for ids in many}) == len(keys)
    assert list(TokenSynth(32000, 10, seed=4).tokens(0, 300)) != list(synth.tokens(0, 300))
    assert synth.tokens_many(keys, 0) == [array("q") for _ in keys]
