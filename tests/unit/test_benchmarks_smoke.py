"""Benchmarks run end to end at their smallest size (figures come from the benchmarks, not from here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_disk_bandwidth_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.io.disk",
        "--pages",
        "3",
        "--threads",
        "2",
        "--repeats",
        "1",
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "8",
        "--page-size",
        "4",
        "--dir",
        str(tmp_path / "bw"),
        "--json",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "disk_bandwidth"
    assert result["config"]["pages"] == 3 and result["config"]["threads"] == 2
    for side in ("store", "raw"):
        for metric in (
            "write_buffered",
            "write_durable",
            "read_serial_cold",
            "read_parallel_cold",
            "read_serial_warm",
            "read_parallel_warm",
        ):
            assert result["gbps_median"][f"{side}_{metric}"] > 0
    assert "store_parallel_cold / raw_parallel_cold" in result["ratios"]
    assert "cold_reads_page_cache_warm" in result["cache"] and result["cache"]["cold_method"]
    assert result["store_counters"]["corrupt_removed"] == 0
    assert not any((tmp_path / "bw").iterdir())  # the benchmark cleans up after itself


def test_disk_page_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.io.disk_page_cpu",
        "--pages",
        "40",
        "--batch",
        "16",
        "--repeats",
        "2",
        "--dir",
        str(tmp_path / "d"),
        "--json",
        str(out),
    ]
    (tmp_path / "d").mkdir()
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "disk_page_cpu" and len(result["rounds"]) == 2
    assert all(result["median_us_per_page"][k] > 0 for k in ("write_us", "read_us", "free_us"))
    assert not any((tmp_path / "d").iterdir())  # the benchmark cleans up after itself


def _sglang_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


def _run(module: str, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", module, "--quick", "--json", str(out), *extra]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{module} exited {run.returncode}:\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_tree_ops_smoke(tmp_path: Path) -> None:
    # without SGLang in this interpreter the benchmark measures ours only and says so
    result = _run("benchmarks.tree.ops", tmp_path / "tree.json")
    assert result["benchmark"] == "tree_ops"
    assert result["config"]["quick"] and result["config"]["page_sizes"] == [1, 16, 64]
    assert result["sglang"]["used"] == _sglang_importable()
    for ps in ("1", "16", "64"):
        r = result["results"][ps]
        for op in ("insert", "match", "evict", "evict_checked"):
            assert r["seconds_median"]["sgl_hicache"][op] > 0
            assert r["tokens_per_s"]["sgl_hicache"][op] > 0
        assert 0 < r["ours_evict_free_share"] < 1
        if result["sglang"]["used"]:
            assert set(r["ratio_ours_over_sglang"]) == {"insert", "match", "evict", "evict_alloc"}
            # both sides' eviction into the allocator SGLang's server builds, beside the tree alone
            assert (
                r["seconds_median"]["sglang"]["evict_alloc"] > 0
                and r["seconds_median"]["sgl_hicache"]["evict_alloc"] > 0
            )
            assert r["tree_tokens"]["sgl_hicache"] == r["tree_tokens"]["sglang"]  # same stream, same tree
        else:
            assert "ratio_ours_over_sglang" not in r and "ours only" in result["note"]


def test_tree_ops_smoke_without_sglang(tmp_path: Path) -> None:
    result = _run("benchmarks.tree.ops", tmp_path / "tree.json", "--no-sglang", "--page-sizes", "16")
    assert not result["sglang"]["used"] and "ours only" in result["note"]
    assert list(result["results"]) == ["16"]


def test_tree_scale_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.tree.scale", tmp_path / "scale.json", "--page-sizes", "16")
    assert result["benchmark"] == "tree_scale" and result["config"]["quick"]
    sides = result["results"]["16"]
    assert {"ours", "ours_tiered"} <= set(sides) and ("radix" in sides) == _sglang_importable()
    for side in ("ours", "ours_tiered") + (("radix",) if "radix" in sides else ()):
        calls = sides[side]["calls_us"]
        assert {"match", "lock", "evict", "insert", "unlock"} <= set(calls)  # the pool was under pressure
        assert all(c["n"] > 0 and c["max"] >= c["p99"] >= c["p50"] >= 0 for c in calls.values())
    if "radix" in sides:  # one request stream: both trees served every request
        assert sides["radix"]["requests"] == sides["ours"]["requests"]
        assert set(sides["p99_ratio_ours_over_radix"]) >= {"match", "insert", "evict"}


def test_host_bandwidth_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.io.host", tmp_path / "host.json")
    assert result["benchmark"] == "host_bandwidth"
    assert isinstance(result["cuda"], bool) and result["note"]
    pairs = (
        "host_write",
        "host_read",
        "device_to_host",
        "host_to_device",
        "device_to_host_chunked",
        "host_to_device_chunked",
    )
    for name in pairs:
        assert result["gbps_median"][name]["ours"] >= 0 and result["gbps_median"][name]["plain"] >= 0
        assert name in result["ratio_ours_over_plain"]
        assert len(result["samples_s"][name]["ours"]) == result["config"]["repeats"]
    assert any(k.startswith("cuda_") for k in result["gbps_median"]) == result["cuda"]


def test_disk_shared_match_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.io.disk_shared_match", tmp_path / "shared.json", "--dir", str(tmp_path))
    assert result["benchmark"] == "disk_shared_match"
    looked = result["files_looked_for_per_round"]
    assert looked["no_disk"] == 0 and looked["lone"] == 0  # a lone server looks at no file
    assert looked["shared"] == result["matches_past_tree"] > 0  # shared: one file per match past the tree
    assert all(result["us_per_match"][side] > 0 for side in ("no_disk", "lone", "shared"))
    assert set(result["ratio"]) == {"lone_over_no_disk", "shared_over_lone"}
    assert list(tmp_path.iterdir()) == [tmp_path / "shared.json"]  # its directories are removed


def test_overhead_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.tree.overhead", tmp_path / "overhead.json")
    assert result["benchmark"] == "overhead"
    ours = result["us_per_request"]["sgl_hicache"]
    assert ours["cpu_us"] > 0 and ours["alloc_us"] >= 0
    assert result["sglang"]["used"] == _sglang_importable()
    if result["sglang"]["used"]:
        assert result["us_per_request"]["sglang"]["cpu_us"] > 0
        assert set(result["ratio_ours_over_sglang"]) == {"cpu", "cpu_without_alloc", "wall"}
        hits = result["device_hit_tokens"]
        assert hits["sgl_hicache"] == hits["sglang"]  # both trees served the same prefixes
    else:
        assert "ratio_ours_over_sglang" not in result


def test_first_run_drops_rewrites_a_text_trace_as_shared_blocks(tmp_path: Path) -> None:
    from benchmarks.lib.traces import as_block_trace

    system = "s" * 5000  # a shared tool prompt of ~3 blocks, then each session's own turns
    rows = [
        {"session": "a", "prompt": system + "A" * 100, "output_length": 4, "timestamp": 0.5},
        {"session": "b", "prompt": system + "B" * 3000, "output_length": 4, "timestamp": 1},
        {"session": "a", "prompt": system + "A" * 100 + "more" * 600, "output_length": 4, "timestamp": 2},
    ]
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = [json.loads(x) for x in as_block_trace(src, tmp_path / "b.jsonl").read_text().splitlines()]
    a1, b1, a2 = (o["hash_ids"] for o in out)
    assert a1[:2] == b1[:2] == a2[:2] and a1[2] != b1[2]  # the shared full blocks share ids, then they part
    assert a2[2] != a1[2]  # a1's partial third block is re-cut in a2 (as Mooncake's traces do)
    assert [o["timestamp"] for o in out] == [500, 1000, 2000]
    for o in out:
        assert len(o["hash_ids"]) == -(-o["input_length"] // 512)  # the shipped trace's block coverage


@pytest.mark.sglang
@pytest.mark.server
@pytest.mark.skipif(
    not _sglang_importable(),
    reason="sglang is not installed (scripts/install_sglang_cpu.sh installs it into .venv-sglang)",
)
def test_first_run_drops_smoke(tmp_path: Path) -> None:
    # one `sgl-hicache serve` of the tiny model with the README's first-run flags, 40 requests
    out = tmp_path / "frd.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.server.first_run_drops",
            "--traces",
            "mooncake",
            "--limit",
            "40",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = json.loads(out.read_text())
    first = result["traces"]["mooncake"]["first"]
    assert "error" not in first, first.get("error")
    assert first["requests"] + first["requests_skipped"] == 40 and first["requests_failed"] == 0
    assert set(first["evicted_tokens"]) >= {"device", "host"} and first["evicted_tokens"]["device"] > 0
    assert proc.returncode == (
        0 if max(first["device_dirty_drop_share"], first["host_dirty_drop_share"]) <= 0.01 else 1
    )


@pytest.mark.sglang
@pytest.mark.server
@pytest.mark.skipif(
    not _sglang_importable(),
    reason="sglang is not installed (scripts/install_sglang_cpu.sh installs it into .venv-sglang)",
)
def test_server_compare_smoke(tmp_path: Path) -> None:
    # three real servers (default cache, SGLang HiCache, sgl_hicache) one after the other
    out = tmp_path / "server.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.server.compare",
        "--quick",
        "--json",
        str(out),
        "--workdir",
        str(tmp_path / "runs"),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=1500)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "server_compare"
    cfg = result["config"]
    assert cfg["quick"] and cfg["requests"] == 8 and cfg["repeats"] == 1 and cfg["pools"] == [0.1]
    assert [s["config"] for s in result["samples"]] == ["default", "hicache", "sgl_hicache"]
    for s in result["samples"]:
        assert "error" not in s, s.get("error")
        assert s["requests"] == 8 and s["requests_failed"] == 0
        assert s["ttft_mean_s"] > 0 and s["throughput_tok_s"] > 0
        assert set(s["hit_tokens"]) == {"device", "host", "disk"}
        assert s["max_total_tokens"] == result["workload"]["max_total_tokens"]["0.1"]
    assert result["samples"][2]["server_info"].get("radix_cache_backend") == "sgl_hicache"
    summary = result["summary"]["0.1"]
    assert set(summary["ratios"]) == {"sgl_hicache / default", "sgl_hicache / hicache"}
    for r in summary["ratios"].values():
        assert r["ttft_mean_s"] > 0 and r["throughput_tok_s"] > 0
    assert not any((tmp_path / "runs").iterdir())  # every run's temp dir (HiCache files, our disk tier) removed


@pytest.mark.sglang
@pytest.mark.server
@pytest.mark.skipif(
    not _sglang_importable(),
    reason="sglang is not installed (scripts/install_sglang_cpu.sh installs it into .venv-sglang)",
)
def test_server_rewarm_smoke(tmp_path: Path) -> None:
    # three real servers one after the other: before the stop, then restarts with re-warm on and off
    out = tmp_path / "rewarm.json"
    cmd = [sys.executable, "-m", "benchmarks.server.rewarm", "--quick", "--json", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=1500)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "rewarm_server" and result["summary"]["runs"] == 1
    s = result["samples"][0]
    assert "error" not in s, s.get("error")
    assert s["order"] == ["rewarm", "cold"] and not s["before_stop"]["record"]["timed_out"]
    for arm in ("rewarm", "cold"):
        assert s[arm]["requests_failed"] == 0 and len(s[arm]["ttft_s"]) == 3
    # the restart without re-warm reads every cached token from disk; with it, from host
    assert s["cold"]["hit_tokens"]["host"] == 0 and s["cold"]["hit_tokens"]["disk"] > 0
    assert s["rewarm"]["hit_tokens"]["host"] > 0 and s["rewarm"]["rewarm_tokens"]["used_tokens"] > 0
    assert result["summary"]["outputs_equal"] and s["mean_ratio"] > 0 and s["worst_ratio"] > 0


def test_server_compare_refuses_a_bad_time_scale() -> None:
    # the open-loop flag is checked before any server starts
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.server.compare", "--time-scale", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--time-scale must be > 0, got 0.0" in r.stderr


def test_server_compare_as_blocks_refuses_a_trace_without_prompts(tmp_path: Path) -> None:
    # `--as-blocks` wants a plain-text trace: a block trace given by mistake is named, before any server starts
    bad = tmp_path / "blocks.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "output_length": 8, "hash_ids": [1]}\n')
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.server.compare", "--trace", str(bad), "--as-blocks"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and f"--as-blocks: {bad} is not a plain-text trace" in r.stderr


@pytest.mark.sglang
@pytest.mark.server
@pytest.mark.skipif(
    not _sglang_importable(),
    reason="sglang is not installed (scripts/install_sglang_cpu.sh installs it into .venv-sglang)",
)
def test_scheduler_thread_smoke(tmp_path: Path) -> None:
    # one real server (sgl_hicache, the defaults), 20 requests: ~1.5 min here
    out = tmp_path / "sched.json"
    cmd = [sys.executable, "-m", "benchmarks.server.scheduler_thread", "--quick", "--json", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=900)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "scheduler_thread" and result["regime"]["requests"] == 20
    [s] = result["samples"]
    assert s["config"] == "after" and "error" not in s and s["failed"] == 0
    calls = result["summary"]["after"]["calls"]
    assert {"match_prefix", "checkpoint", "inc_lock_ref", "dec_lock_ref"} <= set(calls)
    assert all(c["count"] > 0 and 0 <= c["p50_us"] <= c["p99_us"] <= c["max_us"] for c in calls.values())


@pytest.mark.sglang
@pytest.mark.skipif(
    not _sglang_importable(),
    reason="sglang is not installed (scripts/install_sglang_cpu.sh installs it into .venv-sglang)",
)
def test_tree_hicache_peer_smoke(tmp_path: Path) -> None:
    # ~25 s here, most of it SGLang's import: three trees (six sides) under device pressure, a host tier behind two
    result = _run("benchmarks.tree.hicache_peer", tmp_path / "peer.json")
    assert result["sglang"]["used"]
    res = result["results"]
    ours = {"sgl_hicache", "sgl_hicache_settled", "sgl_hicache_nocopy"}
    assert set(res) == ours | {"sglang_radix", "sglang_hicache", "sglang_hicache_nocopy"}
    for side, r in res.items():
        assert r["facts"]["evicted_tokens_device"] > 0, side  # the device pool was under pressure
        assert {"match", "lock", "evict", "insert", "unlock"} <= set(r["calls_us"]), side
        for c in r["calls_us"].values():
            assert 0 <= c["p50"]["median"] <= c["p99"]["median"] <= c["max"]["median"]
    for side in sorted(ours) + ["sglang_hicache"]:  # evicted prefixes came back from host
        facts = res[side]["facts"]
        assert facts["host_hit_tokens"] > 0 and res[side]["calls_us"]["load_back"]["n"] > 0, (side, facts)
    assert res["sglang_hicache"]["facts"]["loaded_back_tokens"] == res["sglang_hicache"]["facts"]["host_hit_tokens"]


def test_tree_hicache_peer_on_tree_scale_sessions_times_the_requests_past_the_pool(tmp_path: Path) -> None:
    # ours alone (the core suite has no SGLang): the synthetic sessions of benchmarks.tree.scale, a 20k-token pool
    result = _run("benchmarks.tree.hicache_peer", tmp_path / "peer.json", "--workload", "tree_scale", "--no-sglang")
    config = result["config"]
    assert config["workload"] == "tree_scale" and config["device_pool_tokens"] == config["pool_tokens"] == 20_000
    assert config["measured_requests"] == 200 and config["prompt_tokens"] > config["pool_tokens"]
    ours = result["results"]["sgl_hicache"]
    assert ours["facts"]["evicted_tokens_device"] > 0 and ours["facts"]["tree_nodes"] > 100
    assert ours["calls_us"]["match"]["n"] == 200


def test_production_compare_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.production", tmp_path / "prod.json")
    assert result["benchmark"] == "production_compare" and result["requests"] == 60
    case = result["cases"]["llama3-8b@h200"]
    assert set(case["policies"]) == {"recompute", "demote", "prefetch", "predict", "oracle"}
    assert case["capacities"]["device_tokens"] > 0 and "prefetch/demote" in case["ratios"]
    for rep in case["policies"].values():
        assert set(rep["hit_tokens"]) == {"device", "host", "disk"} and rep["ttft_s"]["mean"] > 0


def test_regime_map_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.regime_map", tmp_path / "map.json")
    assert len(result["cells"]) == 1
    cell = result["cells"][0]
    assert set(cell["policies"]) == {"lru", "reuse", "predict", "oracle"}
    assert cell["policies"]["oracle"]["hit_rate"] >= cell["policies"]["lru"]["hit_rate"]
    assert "oracle gain" in result["table"]


def test_agentic_trace_builds_sessions_that_extend_their_prompt() -> None:
    from benchmarks import agentic_trace

    sess = [
        {
            "id": "s1",
            "prefix": "DOCS\n",
            "turns": [("list files", ["ls()", "cd(folder='a')"]), ("read it", ["cat(file='x')"])],
        },
        {"id": "s2", "prefix": "DOCS\n", "turns": [("hi", ["ls()"])]},
    ]
    rows = agentic_trace.build(sess, session_rate=1.0, tool_s=1.0, think_s=10.0, seed=0)
    s1 = [r for r in rows if r["session"] == "s1"]
    assert len(s1) == 2 + 1 + 1 + 1  # a step per call and an answer per turn
    assert all(b["prompt"].startswith(a["prompt"]) for a, b in zip(s1, s1[1:]))  # each step extends the last
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    assert all(r["prompt"].startswith("DOCS\n") for r in rows)


def test_tp_consensus_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.tree.tp_consensus", tmp_path / "tp.json")
    assert result["benchmark"] == "tp_consensus" and result["config"]["quick"]
    for name in ("off", "check", "allreduce"):
        assert result["us_per_step_median"][name] > 0
    assert "check / off" in result["ratios"]


def test_replay_scale_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.replay_scale", tmp_path / "scale.json")
    points = {p["bytes"]: p for p in result["points"]}
    assert set(points) == {"metadata", "real"} and all(p["requests"] == 60 for p in points.values())
    assert any(p.get("modes_agree") for p in result["points"])
    assert points["metadata"]["hit_tokens"] == points["real"]["hit_tokens"]
    assert all(p["max_rss_mb"] > 0 and p["engine_cpu_s"] > 0 for p in points.values())
    assert result["compare"]["parallel_wall_s"] > 0 and result["compare"]["sequential_wall_s"] > 0
    # the long run: the finished report's figures, and a row per checkpoint the poll saw (a 60-request
    # run may end before the first poll: which ones it sees is timing)
    long = result["long"]
    assert long["requests"] == 60 and long["max_rss_mb"] > 0 and long["engine"]["bytes"] == "metadata"
    assert all(r["requests_done"] in (20, 40, 60) and r["engine_cpu_s"] > 0 for r in long["checkpoints"])


def test_fleet_whatif_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.fleet", tmp_path / "fleet.json")
    assert result["benchmark"] == "fleet_whatif" and result["servers"] == 2 and result["requests"] == 200
    rows = {r["route"]: r for r in result["rows"]}
    assert set(rows) == {"round_robin"}
    rr = rows["round_robin"]
    # round-robin scatters conversations over the servers: the shared store serves what local tiers cannot
    assert rr["store_hit_tokens"] > 0 and rr["hit_rate_store"] > rr["hit_rate_local"]
    assert rr["store_pages_written"] > 0 and rr["store_pages_read"] > 0


def test_evict_calls_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.tree.evict_calls", tmp_path / "evict.json")
    assert result["benchmark"] == "evict_calls" and result["config"]["quick"]
    for mode in ("incremental", "rebuilt"):
        m = result["median"][mode]
        assert 0 <= m["p50_us"] <= m["p99_us"] <= m["max_us"] and m["device_leaves_before"] > 0


def test_no_tax_smoke(tmp_path: Path) -> None:
    """On a slice that fits the device tier the tiered policies cost nothing in the embedded engine's
    virtual time (deterministic: the cost model, not a wall clock)."""
    result = _run("benchmarks.engine.no_tax", tmp_path / "no_tax.json")
    assert result["benchmark"] == "no_tax" and result["regime"]["requests"] == 200
    assert result["regime"]["fits_device"]
    for policy, ratio in result["ratio_vs_recompute"].items():
        assert ratio["ttft_mean"] <= 1.0 and ratio["ttft_p90"] <= 1.0, (policy, ratio)
    assert result["within"]


def test_store_compare_summary_and_bad_input(tmp_path: Path) -> None:
    """The side-by-side store benchmark's arithmetic (its runs need two venvs and four servers: run by
    hand, `docs/benchmarks.md`): medians, ratios sgl_hicache / HiCache, the HiCache log parser, and a
    missing peer venv as a clear error."""
    from benchmarks.server import store as sc

    def phase(ttft: float, tput: float, storage: int) -> dict:
        return {
            "ttft_mean_s": ttft,
            "ttft_p50_s": ttft,
            "throughput_tok_s": tput,
            "requests_failed": 0,
            "hit_tokens": {"device": 0, "host": 0, "disk": storage},
        }

    views = (
        "store_during_turn_n",
        "store_during_settle",
        "store_during_turn_n1",
        "store_after_turn_n1",
        "store_during_idle",
    )

    def sample(system: str, r: int, ttft_b: float, tput_b: float, storage: int) -> dict:
        return {
            "system": system,
            "repeat": r,
            "turn_n_on_a": phase(2.0, 100.0, 0),
            "turn_n1_on_b": phase(ttft_b, tput_b, storage),
            "turn_n_tokens": [1032, 1032],
            "settle": {"settle_s": 1.0, "pokes": 2, "timed_out": False},
            **{v: {"puts": 4.0, "puts_failed": 0.0, "keys_added": 4.0, "bytes_added": 1e6} for v in views},
        }

    samples = [sample("sgl_hicache", r, 1.0 + r, 200.0, 2048) for r in range(3)]
    samples += [sample("hicache", r, 4.0, 100.0 * (r + 1), 2016) for r in range(3)]
    out = sc.summarize(samples)
    assert out["systems"]["sgl_hicache"]["turn_n1_on_b"]["ttft_mean_s"] == 2.0  # median of 1, 2, 3
    assert out["systems"]["hicache"]["turn_n1_on_b"]["hit_tokens"]["disk"] == 2016
    assert (
        out["ratios"]["turn_n1_on_b"]["ttft_mean_s"] == 0.5 and out["ratios"]["turn_n1_on_b"]["throughput_tok_s"] == 1.0
    )
    assert out["paired_ratios"]["turn_n1_on_b"]["throughput_tok_s"]["samples"] == [2.0, 1.0, 200.0 / 300.0]
    assert "sgl_hicache / HiCache" in sc.render(out)
    log = tmp_path / "b.log"
    log.write_text(
        "x\n[t] HiCache prefetch success req=ab completed=1008 matched=0 loaded=1008 occupied=0\n"
        "[t] HiCache prefetch success req=cd completed=64 matched=0 loaded=48 occupied=0\n"
    )
    assert sc.hicache_prefetch_lines(log) == {
        "finished": 2,
        "by_outcome": {"success": 2},
        "completed_tokens": 1072,
        "loaded_tokens": 1056,
        "declined_lines": 0,
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.server.store",
            "--quick",
            "--peer-python",
            str(tmp_path / "none"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "install_hicache_peer.sh" in r.stderr, r.stderr


def test_retention_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.retention", tmp_path / "retention.json")
    assert result["benchmark"] == "retention" and len(result["families"]) == 1
    cell = result["families"][0]["cells"][0]
    assert set(cell["policies"]) == {"lru", "belady", "oracle"}
    assert cell["policies"]["oracle"]["hit_rate"] >= cell["policies"]["lru"]["hit_rate"]
    assert "| mooncake | 0.3 |" in result["table"]


def test_profile_summary_attributes_samples_to_phases_and_cache_calls(tmp_path: Path) -> None:
    """py-spy's collapsed stacks (as `benchmarks.server.compare --profile` writes them) summed per scheduler
    phase and per outermost sgl_hicache frame."""
    prof = tmp_path / "p.txt"
    prof.write_text(
        "event_loop_overlap (scheduler.py:1);run_batch (scheduler.py:2);forward_extend (model_runner.py:3) 60\n"
        "event_loop_overlap (scheduler.py:1);get_new_batch_prefill (scheduler.py:4);"
        "match_prefix (sgl_hicache/sglang/backend.py:5);walk (sgl_hicache/tree/radix.py:6) 30\n"
        "event_loop_overlap (scheduler.py:1);recv_requests (scheduler.py:7) 10\n"
        "garbage line without a count\n"
    )
    out = tmp_path / "s.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.server.profile_summary", str(prof), "--json", str(out)],
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    s = json.loads(out.read_text())[str(prof)]
    assert s["samples"] == 100
    assert s["phases"] == {"forward": 0.6, "batch formation": 0.3, "receive requests": 0.1}
    assert s["sgl_hicache_share"] == 0.3
    assert s["sgl_hicache_calls"] == {"match_prefix (sglang/backend.py:5)": 0.3}
    assert s["top_self"]["forward_extend (model_runner.py:3)"] == 0.6
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks.server.profile_summary", str(tmp_path / "none.txt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no such profile" in bad.stderr


def test_prediction_pays_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.prediction", tmp_path / "pays.json")
    assert result["benchmark"] == "prediction_pays" and set(result) >= {"chain", "branch"}
    for shape in ("chain", "branch"):
        figures = result[shape]
        assert set(figures) >= {"prefetch", "predict", "oracle", "summary"}
        assert figures["predict"]["target_requests"] == figures["prefetch"]["target_requests"] > 0
        assert figures["predict"]["predictor"]["promoted_tokens"] > 0  # the walk fired where it can pay
    # the agent shape: the framework's hints bring paused sessions back before they resume
    agent, hinted = result["agent"], result["agent_hints"]
    assert (
        hinted["predict"]["hints"]["prefetch"] > 0
        and hinted["summary"]["baseline_and_oracle_from"] == "the workload without hints"
    )
    assert hinted["predict"]["target_ttft_mean_s"] < agent["prefetch"]["target_ttft_mean_s"]
    assert set(agent["prefetch"]["target_groups"]) == {"long pause", "short pause"}


def test_prediction_pays_silence_reports_each_cells_noise_floor(tmp_path: Path) -> None:
    result = _run(
        "benchmarks.engine.prediction",
        tmp_path / "silence.json",
        "--workloads",
        "silence",
        "--families",
        "mooncake",
        "--noise",
        "1,-1",
    )
    (cell,) = result["silence"]["cells"]
    assert set(cell["noise"]) == {"host+1 pages", "host-1 pages"}
    assert all(v["ttft_ratio"] > 0 and v["bytes_ratio"] > 0 for v in cell["noise"].values())
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine.prediction", "--workloads", "silence", "--noise", "one"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--noise" in bad.stderr


def test_agent_hints_smoke(tmp_path: Path) -> None:
    result = _run("benchmarks.engine.agent_hints", tmp_path / "agent_hints.json")
    (cell,) = result["cells"]
    assert {"no_hints", "hints", "oracle", "summary"} <= set(cell)
    assert cell["hints"]["hints"]["applied"]["pin"] > 0 and cell["no_hints"]["hints"]["applied"]["pin"] == 0
    assert cell["summary"]["mean_ratio"] <= 1.05 and cell["summary"]["p99_ratio"] <= 1.05  # the hints never harm


def test_agent_sessions_smoke(tmp_path: Path) -> None:
    excerpt = REPO / "tests" / "data" / "agent_sessions_excerpt"
    result = _run("benchmarks.engine.agent_sessions", tmp_path / "agent_sessions.json", str(excerpt))
    (cell,) = result["cells"]
    assert {"no_hints", "hints", "oracle", "summary"} <= set(cell) and list(cell["hints"]) == ["0"]
    hinted, plain = cell["hints"]["0"], cell["no_hints"]
    assert hinted["hints"]["applied"]["pin"] > 0 and plain["hints"]["applied"]["pin"] == 0
    assert hinted["hints"]["applied"]["demote"] >= 1  # the end hint of a session's last call
    # every call counted once, by what preceded it
    assert sum(plain[k]["requests"] for k in ("tool", "person", "none")) == plain["all"]["requests"]
    assert plain["none"]["requests"] == 2  # one first call per session


def test_agent_server_figures_without_a_server() -> None:
    """`benchmarks/server/agents.py`'s figures from a replay report (its server runs take minutes: no
    smoke run here): the turns after a long tool, job completion times, per-tier hits, and the
    summary's ratios against HiCache."""
    from benchmarks.server import agents as bench
    from sgl_hicache.replay.shapes import agent

    shape = {**bench.QUICK, "sessions": 3, "steps": 4, "long_share": 0.5}
    reqs = agent(**shape, seed=3)
    post = bench.post_pause_ids(reqs, shape)
    by_session: dict = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    want = {
        b.request_id
        for s, rs in by_session.items()
        if s.startswith("agent")
        for a, b in zip(rs, rs[1:])
        if b.arrival_s - a.arrival_s - shape["decode_s"] >= shape["long_s"][0]
    }
    assert post == want and 0 < len(post) < sum(1 for r in reqs if r.session.startswith("agent"))
    records = [
        {
            "request_id": r.request_id,
            "arrival_s": r.arrival_s,
            "ttft_s": 0.5,
            "hit_device": 16,
            "hit_host": 0,
            "hit_disk": 32 if r.request_id in post else 0,
            "prompt_tokens": len(r.input_ids),
            "error": None,
        }
        for r in reqs
    ]
    rep = {"records": records, "requests_failed": 0, "errors": {}, "duration_s": 1.0}
    fig = bench.figures(rep, reqs, post)
    assert fig["post_pause_turns"] == len(post) and fig["post_pause_hit_tokens"]["disk"] == 32 * len(post)
    jct = [
        max(r.arrival_s for r in rs) + 0.5 - min(r.arrival_s for r in rs)
        for s, rs in by_session.items()
        if s.startswith("agent")
    ]
    assert fig["jobs_complete"] == 3 and abs(fig["jct_mean_s"] - sum(jct) / 3) < 1e-9
    samples = []
    for rep_i in range(2):
        for c, k in (("hicache", 1.0), ("sgl_hicache_hints", 0.5)):
            samples.append({**fig, "config": c, "repeat": rep_i, "post_pause_ttft_mean_s": k * (1 + rep_i)})
    summary = bench.summarize(samples, ["hicache", "sgl_hicache_hints"])
    r = summary["ratios"]["sgl_hicache_hints / hicache"]["post_pause_ttft_mean_s"]
    assert r["of_medians"] == 0.5 and r["paired"] == [0.5, 0.5]
    assert "post-pause" in bench.render(summary)


