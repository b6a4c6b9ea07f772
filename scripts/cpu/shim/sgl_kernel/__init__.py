"""Import-only stand-in for sgl-kernel's CPU build (which is not published on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a number of ``sgl_kernel`` names at module load.
On the Llama path with ``--attention-backend torch_native`` none of them is called, so every name
resolves to a function that raises ``NotImplementedError`` only when it is *called*. Names that were
called are recorded in ``CALLED`` so that a test can assert the CPU path never needed a real kernel.

The linear-attention ops a gated-delta-net hybrid (Qwen3-Next) calls are not stand-ins but torch
reference implementations, in ``sgl_kernel.mamba`` (imported below, so that the ones SGLang reads from
``torch.ops.sgl_kernel`` are registered as soon as ``sgl_kernel`` is).

This is a CPU workaround installed by ``scripts/install_sglang_cpu.sh`` (via a .pth file); it is not
part of the ``sgl_hicache`` product and is never installed on a GPU machine.
"""

CALLED: list = []


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        CALLED.append(name)
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but only an import-only CPU stand-in is installed "
            "(scripts/cpu/shim/sgl_kernel); use --attention-backend torch_native on CPU"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)


from . import mamba  # noqa: F401, E402  (registers its ops on torch.ops.sgl_kernel, after the stand-ins above)
