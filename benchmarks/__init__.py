"""The benchmarks, run from the repository root as modules: `python -m benchmarks.<folder>.<name>`.

Folders by what a benchmark needs: `engine/` the embedded engine only (core environment), `server/`
real SGLang servers (`.venv-sglang`), `tree/` the tree against SGLang's own trees in one process,
`io/` host, disk and GPU bandwidth. `lib/` holds what several of them share. `benchmarks/README.md`
lists every benchmark with its command.
"""