def test_agent_server_recorded_sessions_without_a_server(tmp_path: Path) -> None:
    """`--agent-sessions`: the slice of recorded sessions (picked, cut, hints on the same calls) and
    its figures split by what preceded each call, every session a job."""
    import argparse

    from benchmarks.server import agents as bench

    a = argparse.Namespace(
        agent_sessions=REPO / "tests" / "data" / "agent_sessions_excerpt",
        pick=["trace_0455"],
        calls_per_session=4,
        block_scale=1,
        gap_cap=30.0,
        session_spread=0.0,
        estimate_error=0.5,
        seed=1,
        output_tokens=4,
    )
    plain, hinted, tool, person = bench.session_workload(a, 1024, tmp_path)
    assert [r.request_id for r in plain] == [f"trace_0455#{k}" for k in range(4)]
    assert all(r.output_length == 4 and not r.hints for r in plain)
    assert all(16 <= t < 1024 for r in plain for t in r.input_ids)
    assert any(r.hints for r in hinted) and [len(r.input_ids) for r in hinted] == [len(r.input_ids) for r in plain]
    assert tool | person == {r.request_id for r in plain[1:]} and not tool & person
    assert not list(tmp_path.iterdir())  # the linked folder is gone
    records = [
        {
            "request_id": r.request_id,
            "arrival_s": r.arrival_s,
            "ttft_s": 1.0 if r.request_id in person else 0.5,
            "hit_device": 0,
            "hit_host": 16,
            "hit_disk": 0,
            "prompt_tokens": len(r.input_ids),
            "error": None,
        }
        for r in plain
    ]
    rep = {"records": records, "requests_failed": 0, "errors": {}, "duration_s": 1.0}
    fig = bench.figures(rep, plain, tool, person, bool)
    assert fig["post_pause_turns"] == len(tool) and fig["after_person_turns"] == len(person)
    if person:
        assert fig["after_person_ttft_mean_s"] == 1.0
    assert fig["jobs_complete"] == 1
    assert fig["jct_mean_s"] == pytest.approx(plain[-1].arrival_s + records[-1]["ttft_s"] - plain[0].arrival_s)
    reg = bench.session_regime(plain, 1024, 2048, 0.5)
    assert reg["requests"] == 4 and reg["sessions"] == 1 and sum(reg["preceded_by"].values()) == 4
    with pytest.raises(ValueError, match="no session file"):
        bench.session_workload(argparse.Namespace(**{**vars(a), "pick": ["nope"]}), 1024, tmp_path)


def test_agent_server_refuses_bad_options() -> None:
    from benchmarks.server import agents as bench

    for args in (["--configs", "nope"], ["--device-tokens", "64"], ["--host-ratio", "1"]):
        with pytest.raises(SystemExit) as e:
            bench.main(args)
        assert e.value.code == 2, args
