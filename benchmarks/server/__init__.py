"""Benchmarks that start real SGLang servers (`.venv-sglang`; on CPU with the CPU test layer)."""
