"""The prepared GPU check (scripts/gpu_check.sh -> benchmarks/io/gpu_check.py) runs end to end on CPU
(`--cpu-smoke`: tiny sizes, no streams), so it cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # $OUT would take precedence over --json
    env["PYTHON"] = sys.executable
    return env


def test_cpu_smoke_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--json", str(out)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu_check" and result["mode"] == "cpu_smoke" and result["ok"] is True
    kinds = result["kinds"]  # the MLA-shaped and fp8 pools' round trips ran and were bit-exact
    assert set(kinds) == {"mla_bf16", "mla_fp8_e4m3", "mha_fp8_e4m3", "mha_fp8_e5m2"}
    assert all(k["bit_exact"] for k in kinds.values()), kinds
    (size,) = result["sizes"].values()
    assert size["device_pool"] == "cpu" and size["pages"] == 6
    methods = ("per_page", "gather", "staged")  # every way the layer-wise loader can move pages
    assert size["bit_exact"] == {
        "handler_round_trip": True,
        "loader_round_trip": True,
        "loader_reversed_slots": True,
        **{f"loader_{m}_{check}": True for m in methods for check in ("round_trip", "reversed_slots")},
        "intact_after_timed_moves": True,
        "overlap_matches_serial": True,
        "serial_matches_source": True,
    }
    assert size["loader_method"] == "per_page"  # the default on a CPU
    paths = ("handler", "loader", "loader_per_page", "loader_gather", "strided")
    for path in ("plain", *paths):
        for link in ("h2d", "d2h"):
            assert size["gbps"][f"{path}_{link}"] > 0
    assert set(size["ratios"]) == {f"{p}_{way} / plain_{way}" for p in paths for way in ("h2d", "d2h")}
    overlap = size["overlap"]
    assert set(overlap["ms"]) == {
        "copy_only",
        "compute_only",
        "overlapped",
        "overlapped_ahead",
        "copy_only_per_page",
        "copy_only_gather",
        "overlapped_ahead_per_page",
        "overlapped_ahead_gather",
    }
    for key in (
        "hidden",
        "hidden_ahead",
        "hidden_ahead_by_method",
        "issue_ms",
        "matmuls_per_layer",
        "race_visible_without_wait",
    ):
        assert key in overlap
    assert set(overlap["hidden_ahead_by_method"]) == {"per_page", "gather"}
    assert "bit-exact" in proc.stdout and "hidden" in proc.stdout


def test_without_cuda_it_fails_clearly_and_imports_only_the_core(tmp_path: Path) -> None:
    # one interpreter for both (each start imports torch): run the script, then list what it imported.
    # The GPU machines have torch, xxhash and pytest only: no SGLang, nor our SGLang adapter.
    env = _env()
    env["OUT"] = str(tmp_path)  # $OUT names the report's folder
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])  # the benchmarks package
    # with a GPU present the full check would take minutes: run the smoke there, for the imports only
    argv = ["gpu_check.py", "--cpu-smoke"] if torch.cuda.is_available() else ["gpu_check.py"]
    code = (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "status = 0\n"
        "try:\n"
        "    runpy.run_module('benchmarks.io.gpu_check', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    status = exc.code\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'sglang' or m.startswith('sgl_hicache.sglang')]\n"
        "print('imported:', bad)\n"
        "sys.exit(status)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert "imported: []" in proc.stdout, proc.stdout + proc.stderr
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--cpu-smoke" in proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["ok"] is False and "no CUDA device" in result["error"]
