"""Every documented command works: the commands of README.md, docs/ and benchmarks/README.md
that run without SGLang, and the examples/ scripts that do not start a server.

- Each command is checked in parse-only mode (tests/documented.py): the Python programs it starts check
  its flags with their own parsers and stop, and the repo paths it names exist. A renamed flag or a
  moved script in the docs fails here.
- The main job (docs/results.md, the README's first command plus `--report`) runs for real, and its hit
  tokens must equal the table the docs print: documented figures are reproducible (hits are exact).
- The example trace files of docs/trace-formats.md replay through the embedded engine.
- The example scripts run for real on an excerpt of the shipped trace.
The SGLang-side commands are in tests/server/test_sglang_documented.py and tests/server/test_sglang_cli.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mooncake_trace
from documented import REPO, DocCommand, check_documented, documented_commands, fenced_blocks

BIN = Path(sys.executable).parent
CORE = [c for c in documented_commands() if not c.needs_sglang]
# Commands that parse-only mode cannot check, and why; they get a syntax check (bash -n) instead.
SYNTAX_ONLY = {
    "scripts/test.sh": "the test command itself: running it here would recurse (CI runs it)",
    "python3 -m venv .venv": "creates the environment these tests run in",
    "pip download": "fetches a wheel from PyPI (network; pip's parser is not argparse)",
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["CORE_VENV"] = sys.prefix  # scripts/replay.sh: use this environment, never create another
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return env


def test_the_docs_give_the_commands_this_suite_checks() -> None:
    texts = [c.text for c in documented_commands()]
    # the README's two first-line commands are among them, and each syntax-only entry still names one
    assert any(t.startswith("scripts/replay.sh traces/") and "--compare" in t for t in texts)
    assert any(t.startswith("scripts/test.sh") for t in texts)
    for prefix in SYNTAX_ONLY:
        assert any(t.startswith(prefix) for t in texts), f"stale SYNTAX_ONLY entry {prefix!r}"


@pytest.mark.parametrize("cmd", CORE, ids=[c.where for c in CORE])
def test_documented_command_parses(cmd: DocCommand) -> None:
    check_documented(cmd, [BIN], SYNTAX_ONLY)


def _documented_hits(doc: str) -> dict[str, dict[str, int]]:
    """policy -> {device, host, disk} from the first results table of `doc` (| `policy` | rate | d | h | k |)."""
    rows: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"^\| `(\w+)` \| [\d.]+ % \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|", doc, re.M):
        if m.group(1) in rows:
            break
        rows[m.group(1)] = {t: int(v.replace(",", "")) for t, v in zip(("device", "host", "disk"), m.groups()[1:])}
    return rows


def test_main_job_reproduces_the_documented_figures(tmp_path: Path) -> None:
    mooncake_trace()  # fails clearly when the shipped trace is missing
    cmd = next(
        c
        for c in documented_commands()
        if c.where.startswith("docs/results.md")
        and c.text.startswith("scripts/replay.sh")
        and "--report out/" in c.text
    )
    text = cmd.text.replace("--report out/", f"--report {tmp_path}/")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", text], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    documented = _documented_hits((REPO / "docs" / "results.md").read_text())
    assert set(documented) == set(report["policies"]), (sorted(documented), sorted(report["policies"]))
    for policy, hits in documented.items():
        assert report["policies"][policy]["hit_tokens"] == hits, (policy, report["policies"][policy]["hit_tokens"])


def _format_examples() -> list[tuple[str, str]]:
    """(suffix, content) of each example trace file in docs/trace-formats.md."""
    doc = (REPO / "docs" / "trace-formats.md").read_text()
    out = []
    for lang, body, _ in fenced_blocks(doc):
        if lang == "json":
            out.append((".json" if body.lstrip().startswith("[") else ".jsonl", body))
        elif lang == "" and body.startswith("TIMESTAMP,"):
            out.append((".csv", body))
    return out


def test_trace_format_examples_replay(tmp_path: Path) -> None:
    examples = _format_examples()
    assert {s for s, _ in examples} == {".json", ".jsonl", ".csv"}, examples
    for i, (suffix, body) in enumerate(examples):
        trace = tmp_path / f"example{i}{suffix}"
        trace.write_text(body)
        report = tmp_path / f"example{i}.report.json"
        proc = subprocess.run(
            [str(BIN / "sgl-hicache"), "replay", str(trace), "--quiet", "--report", str(report)],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{trace.name}:\n{body}\n{proc.stderr[-2000:]}"
        result = json.loads(report.read_text())
        assert all(p["requests"] > 0 for p in result["policies"].values()), (trace.name, result["policies"])


@pytest.mark.parametrize("script", ["examples/replay_shipped_trace.sh", "examples/compare_policies.sh"])
def test_example_script_runs_on_an_excerpt(script: str, tmp_path: Path) -> None:
    excerpt = tmp_path / "excerpt.jsonl"
    with open(mooncake_trace()) as src:
        excerpt.write_text("".join(line for _, line in zip(range(200), src)))
    env = {**_env(), "TRACE": str(excerpt), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = sorted((tmp_path / "out").glob("*.json"))
    plots = sorted((tmp_path / "out").glob("*.png"))
    assert reports and len(plots) == len(reports), (reports, plots)
    for rep in reports:
        assert json.loads(rep.read_text())["trace"]["requests"] == 200
