"""Benchmarks run end to end at their smallest size (figures come from the benchmarks, not from here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_disk_bandwidth_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "disk_bandwidth.py"),
        "--pages", "3", "--threads", "2", "--repeats", "1",
        "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--page-size", "4",
        "--dir", str(tmp_path / "bw"), "--json", str(out),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "disk_bandwidth"
    assert result["config"]["pages"] == 3 and result["config"]["threads"] == 2
    for side in ("store", "raw"):
        for metric in ("write_buffered", "write_durable", "read_serial_cold", "read_parallel_cold",
                       "read_serial_warm", "read_parallel_warm"):
            assert result["gbps_median"][f"{side}_{metric}"] > 0
    assert "store_parallel_cold / raw_parallel_cold" in result["ratios"]
    assert "cold_reads_page_cache_warm" in result["cache"] and result["cache"]["cold_method"]
    assert result["store_counters"]["corrupt_removed"] == 0
    assert not any((tmp_path / "bw").iterdir())  # the benchmark cleans up after itself
