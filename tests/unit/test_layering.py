"""The package's shape, guarded by tools: import-linter's contracts (pyproject.toml), no import
circle (lazy imports included), and size limits on modules and classes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sgl_hicache"
# lines as `ruff format` lays them out (it wraps what fit in 120 columns before, about 1.2x as many lines)
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 450


def test_import_linter_contracts_hold() -> None:
    # in a child process: import-linter configures logging (it disables the loggers that exist),
    # which would silence the package's loggers for every test after this one
    code = f"from importlinter.cli import lint_imports; raise SystemExit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (
        f"an import-linter contract is broken (run lint-imports):\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    )


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circle_even_through_lazy_imports() -> None:
    import grimp  # (import-linter's graph library: in the core suite's dev extra, not the SGLang venv's)

    graph = grimp.build_graph("sgl_hicache", cache_dir=None, exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    import grimp

    graph = grimp.ImportGraph()
    for m in ("p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.b", imported="p.c")
    assert _cycles(graph) == [["p.a", "p.b"]]


def _sizes() -> list[tuple[str, str, int]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        out.append(("module", rel, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                out.append(("class", f"{rel}:{node.name}", node.end_lineno - node.lineno + 1))  # type: ignore[operator]
    return out


@pytest.mark.parametrize("kind,limit", [("module", MAX_MODULE_LINES), ("class", MAX_CLASS_LINES)])
def test_no_module_or_class_is_oversized(kind: str, limit: int) -> None:
    over = [(name, n) for k, name, n in _sizes() if k == kind and n > limit]
    assert over == [], f"{kind}s over {limit} lines: {over}"


def test_no_two_modules_share_a_file_name() -> None:
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_sglang_adapter_is_split_by_job() -> None:
    top = [p.name for p in (PACKAGE / "sglang").glob("*.py")]
    assert len(top) <= 15, f"sgl_hicache/sglang/ has {len(top)} modules at its top level: {sorted(top)}"


def test_the_package_carries_no_test_only_patch_of_sglang() -> None:
    """The CPU test layer (scripts/cpu/layer) is its own package; nothing in the product names it."""
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "sglang_cpu_layer" in p.read_text()]
    assert offenders == []
