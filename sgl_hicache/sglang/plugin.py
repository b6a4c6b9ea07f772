"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"]`` in pyproject.toml).

SGLang's ``sglang.srt.plugins.load_plugins()`` calls :func:`register` once in every SGLang process
(the HTTP server, the scheduler, the detokenizer), before the scheduler builds its tree cache. It must
be cheap, idempotent and must never raise into SGLang: a broken plugin would take the server down.

It applies no patch: registering it changes none of SGLang's attributes, classes or environment
variables (``tests/with_sglang/test_sglang_plugin_isolation.py`` checks it). What it adds goes through
SGLang's own plugin API (the radix-cache registry and ``HookRegistry``), and every hook does nothing
unless the scheduler's tree cache is this backend. The CPU patches the tests need live in a separate
package of the test environment (``scripts/cpu/layer``). It does three things:
1. registers the ``sgl_hicache`` radix-cache backend (``--radix-cache-backend sgl_hicache``);
2. hooks SGLang's scheduler internal-state report (what ``GET /server_info`` returns in
   ``internal_states``) so that it carries ``sgl_hicache``: our live stats, the pool accounting and the
   tree view, computed in the scheduler thread. ``stats_client.fetch_stats(URL)`` reads it from there.
   With any radix cache it also adds ``sgl_hicache_model`` (vocabulary size, context length, special
   token ids: SGLang's HTTP API publishes none of them), which the HTTP replayer reads;
3. hooks the scheduler's admission and batch forming (``scheduler_hooks``): a request whose prefetch
   is in flight no longer ends the admission round, and a batch that queued layer-wise loads carries
   their consumer index. Both are no-ops with any other radix cache.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_registered = False

BACKEND_NAME = "sgl_hicache"
INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)


def _backend_factory(ctx):
    from sgl_hicache.sglang.factory import factory

    return factory(ctx)


def _add_internal_state(result, controller, *args, **kwargs):
    """AFTER hook on the scheduler's ``get_internal_state``: add ``internal_state["sgl_hicache"]``."""
    try:
        from sgl_hicache.sglang.backend import TieredRadixCache

        scheduler = getattr(controller, "scheduler", None)
        cache = getattr(scheduler, "tree_cache", None)
        state = getattr(result, "internal_state", None)
        if isinstance(cache, TieredRadixCache) and isinstance(state, dict):
            state["sgl_hicache"] = cache.stats(exact=True)
    except Exception:  # never break /server_info
        logger.exception("sgl_hicache: adding stats to the internal state failed")
    try:  # what the HTTP replayer needs and SGLang's HTTP API does not publish (any radix cache)
        state = getattr(result, "internal_state", None)
        mc = getattr(getattr(controller, "scheduler", None), "model_config", None)
        if isinstance(state, dict) and mc is not None:
            from sgl_hicache.client.model_facts import model_facts

            hf: Any = getattr(mc, "hf_config", None)
            state["sgl_hicache_model"] = model_facts(
                mc.vocab_size, getattr(mc, "context_len", None), hf.to_dict() if hasattr(hf, "to_dict") else {}
            )
    except Exception:
        logger.exception("sgl_hicache: adding the model facts to the internal state failed")
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
    try:
        register_backend()
    except Exception:
        logger.exception("sgl_hicache: registering the radix-cache backend failed")
    try:  # the per-step agreement of the TP ranks (a no-op at TP=1 and for other caches)
        from sgl_hicache.sglang.parallel.rank_consensus import install_step_hook

        install_step_hook()
    except Exception:
        logger.exception("sgl_hicache: hooking the scheduler step failed; --tp > 1 will be refused")
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(INTERNAL_STATE_TARGET, _add_internal_state, HookType.AFTER)
    except Exception:
        logger.exception("sgl_hicache: hooking the internal-state report failed; stats only via the stats file")
    try:
        from sgl_hicache.sglang.scheduler_hooks import register_hooks

        register_hooks()
    except Exception:
        logger.exception("sgl_hicache: hooking the scheduler's admission failed")
    try:  # a diagnostic, off unless SGLH_BATCH_LOG_DIR is set
        from sgl_hicache.sglang.debug.batch_log import register_if_enabled

        register_if_enabled()
    except Exception:
        logger.exception("sgl_hicache: the batch log failed")
