"""The commands the documentation gives, extracted so that tests can run them (a test fails
if any documented command fails).

Sources: every ```bash block of README.md, docs/*.md and benchmarks/README.md. A block is split into
logical commands (backslash continuations joined, `for ... done` loops kept whole). Each command is
then either run for real by a test, or run in parse-only mode (tests/parse_only/sitecustomize.py):
every Python program it starts checks its flags with its own parser and stops. Paths inside the repo
that a command names must exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARSE_ONLY_DIR = Path(__file__).resolve().parent / "parse_only"
DOC_FILES = [
    "README.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
    "benchmarks/README.md",
]
# Path-like words a command names that must exist (relative to the repo root).
_PATH_PREFIXES = ("scripts/", "benchmarks/", "examples/", "tests/", "docs/", "traces/", "../shared/")
# Packages of the repo (not installed) whose modules a command runs with `python -m`.
_REPO_MODULES = ("benchmarks.",)
# Commands that need SGLang (the .venv-sglang environment); the rest run in the core environment.
_SGLANG_MARKERS = (
    ".venv-sglang",
    "sgl-hicache serve",
    "sglang.launch_server",
    "serve_and_replay.sh",
    "install_sglang_cpu.sh",
)


@dataclass(frozen=True)
class DocCommand:
    """One logical shell command of a documentation file (`where` = FILE:LINE of its first line)."""

    where: str
    text: str

    @property
    def needs_sglang(self) -> bool:
        return any(m in self.text for m in _SGLANG_MARKERS)

    def paths(self) -> list[str]:
        """Repo-relative paths the command names (words with a known prefix, no placeholders), and
        the file of each repo module it runs with `python -m` (`-m benchmarks.io.disk` ->
        `benchmarks/io/disk.py`)."""
        words = shlex.split(self.text.replace("\\\n", " "), comments=True)
        paths = [w for w in words if w.startswith(_PATH_PREFIXES) and not re.search(r"[\[\]$*]", w)]
        modules = [m for flag, m in zip(words, words[1:]) if flag == "-m" and m.startswith(_REPO_MODULES)]
        return paths + [m.replace(".", "/") + ".py" for m in modules]


def _logical_commands(block: str, first_line: int, path: str) -> list[DocCommand]:
    out: list[DocCommand] = []
    buf: list[str] = []
    start = 0
    depth = 0  # open `for` loops
    for i, raw in enumerate(block.splitlines()):
        line = raw.rstrip()
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if not buf:
            start = first_line + i
        buf.append(line)
        words = shlex.split(stripped.removesuffix("\\"), comments=True) if stripped else []
        depth += sum(1 for w in words if w == "for") - sum(1 for w in words if w in ("done", "done;"))
        if line.endswith("\\") or depth > 0:
            continue
        out.append(DocCommand(f"{path}:{start}", "\n".join(buf)))
        buf = []
    if buf:
        raise ValueError(f"{path}:{start}: unterminated command in a bash block: {buf[-1]!r}")
    return out


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, 1-based line of the body's first line) of each ``` block of a markdown text."""
    blocks: list[tuple[str, str, int]] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"unclosed ``` block at line {i + 1}")
            blocks.append((lang, "".join(lines[i + 1 : end]), i + 2))
            i = end
        i += 1
    return blocks


def documented_commands() -> list[DocCommand]:
    """Every command of every ```bash block of the documentation, in file order."""
    cmds: list[DocCommand] = []
    for rel in DOC_FILES:
        for lang, body, first in fenced_blocks((REPO / rel).read_text()):
            if lang == "bash":
                cmds.extend(_logical_commands(body, first, rel))
    return cmds


def parse_only(cmd: DocCommand, bin_dirs: list[Path], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `cmd` from the repo root in parse-only mode: its Python programs check their flags and stop.
    `bin_dirs` go first on PATH (where `sgl-hicache` and `python` resolve)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PARSE_ONLY_DIR), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([*map(str, bin_dirs), env.get("PATH", "")])
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", cmd.text], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def check_documented(cmd: DocCommand, bin_dirs: list[Path], syntax_only: dict[str, str]) -> None:
    """The check both suites run on a documented command: the repo paths it names exist; a command
    starting with a `syntax_only` prefix (value: why) gets `bash -n`; any other runs in parse-only
    mode, must exit 0, and at least one Python program must have parsed its flags."""
    for path in cmd.paths():
        assert (REPO / path).exists(), f"{cmd.where}: names {path}, which does not exist"
    if any(cmd.text.startswith(prefix) for prefix in syntax_only):
        proc = subprocess.run(["bash", "-n", "-c", cmd.text], capture_output=True, text=True)
        assert proc.returncode == 0, f"{cmd.where}: {proc.stderr}"
        return
    proc = parse_only(cmd, bin_dirs)
    assert proc.returncode == 0, f"{cmd.where}: exit {proc.returncode}\n{cmd.text}\n{proc.stderr[-2000:]}"
    assert "[parse-only]" in proc.stderr, f"{cmd.where}: no Python program parsed its flags:\n{proc.stderr[-2000:]}"
