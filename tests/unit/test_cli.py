"""The command line: the main job end to end, and clear errors for bad input (no tracebacks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import TRACE, mooncake_trace

from sgl_hicache.cli import main

SMALL = [
    "--limit",
    "40",
    "--scale",
    "16",
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


def test_replay_compare_writes_a_report_and_stats_reads_it(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["replay", str(mooncake_trace()), *SMALL, "--compare", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out and "predict" in out and "hit%" in out
    data = json.loads(report.read_text())
    assert set(data["policies"]) == {"recompute", "demote", "prefetch", "predict", "oracle"}
    for rep in data["policies"].values():
        for key in (
            "requests",
            "prompt_tokens",
            "hit_tokens",
            "miss_tokens",
            "hit_rate",
            "ttft_s",
            "throughput_tok_s",
            "prefetch",
            "bytes_moved",
        ):
            assert key in rep, key
        assert set(rep["ttft_s"]) >= {"mean", "p50", "p90", "p99"}
        assert set(rep["hit_tokens"]) == {"device", "host", "disk"}
    png = tmp_path / "plot.png"
    assert main(["stats", str(report), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "largest subtrees" in out
    assert png.stat().st_size > 10_000


def test_single_policy_with_a_persistent_disk_dir(tmp_path, capsys):
    disk = tmp_path / "tier"
    args = [
        "replay",
        str(mooncake_trace()),
        *SMALL,
        "--policy",
        "demote",
        "--disk-dir",
        str(disk),
        "--host-tokens",
        "512",
    ]
    assert main(args) == 0
    assert any(disk.rglob("*.page")), "the disk tier wrote no page file"


@pytest.mark.parametrize(
    "args, message",
    [
        (["replay", "/nonexistent/trace.jsonl"], "does not exist"),
        (["replay", str(TRACE), "--device-tokens", "-5"], "expected an integer >= 1"),
        (["replay", str(TRACE), "--policy", "magic"], "invalid choice"),
        (["replay", str(TRACE), "--page-size", "zero"], "expected an integer"),
        (["stats", "/nonexistent/report.json"], "is not a file"),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(args, message):
    proc = subprocess.run([sys.executable, "-m", "sgl_hicache.cli", *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_trace_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 1, "input_length": -3}\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_hicache.cli", "replay", str(bad), "--quiet"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"{bad}:2" in proc.stderr and "Traceback" not in proc.stderr


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sgl_hicache.cli",
            "replay",
            str(TRACE),
            *SMALL,
            "--policy",
            "demote",
            "--disk-dir",
            str(f),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_stats_rejects_a_json_that_is_not_a_report(tmp_path):
    other = tmp_path / "x.json"
    other.write_text("[1, 2]")
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_hicache.cli", "stats", str(other)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "not an sgl-hicache report" in proc.stderr


def test_predictor_none_runs_predict_as_prefetch(tmp_path):
    reports = {}
    for name, extra in (
        ("none", ["--policy", "predict", "--predictor", "none"]),
        ("prefetch", ["--policy", "prefetch"]),
    ):
        reports[name] = tmp_path / f"{name}.json"
        assert main(["replay", str(mooncake_trace()), *SMALL, *extra, "--report", str(reports[name])]) == 0
    none, prefetch = (json.loads(reports[n].read_text())["policies"] for n in ("none", "prefetch"))
    assert none["predict"]["hit_tokens"] == prefetch["prefetch"]["hit_tokens"]


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    report = tmp_path / "r.json"
    assert main(["replay", str(mooncake_trace()), *SMALL, "--policy", "demote", "--report", str(report)]) == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a stripped install looks like to `import`
    assert main(["stats", str(report), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
