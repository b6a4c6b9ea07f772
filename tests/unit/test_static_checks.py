"""The code passes its static checks (configured in pyproject.toml): ruff's lint rules and its
format over the package, tests, benchmarks and scripts, and mypy over the package.

They run in the core venv (the `dev` extra pins ruff and mypy), which has no SGLang: mypy takes
`sglang` as a missing import there, so code under `sgl_hicache/sglang/` is checked against our own
modules (a name imported from a module of ours that does not exist is an error) but not SGLang's."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINTED = ["sgl_hicache", "tests", "benchmarks", "scripts"]


def _tool(module: str) -> list[str]:
    """`python -m <tool>` of this interpreter; skipped (with the install line) where it is absent."""
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed here (pip install -e '.[dev]')")
    return [sys.executable, "-m", module]


def _run(cmd: list[str], timeout_s: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_ruff_lint_is_clean() -> None:
    run = _run([*_tool("ruff"), "check", "--no-cache", "--output-format", "concise", *LINTED])
    assert run.returncode == 0, (
        f"ruff check found problems (ruff check --fix fixes the safe ones):\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    )


@pytest.mark.skipif(
    os.environ.get("SGLH_SKIP_FORMAT_CHECK") == "1",
    reason="SGLH_SKIP_FORMAT_CHECK=1: a branch whose tree is formatted once, after merging",
)
def test_ruff_format_is_clean() -> None:
    run = _run([*_tool("ruff"), "format", "--check", "--no-cache", *LINTED])
    assert run.returncode == 0, (
        f"files ruff would reformat (run ruff format):\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    )


def test_mypy_is_clean() -> None:
    # (its cache, .mypy_cache/ in the repository, makes a rerun take seconds)
    run = _run([*_tool("mypy"), "--no-error-summary"], timeout_s=600)
    assert run.returncode == 0, f"mypy found type errors:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"


def test_mypy_catches_a_missing_module_of_ours(tmp_path: Path) -> None:
    """The check that would have caught `from .requests import RequestStates` (a module that does
    not exist) under `TYPE_CHECKING` in `sgl_hicache/sglang/`: missing imports are ignored for
    SGLang and the optional clients only, never for our own package."""
    pkg = tmp_path / "sgl_hicache_probe"
    (pkg / "sglang").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sglang" / "__init__.py").write_text("")
    (pkg / "sglang" / "step.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from sglang.srt.managers.schedule_batch import Req  # SGLang: absent here, ignored\n"
        "if TYPE_CHECKING:\n"
        "    from .requests import RequestStates  # ours, and missing: an error\n"
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    run = subprocess.run(
        [*_tool("mypy"), "--cache-dir", str(ROOT / ".mypy_cache"), "sgl_hicache_probe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert 'sgl_hicache_probe.sglang.requests"' in run.stdout, run.stdout
    assert "schedule_batch" not in run.stdout, run.stdout


_IMPORT_ALL = """
import importlib, pkgutil, sys
import sgl_hicache
skip = sys.argv[1:]
names = [m.name for m in pkgutil.walk_packages(sgl_hicache.__path__, "sgl_hicache.")
         if not any(m.name == s or m.name.startswith(s + ".") for s in skip)]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def _import_all(*skip: str) -> int:
    run = _run([sys.executable, "-c", _IMPORT_ALL, *skip])
    assert run.returncode == 0, f"a module of the package does not import:\n{run.stdout[-2000:]}{run.stderr[-4000:]}"
    return int(run.stdout.split()[-1])


def test_every_module_outside_the_adapter_imports_without_sglang() -> None:
    assert _import_all("sgl_hicache.sglang") > 50


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (the SGLang venv)")
def test_every_module_imports_with_sglang() -> None:
    assert _import_all() > 70
