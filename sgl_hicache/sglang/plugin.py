"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"]`` in pyproject.toml).

SGLang's ``sglang.srt.plugins.load_plugins()`` calls :func:`register` once in every SGLang process
(the HTTP server, the scheduler, the detokenizer), before the scheduler builds its tree cache. It must
be cheap, idempotent and must never raise into SGLang: a broken plugin would take the server down.

It does three things:
1. CPU-only workarounds for SGLang itself (``cpu_compat``; a no-op when CUDA exists);
2. registers the ``sgl_hicache`` radix-cache backend (``--radix-cache-backend sgl_hicache``);
3. hooks SGLang's scheduler internal-state report (what ``GET /server_info`` returns in
   ``internal_states``) so that it carries ``sgl_hicache``: our live stats, the pool accounting and the
   tree view, computed in the scheduler thread. ``stats_client.fetch_stats(URL)`` reads it from there.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False

BACKEND_NAME = "sgl_hicache"
INTERNAL_STATE_TARGET = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"


def _backend_factory(ctx):
    from sgl_hicache.sglang.backend import factory

    return factory(ctx)


def _add_internal_state(result, controller, *args, **kwargs):
    """AFTER hook on the scheduler's ``get_internal_state``: add ``internal_state["sgl_hicache"]``."""
    try:
        from sgl_hicache.sglang.backend import TieredRadixCache

        cache = getattr(getattr(controller, "scheduler", None), "tree_cache", None)
        state = getattr(result, "internal_state", None)
        if isinstance(cache, TieredRadixCache) and isinstance(state, dict):
            state["sgl_hicache"] = cache.stats(exact=True)
    except Exception:  # never break /server_info
        logger.exception("sgl_hicache: adding stats to the internal state failed")
    return result


def register_backend() -> bool:
    """Register ``sgl_hicache`` with SGLang's radix-cache registry (idempotent)."""
    from sglang.srt.mem_cache import registry

    if BACKEND_NAME in registry.registered_radix_cache_backends():
        return False
    registry.register_radix_cache_backend(BACKEND_NAME, _backend_factory)
    return True


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    # CPU-only workarounds for SGLang itself (kept apart from product code); no-op when CUDA exists.
    try:
        from sgl_hicache.sglang import cpu_compat

        cpu_compat.apply()
    except Exception:
        logger.exception("sgl_hicache: CPU workarounds failed")
    try:
        register_backend()
    except Exception:
        logger.exception("sgl_hicache: registering the radix-cache backend failed")
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(INTERNAL_STATE_TARGET, _add_internal_state, HookType.AFTER)
    except Exception:
        logger.exception("sgl_hicache: hooking the internal-state report failed; stats only via the stats file")
