"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"]`` in pyproject.toml).

SGLang's ``sglang.srt.plugins.load_plugins()`` calls :func:`register` once in every SGLang process
(the HTTP server, the scheduler, the detokenizer). It must be cheap, idempotent and must never raise
into SGLang: a broken plugin would take the server down.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    # CPU-only workarounds for SGLang itself (kept apart from product code); no-op when CUDA exists.
    from sgl_hicache.sglang import cpu_compat

    cpu_compat.apply()
