"""Shared fixtures: a small KV layout and tiered caches built on it."""

from __future__ import annotations

import pytest
import torch

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout


def _sglang_missing() -> str | None:
    import importlib.util

    try:
        if importlib.util.find_spec("sglang") is None:
            return "sglang is not installed (scripts/install_sglang_cpu.sh installs it into .venv-sglang)"
    except Exception as e:  # pragma: no cover
        return f"sglang not importable: {e}"
    return None


SGLANG_MISSING = _sglang_missing()
# `pytestmark = NEEDS_SGLANG` in a module that runs the real SGLang server
NEEDS_SGLANG = [pytest.mark.sglang, pytest.mark.skipif(SGLANG_MISSING is not None, reason=SGLANG_MISSING or "")]

SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def make_cache(tmp_path=None, device=8, host=16, disk=32, page_size=4, **kw) -> TieredCache:
    """A cache whose capacities are given in pages."""
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=device * page_size,
        host_tokens=host * page_size,
        disk_tokens=disk * page_size if tmp_path is not None else 0,
        page_size=page_size,
        disk_dir=(tmp_path / "disk") if tmp_path is not None else None,
        **kw,
    )
    return TieredCache(cfg)


def kv_for(cache: TieredCache, tokens, seed: int = 0) -> torch.Tensor:
    """Deterministic KV pages for `tokens` (a function of the tokens, like a real model's)."""
    pages = len(tokens) // cache.page_size
    out = torch.empty((pages, *cache.stores["device"].page_shape), dtype=torch.bfloat16)
    for p in range(pages):
        g = torch.Generator().manual_seed(hash(tuple(tokens[: (p + 1) * cache.page_size])) % (2**31) + seed)
        out[p] = torch.randn(out.shape[1:], generator=g).to(torch.bfloat16)
    return out


def serve(cache: TieredCache, tokens, write_kv: bool = True):
    """What an engine does for one request: match, count, promote, compute the rest, insert.
    Safe from several threads at once. Returns (match before promotion, device handles of the
    whole-page prompt)."""
    with cache._mutex:  # one step, so concurrent callers cannot evict or split the path in between
        m = cache.match(tokens)
        cache.record_request(len(tokens), m)
        m2 = cache.promote(m, lock=True)
    try:
        need = len(tokens) // cache.page_size - len(m2.device_handles)
        fresh = cache.allocate_device(need)
        assert fresh is not None, "device full of locked pages"
        handles = m2.device_handles + fresh
        if write_kv and fresh:
            kv = kv_for(cache, tokens)[len(m2.device_handles):]
            cache.stores["device"].write(fresh, kv)
        r = cache.insert(tokens, handles)
        cache.free_device(r.duplicates)
    finally:
        cache.unlock(m2.last_node)
    return m, handles


def assert_device_kv(cache: TieredCache, tokens) -> int:
    """The device pages the tree holds for `tokens` carry exactly the KV computed for them.
    Locks the path while reading, so a concurrent eviction cannot reuse the pages. Returns the tokens checked."""
    with cache._mutex:  # match and lock as one step: between them another thread could evict the pages
        m = cache.match(tokens, touch=False)
        cache.lock(m.last_node)
    try:
        n = len(m.device_handles)
        if n:
            got = cache.stores["device"].read(m.device_handles)
            want = kv_for(cache, tokens)[:n]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"device KV differs for prompt {tokens[:2]}"
        return n * cache.page_size
    finally:
        cache.unlock(m.last_node)


@pytest.fixture
def small_cache(tmp_path):
    return make_cache(tmp_path)
