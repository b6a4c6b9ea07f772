"""Benchmarks of the embedded engine and the cost model (core environment, no SGLang)."""
