"""Replay at scale: the two byte modes agree, streaming drops prompts, checkpoints are reports,
parallel --compare equals sequential, the trace synthesiser keeps the source's shape."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from conftest import mooncake_trace

from sgl_hicache.cli import format_report, main
from sgl_hicache.replay import load_trace
from sgl_hicache.replay.mooncake import read_mooncake
from sgl_hicache.replay.stream import MooncakeStream, open_mooncake
from sgl_hicache.replay.synth import _sessions, synthesise, write_trace
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.run import checkpoint_path, compare, longest_first, run_policy
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig
from sgl_hicache.tree.node import edge_key_of

N = 150  # the shipped trace's first N requests: enough for host and disk hits at these capacities


def base(policy: str = "predict", **kw) -> EngineConfig:
    # small tiers so that all three serve hits within N requests (scale 16: 32 tokens a block); host 6x the
    # device: under write-through host holds a copy of every device page, and hits only beyond those
    return EngineConfig(
        policy,
        get_model("llama3-8b"),
        get_hardware("h200"),
        device_tokens=8192,
        host_tokens=49152,
        disk_tokens=65536,
        page_size=16,
        concurrency=2,
        **kw,
    )


def _strip(rep: dict) -> dict:
    rep = json.loads(json.dumps(rep))
    for key in ("wall_s", "cpu_s", "bytes"):
        rep["engine"].pop(key)
    rep["settings"].pop("bytes")
    return rep


def test_metadata_and_real_bytes_agree_exactly():
    reqs = load_trace(mooncake_trace(), limit=N, scale=16)
    real = run_policy(reqs, base(byte_mode="real"))
    meta = run_policy(reqs, base(byte_mode="metadata"))
    assert real["settings"]["bytes"] == "real" and meta["settings"]["bytes"] == "metadata"
    assert all(real["hit_tokens"][t] > 0 for t in ("device", "host", "disk")), real["hit_tokens"]
    assert meta["hit_tokens"] == real["hit_tokens"]
    assert meta["ttft_s"] == real["ttft_s"] and meta["engine"]["virtual_s"] == real["engine"]["virtual_s"]
    assert _strip(meta) == _strip(real)  # every figure, not only the headline ones
    assert meta["bytes_moved"]["host->disk"] > 0  # metadata mode accounts the bytes it does not copy


def test_streamed_reader_yields_what_the_eager_reader_reads():
    eager = read_mooncake(mooncake_trace(), limit=N, scale=16, infer_sessions=False)
    stream = MooncakeStream(mooncake_trace(), limit=N, scale=16, max_blocks=8)  # a tiny block cache: evictions too
    assert len(stream) == N
    for a, b in zip(eager, stream, strict=True):
        assert (a.request_id, a.arrival_s, a.input_ids, a.output_length, a.line) == (
            b.request_id,
            b.arrival_s,
            b.input_ids,
            b.output_length,
            b.line,
        )


def test_an_unsorted_trace_falls_back_to_the_eager_reader(tmp_path):
    lines = mooncake_trace().read_text().splitlines()[:5]
    lines[0], lines[4] = lines[4], lines[0]
    rows = [json.loads(x) for x in lines]
    rows[0]["timestamp"] = 99999  # the first line now arrives last
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = open_mooncake(path)
    assert not isinstance(trace, MooncakeStream) and "not-streamed" in trace.notes
    assert [r.line for r in trace][-1] == 1


def test_streaming_keeps_no_token_arrays_after_completion():
    cfg = base(byte_mode="metadata")
    stream = MooncakeStream(mooncake_trace(), limit=N, scale=16)
    refs: list[weakref.ref] = []
    alive_max = [0]

    def taken():
        for r in stream:
            refs.append(weakref.ref(r.input_ids))
            yield r

    def progress(done, total, hit_rate=None):
        gc.collect()
        alive_max[0] = max(alive_max[0], sum(1 for w in refs if w() is not None))

    engine = EmbeddedEngine(cfg, progress=progress)
    try:
        records = engine.run(taken(), total=len(stream))
    finally:
        engine.close()
    assert len(records) == N and len(refs) == N
    # in flight: at most `concurrency` requests plus the one read ahead (and the one just finishing)
    assert alive_max[0] <= cfg.concurrency + 2
    gc.collect()
    assert [w for w in refs if w() is not None] == []


def test_checkpoint_files_are_valid_partial_reports(tmp_path):
    reqs = load_trace(mooncake_trace(), limit=N, scale=16)
    ckpt = checkpoint_path(tmp_path / "out.json", "predict")
    seen: list[dict] = []

    def progress(done, total, hit_rate=None):
        if ckpt.exists() and (
            not seen or seen[-1]["partial"]["requests_done"] != json.loads(ckpt.read_text())["partial"]["requests_done"]
        ):
            seen.append(json.loads(ckpt.read_text()))

    final = run_policy(reqs, base(byte_mode="metadata"), progress, ckpt, checkpoint_every=25)
    assert [s["partial"]["requests_done"] for s in seen] == [25, 50, 75, 100, 125]
    for s in seen:
        rep = s["policies"]["predict"]
        assert s["kind"] == "replay" and s["partial"]["requests_total"] == N
        assert rep["requests"] == s["partial"]["requests_done"] and len(rep["ttft_samples_s"]) == rep["requests"]
        assert 0 < rep["hit_rate"] < 1 and rep["settings"]["bytes"] == "metadata"
        assert "predict" in format_report(s)  # what `sgl-hicache stats` prints
    assert final["requests"] == N and not ckpt.exists()  # a finished run leaves only the report


def test_parallel_compare_equals_sequential():
    reqs = load_trace(mooncake_trace(), limit=40, scale=16)
    policies = ("demote", "predict")
    seq = compare(reqs, base(byte_mode="metadata"), policies, workers=1)
    par = compare(reqs, base(byte_mode="metadata"), policies, workers=2)
    assert list(par["policies"]) == list(policies)
    for name in policies:
        assert _strip(par["policies"][name]) == _strip(seq["policies"][name])
    assert par["ratios"] == seq["ratios"]


def test_a_pool_starts_the_longest_policies_first():
    assert longest_first(["recompute", "demote", "prefetch", "predict", "oracle"]) == [
        "oracle",
        "predict",
        "prefetch",
        "demote",
        "recompute",
    ]
    assert longest_first(["demote", "mine", "recompute"]) == [
        "mine",
        "demote",
        "recompute",
    ]  # unknown work: start it early


def test_a_forked_compare_survives_a_parent_that_ran_torchs_thread_pool(tmp_path):
    # the command line forks its workers; a parent that already ran OpenMP work (a library caller)
    # must not leave a forked worker hanging in the pool it did not inherit (real bytes touch torch)
    out = tmp_path / "r.json"
    argv = [
        "replay",
        str(mooncake_trace()),
        "--limit",
        "30",
        "--scale",
        "16",
        "--bytes",
        "real",
        "--compare",
        "--workers",
        "2",
        "--device-tokens",
        "8192",
        "--host-tokens",
        "16384",
        "--disk-tokens",
        "65536",
        "--page-size",
        "16",
        "--quiet",
        "--report",
        str(out),
    ]
    code = (
        "import torch; a = torch.randn(1024, 1024); (a @ a).sum(); "
        f"from sgl_hicache.cli import main; raise SystemExit(main({argv!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(json.loads(out.read_text())["policies"]) == ["recompute", "demote", "prefetch", "predict", "oracle"]


def test_cli_streams_with_checkpoints_and_says_the_byte_mode(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "replay",
                str(mooncake_trace()),
                "--limit",
                "30",
                "--scale",
                "16",
                "--bytes",
                "metadata",
                "--policy",
                "demote",
                "--device-tokens",
                "8192",
                "--host-tokens",
                "32768",
                "--disk-tokens",
                "65536",
                "--page-size",
                "16",
                "--concurrency",
                "2",
                "--checkpoint-every",
                "10",
                "--report",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    assert rep["policies"]["demote"]["settings"]["bytes"] == "metadata" and rep["trace"]["requests"] == 30
    assert not checkpoint_path(out, "demote").exists()
    assert main(["replay", str(mooncake_trace()), "--limit", "5", "--checkpoint-every", "2", "--quiet"]) == 2
    assert "--checkpoint-every" in capsys.readouterr().err


def test_synth_keeps_the_shape_of_the_source(tmp_path):
    src = mooncake_trace()
    out = tmp_path / "syn.jsonl"
    with out.open("w") as f:
        assert write_trace(synthesise(src, 3000, seed=1), f) == 3000
    again = list(synthesise(src, 3000, seed=1))
    assert [json.loads(x) for x in out.read_text().splitlines()] == again  # deterministic
    stamps = [r["timestamp"] for r in again]
    assert stamps == sorted(stamps)  # arrival order
    trace = read_mooncake(out, block_coverage="fixed")  # a valid Mooncake trace
    assert len(trace) == 3000
    s_src, _, _ = _sessions(src, 512)
    s_syn, _, _ = _sessions(out, 512)
    turns = lambda ss: sum(len(s.turns) for s in ss) / len(ss)  # noqa: E731
    assert turns(s_syn) == pytest.approx(turns(s_src), rel=0.15)
    assert all(r["hash_ids"][0] == 0 for r in again)  # the shared system prompt block is kept
    private = [h for r in again for h in r["hash_ids"][1:]]
    assert max(private) > max(h for s in s_src for t in s.turns for h in t[3])  # fresh ids for drawn sessions


def test_synth_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "nope.jsonl"), "--requests", "10", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_a_removed_child_leaves_no_traffic_count_behind():
    """A long replay must not keep a traffic count per conversation it ever saw (memory and the
    predictor's scan would grow with the trace)."""
    from conftest import make_cache

    cache = make_cache(device=8, host=0, disk=0, page_size=4)
    seen = 0
    for k in range(40):  # 40 conversations through a 2-page device tier: most are dropped
        tokens = [1, 2, 3, 4] + [100 * k + i for i in range(4)]
        cache.match(tokens)
        pages = cache.allocate_device(2)
        res = cache.insert(tokens, pages)
        cache.free_device(res.duplicates)
        cache.match(tokens)  # counts traffic from the shared first page into this conversation
        seen += 1
    shared = cache.tree.root.children[edge_key_of((1, 2, 3, 4))]
    assert len(shared.child_traffic) <= len(shared.children) + 1
    assert seen == 40


def test_predict_replay_keeps_the_trees_disk_residency_equal_to_the_store(tmp_path: Path) -> None:
    """The end-of-run invariant check (every disk page the tree claims is in the disk store) holds
    after a long `predict` replay; the command exits 0 and writes its report. (It failed after ~5,000
    requests: a disk eviction freed the pages of a background write still in flight; the unit
    test is `test_cache.py::test_a_disk_eviction_never_frees_the_pages_of_a_write_still_in_flight`.)"""
    report = tmp_path / "r.json"
    rc = main(
        [
            "replay",
            str(mooncake_trace()),
            "--limit",
            "5000",
            "--policy",
            "predict",
            "--bytes",
            "metadata",
            "--quiet",
            "--report",
            str(report),
        ]
    )
    assert rc == 0 and report.exists()
