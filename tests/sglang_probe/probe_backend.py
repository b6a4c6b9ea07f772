"""Probe (not product code): a radix-cache backend that counts what SGLang's scheduler calls.

Used once to check a key assumption of docs/internals.md ("SGLang 0.5.23's side"): a factory registered with
``register_radix_cache_backend`` and selected by ``--radix-cache-backend sgl_hicache_probe`` gets
every scheduler call, and a plain ``BasePrefixCache`` subclass shaped like ``RadixCache`` (not the
unified tree) is enough for the scheduler. ``SGLHICACHE_PROBE_BASE=radix|unified`` picks the base.
Each call prints ``SGLH_PROBE <method>`` to stderr (the server log).

How it was wired for the experiment: a temporary hook in plugin.register() called
``register_probe()`` when ``SGLHICACHE_PROBE_FILE`` pointed at this file; that line is removed.
"""

import os
import sys

METHODS = (
    "match_prefix",
    "insert",
    "checkpoint",
    "evict",
    "evict_for_alloc",
    "inc_lock_ref",
    "dec_lock_ref",
    "lock",
    "unlock",
    "reset",
    "path_device_indices",
    "prefix_device_indices",
    "free_kv_row",
    "on_release",
    "init_load_back",
    "evictable_size",
    "protected_size",
    "touch_prefix",
    "supports_prefix_sharing",
    "finish",
    "take_events",
)


def _counting(cls):
    def wrap(name):
        orig = getattr(cls, name)

        def method(self, *args, **kwargs):
            print(f"SGLH_PROBE {name}", file=sys.stderr, flush=True)
            return orig(self, *args, **kwargs)

        method.__name__ = name
        return method

    ns = {n: wrap(n) for n in METHODS if hasattr(cls, n)}
    return type(f"Probe{cls.__name__}", (cls,), ns)


def _factory(ctx):
    from sglang.srt.mem_cache import registry

    base = os.environ.get("SGLHICACHE_PROBE_BASE", "unified")
    print(
        f"SGLH_PROBE factory base={base} page_size={ctx.params.page_size} "
        f"allocator={type(ctx.params.token_to_kv_pool_allocator).__name__} "
        f"kvcache={type(ctx.params.token_to_kv_pool_allocator.get_kvcache()).__name__} "
        f"req_to_token={tuple(ctx.params.req_to_token_pool.req_to_token.shape)} "
        f"hicache={ctx.enable_hierarchical_cache}",
        file=sys.stderr,
        flush=True,
    )
    if base == "radix":
        from sglang.srt.mem_cache.radix_cache import RadixCache

        return _counting(RadixCache)(ctx.params)
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return registry.create_unified_radix_cache(ctx, cache_class=_counting(UnifiedRadixCache))


def register_probe():
    from sglang.srt.mem_cache import registry

    if "sgl_hicache_probe" not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend("sgl_hicache_probe", _factory)
