"""SGLang plugin entry point of the CPU test layer (``sglang.srt.plugins`` in this package's
pyproject.toml).

SGLang calls :func:`register` in each of its processes. The layer patches SGLang only when it is
asked for (``SGLANG_CPU_TEST_LAYER=1`` in the environment) and CUDA is absent: installing the
package alone changes nothing, and a GPU process is never touched.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENABLE_ENV = "SGLANG_CPU_TEST_LAYER"


def asked_for() -> bool:
    """True when this process's environment switches the layer on."""
    return os.environ.get(ENABLE_ENV, "") == "1"


def register() -> None:
    """Apply the CPU patches when asked for and without CUDA; never raises into SGLang."""
    if not asked_for():
        return
    try:
        from sglang_cpu_layer import patches

        patches.apply()
    except Exception:
        logger.exception("sglang_cpu_layer: applying the CPU patches failed")
