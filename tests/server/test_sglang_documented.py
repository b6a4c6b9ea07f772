"""Every documented command that needs SGLang works (the core side is
tests/unit/test_documented_commands.py):

- each command of README.md / docs/ that launches or benchmarks the server is checked in parse-only
  mode in the SGLang environment (tests/documented.py): `sgl-hicache serve`'s flags, SGLang's own
  `launch_server` flags (`--radix-cache-backend sgl_hicache`), the benchmarks' flags, the paths named;
- examples/serve_and_replay.sh runs for real: serve, replay with the CLI, stats, stop.
The README's first-run sequence runs for real in tests/server/test_sglang_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mooncake_trace
from documented import REPO, DocCommand, check_documented, documented_commands

BIN = Path(sys.executable).parent
SGLANG_CMDS = [c for c in documented_commands() if c.needs_sglang]
# Commands parse-only mode cannot check, and what checks them instead (a syntax check here).
SYNTAX_ONLY = {
    "scripts/install_sglang_cpu.sh": "installs the environment this suite runs in",
    "examples/serve_and_replay.sh [": "a synopsis; the script runs for real in test_serve_and_replay_example",
    ".venv-sglang/bin/python -m pytest": "runs tests of this suite (scripts/test.sh runs them all)",
}


@pytest.mark.parametrize("cmd", SGLANG_CMDS, ids=[c.where for c in SGLANG_CMDS])
def test_documented_sglang_command_parses(cmd: DocCommand) -> None:
    check_documented(cmd, [BIN], SYNTAX_ONLY)


def test_syntax_only_entries_are_documented() -> None:
    for prefix in SYNTAX_ONLY:
        assert any(c.text.startswith(prefix) for c in SGLANG_CMDS), f"stale SYNTAX_ONLY entry {prefix!r}"


def test_serve_and_replay_example(tmp_path: Path) -> None:
    from sgl_hicache.client.server import free_port

    trace = os.path.relpath(mooncake_trace(), REPO)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PY"] = sys.executable
    env["TMPDIR"] = str(tmp_path)  # the script's work dir (mktemp) lands here and goes with tmp_path
    proc = subprocess.run(
        ["bash", "examples/serve_and_replay.sh", trace, "scripts/cpu/tiny-llama", str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        start_new_session=True,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "server up" in proc.stdout and "hit rate" in proc.stdout, proc.stdout[-3000:]
    assert "sglang:cached_tokens_total" in proc.stdout, proc.stdout[-3000:]
