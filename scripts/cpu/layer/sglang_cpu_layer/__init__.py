"""The CPU test layer for SGLang 0.5.23: patches and torch reference kernels that let SGLang's own CPU
path run the model and deployment kinds the `sgl_hicache` tests serve on a machine without a GPU.

Not part of the product: it lives outside the `sgl_hicache` package, is installed only into the CPU
test environment (`scripts/install_sglang_cpu.sh`), and is switched on only where it is installed
and asked for (`SGLANG_CPU_TEST_LAYER=1`, see `plugin.py`). Each patch names the SGLang file and
line it works around.
"""
