"""The trace files users hold: ShareGPT V3 (duplicate ids), LMBench (ns string timestamps, hash ids
of varying coverage), vLLM multi-turn, Azure CSV, SGLang benchmark outputs. Each reads, notes its
lenient choices once, names FILE:LINE when malformed, and replays through the embedded engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_hicache.cli import main
from sgl_hicache.replay import (
    TraceError,
    detect_format,
    load_trace,
    read_azure,
    read_mooncake,
    read_sglang_bench,
    read_sharegpt,
)

DATA = Path(__file__).resolve().parents[2] / "data"
SHAREGPT = DATA / "sharegpt_v3_excerpt.json"
LMBENCH = DATA / "lmbench_trace_excerpt.jsonl"
VLLM = DATA / "vllm_multiturn_excerpt.json"
AZURE = DATA / "azure_llm_conv_2023_excerpt.csv"
BENCH_SERVING = DATA / "sglang_bench_serving_excerpt.jsonl"
HICACHE_LOG = DATA / "sglang_hicache_debug_log_excerpt.jsonl"
SMALL = [
    "--page-size",
    "16",
    "--device-tokens",
    "4096",
    "--host-tokens",
    "4096",
    "--disk-tokens",
    "65536",
    "--concurrency",
    "4",
    "--quiet",
]


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ---------------------------------------------------------------- ShareGPT V3: duplicate ids


def test_sharegpt_duplicate_ids_are_disambiguated_and_counted():
    trace = read_sharegpt(SHAREGPT)
    sessions = {r.session for r in trace}
    assert {"ZUkSe7V_0", "ZUkSe7V_0#2", "ZUkSe7V_0#3", "ZUkSe7V_1"} <= sessions
    assert len({r.request_id for r in trace}) == len(trace)
    (note,) = list(trace.notes)
    assert note.count == 2 and "'ZUkSe7V_0' -> 'ZUkSe7V_0#2'" in note.message
    assert str(note).startswith(f"{SHAREGPT}:") and str(note).endswith("[2 times]")
    # a renamed conversation keeps its own text: its prompt is not the first one's
    first = next(r for r in trace if r.request_id == "ZUkSe7V_0#0")
    second = next(r for r in trace if r.request_id == "ZUkSe7V_0#2#0")
    assert first.input_ids != second.input_ids


def test_sharegpt_renaming_never_collides(tmp_path):
    p = tmp_path / "s.json"
    conv = [{"from": "human", "value": "x"}]
    p.write_text(json.dumps([{"id": i, "conversations": conv} for i in ("a", "a", "a#2", "a")]))
    assert sorted({r.session for r in read_sharegpt(p)}) == ["a", "a#2", "a#2#2", "a#3"]
    assert read_sharegpt(p).notes.lines()[0].endswith("[3 times]")


# ---------------------------------------------------------------- LMBench: ns strings, varying coverage


def test_lmbench_ns_string_timestamps_become_seconds():
    trace = read_mooncake(LMBENCH)
    src = rows(LMBENCH)
    first = min(int(r["timestamp"]) for r in src)
    by_line = {r.line: r for r in trace}
    for line, row in enumerate(src, start=1):
        assert by_line[line].arrival_s == pytest.approx((int(row["timestamp"]) - first) / 1e9)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert trace[0].arrival_s == 0.0 and 200 < trace[-1].arrival_s < 400  # the excerpt spans ~291 s
    keys = [n.message for n in trace.notes]
    assert any("string of digits" in m for m in keys)
    assert any("read as ns since the epoch" in m for m in keys)


def test_lmbench_varying_coverage_honours_input_length_and_keeps_prefixes_shared():
    trace = read_mooncake(LMBENCH)
    src = rows(LMBENCH)
    by_line = {r.line: r for r in trace}
    for line, row in enumerate(src, start=1):
        assert len(by_line[line].input_ids) == row["input_length"]
    assert any("varying number of tokens" in n.message for n in trace.notes)
    # lines 1, 3, 5, 8 share a 50-id system prefix: their prompts share the tokens of those 50 blocks
    prefix = by_line[1].input_ids[:1000]
    for line in (3, 5, 8):
        assert by_line[line].input_ids[:1000] == prefix
    # and diverge after the shared ids
    common = 0
    a, b = by_line[1].input_ids, by_line[3].input_ids
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert 1000 < common < 2000
    # line 6 repeats the first 98 of line 2's 106 ids
    assert by_line[6].input_ids[:3000] == by_line[2].input_ids[:3000]


def test_varying_coverage_block_sizes(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},  # 4 + 3 + 3
                {"timestamp": 1, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 4]},  # 4 + 3 + 5
                {"timestamp": 2, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]},  # 7 known + pad 2
                {"timestamp": 3, "input_length": 5, "output_length": 1, "hash_ids": [1, 9]},  # cut inside block 1
            ]
        )
        + "\n"
    )
    a, b, c, d = read_mooncake(p, block_size=4)
    assert [len(r.input_ids) for r in (a, b, c, d)] == [10, 12, 9, 5]
    assert a.input_ids[:7] == b.input_ids[:7] == c.input_ids[:7]
    assert a.input_ids[7:] != b.input_ids[7:10]
    assert d.input_ids[:4] == a.input_ids[:4]
    with pytest.raises(TraceError) as e:
        read_mooncake(p, block_size=4, block_coverage="fixed")
    assert str(e.value).startswith(f"{p}:3: hash_ids has 2 ids")  # lines 1-2 fit 4-token blocks, line 3 does not
    (note,) = list(read_mooncake(p, block_size=4).notes)
    assert note.line == 3 and "varying number of tokens" in note.message
    # lines that all fit keep fixed blocks (4 + 4 + rest) and note nothing
    fits = read_mooncake(p, block_size=4, limit=2)
    assert (
        not fits.notes
        and fits[0].input_ids[:8] == fits[1].input_ids[:8]
        and fits[0].input_ids[8:] != fits[1].input_ids[8:10]
    )


def test_timestamp_units_by_magnitude(tmp_path):
    base = {"input_length": 512, "output_length": 1, "hash_ids": [0]}
    cases = {  # first timestamp, second, expected gap in seconds, unit named in the note
        "s": (1_700_000_000, 1_700_000_002, 2.0),
        "ms": (1_700_000_000_000, 1_700_000_002_500, 2.5),
        "us": (1_700_000_000_000_000, 1_700_000_000_250_000, 0.25),
        "ns": (1_700_000_000_000_000_000, 1_700_000_001_000_000_000, 1.0),
    }
    for unit, (t0, t1, gap) in cases.items():
        p = tmp_path / f"{unit}.jsonl"
        p.write_text(json.dumps(dict(base, timestamp=t1)) + "\n" + json.dumps(dict(base, timestamp=t0)) + "\n")
        a, b = read_mooncake(p)
        assert (a.arrival_s, b.arrival_s) == (0.0, pytest.approx(gap)) and a.line == 2
        (note,) = list(read_mooncake(p).notes)
        assert f"read as {unit} since the epoch" in note.message and note.line == 2
    # a relative trace keeps the Mooncake rule: milliseconds from the start, nothing noted
    p = tmp_path / "rel.jsonl"
    p.write_text(json.dumps(dict(base, timestamp=1500)) + "\n")
    trace = read_mooncake(p)
    assert trace[0].arrival_s == 1.5 and not trace.notes


# ---------------------------------------------------------------- vLLM, Azure, SGLang outputs


def test_vllm_multiturn_reads_like_sharegpt():
    assert detect_format(VLLM) == "sharegpt"
    trace = load_trace(VLLM)
    assert [r.request_id for r in trace] == ["hiWPlMD#0", "UzTK34D#0", "hiWPlMD#1"]
    t0, t1 = (r for r in trace if r.session == "hiWPlMD")
    assert t1.input_ids[: len(t0.input_ids)] == t0.input_ids and not trace.notes


def test_azure_csv():
    assert detect_format(AZURE) == "azure"
    trace = read_azure(AZURE)
    assert len(trace) == 12 and [r.line for r in trace] == list(range(2, 14))
    assert trace[0].arrival_s == 0.0 and trace[1].arrival_s == pytest.approx(4.314579)
    assert [(len(r.input_ids), r.output_length) for r in trace[:2]] == [(374, 44), (396, 109)]
    assert trace[3].input_ids != trace[4].input_ids[:91]  # same length, still unique prompts
    (note,) = list(trace.notes)
    assert "no prompt content or prefix information" in note.message and note.line == 1
    assert read_azure(AZURE, limit=3) == trace[:3]


def test_sglang_bench_serving_output():
    assert detect_format(BENCH_SERVING) == "sglang-bench"
    trace = read_sglang_bench(BENCH_SERVING)
    assert [len(r.input_ids) for r in trace] == [212, 530, 97, 401, 240, 64, 65]
    assert [r.output_length for r in trace][:5] == [180, 64, 211, 120, 115]
    assert [r.arrival_s for r in trace] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.25]  # rate 4, then inf
    assert [n.message for n in trace.notes][0].startswith("an SGLang bench_serving result holds no prompt")
    assert trace.notes.lines()[0].endswith("[2 times]")  # one note for both runs


def test_sglang_hicache_debug_log():
    assert detect_format(HICACHE_LOG) == "sglang-bench"
    trace = read_sglang_bench(HICACHE_LOG)
    assert [(r.request_id, r.session, r.arrival_s) for r in trace] == [
        ("0#0", "0", 0.0),
        ("1#0", "1", 0.5),
        ("0#1", "0", 3.25),
    ]
    assert trace[2].input_ids[: len(trace[0].input_ids)] == trace[0].input_ids  # the history is shared
    assert not trace.notes


@pytest.mark.parametrize(
    "name, content, line, words",
    [
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,x,1\n",
            3,
            ["ContextTokens"],
        ),
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-13-16 18:15:47,3,1\n",
            3,
            ["not a valid date"],
        ),
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,0,1\n",
            3,
            [">= 1"],
        ),
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,3\n",
            3,
            ["CSV fields"],
        ),
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n1700000000,3,1\n",
            3,
            ["like the first row"],
        ),
        ("a.csv", "time,prompt,output\n1,2,3\n", 1, ["not an Azure", "ContextTokens"]),
        (
            "b.jsonl",
            '{"input_lens": [5], "output_lens": [1]}\n{"input_lens": [5, 6], "output_lens": [1]}\n',
            2,
            ["'output_lens' 1"],
        ),
        (
            "b.jsonl",
            '{"input_lens": [5], "output_lens": [1]}\n{"backend": "sglang", "completed": 5}\n',
            2,
            ["--output-details"],
        ),
        (
            "b.jsonl",
            '{"input_lens": [5], "output_lens": [1]}\n{"timestamp": "x", "summary": {"total_requests": 5}}\n',
            2,
            ["summary"],
        ),
        (
            "b.jsonl",
            '{"input_lens": [5], "output_lens": [1]}\n{"input_lens": [0], "output_lens": [1]}\n',
            2,
            ["at least one prompt token"],
        ),
        (
            "b.jsonl",
            '{"input_lens": [5], "output_lens": [1]}\n{"input_lens": [5, -1], "output_lens": [1, 1]}\n',
            2,
            ["input_lens[1]"],
        ),
        (
            "b.jsonl",
            '{"timestamp": 1, "user_data": {"user_id": 0, "current_round": 0, "prompt": "a", "return_tokens": 1}}\n'
            '{"timestamp": 2, "user_data": {"user_id": 0, "current_round": 0, "prompt": "ab", "return_tokens": 1}}\n',
            2,
            ["logged twice"],
        ),
        (
            "b.jsonl",
            '{"input_lens": [5], "output_lens": [1]}\n{"input_lens": [5], "output_lens": [1]\n',
            2,
            ["not valid JSON"],
        ),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, name, content, line, words):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(TraceError) as e:
        load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------- the command line: notes once, replay


@pytest.mark.parametrize("trace", [SHAREGPT, LMBENCH, VLLM, AZURE, BENCH_SERVING, HICACHE_LOG])
def test_each_format_replays_through_the_embedded_engine(trace, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["replay", str(trace), "--limit", "6", "--policy", "prefetch", "--report", str(report), *SMALL]) == 0
    captured = capsys.readouterr()
    data = json.loads(report.read_text())
    n = len(load_trace(trace, limit=6))
    assert n >= 3 and data["trace"]["requests"] == n and data["policies"]["prefetch"]["requests"] == n
    notes = data["trace"]["notes"]
    for note in notes:  # each note printed once on stderr, and carried by the report
        assert captured.err.count(note) == 1
    assert captured.err.count("note:") == len(notes)


def test_cli_prints_the_duplicate_id_note_once_with_its_count(tmp_path, capsys):
    assert main(["replay", str(SHAREGPT), "--format", "sharegpt", *SMALL]) == 0
    err = capsys.readouterr().err
    assert err.count("duplicate conversation ids") == 1 and "[2 times]" in err
