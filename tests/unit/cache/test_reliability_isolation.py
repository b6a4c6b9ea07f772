"""Isolation through the cache: two model namespaces (another KV layout, another page size)
and two tenant salts sharing one disk directory never hit each other's pages, never delete them, and
each gets its own back after a restart; page paths are always inside the directory whatever the
key; malformed keys are refused before they name a path; files are 0600, directories 0700."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LAYOUT, kv_for
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, KVLayout
from sgl_hicache.hashing import KEY_BYTES, Namespace
from sgl_hicache.tiers.base import DEVICE, DISK
from sgl_hicache.tiers.disk import DiskPageStore

PS = 4


def cache_for(directory: Path, layout: KVLayout = SMALL_LAYOUT, salt: str = "", page_size: int = PS) -> TieredCache:
    cfg = CacheConfig(
        layout,
        device_tokens=8 * page_size,
        host_tokens=8 * page_size,
        disk_tokens=512 * page_size,
        page_size=page_size,
        disk_dir=directory,
        tenant_salt=salt,
        write_policy="write_through",
        disk_write_policy="write_through",
        eviction_demotes="all",
        predictor="none",
    )
    return TieredCache(cfg)


def kv(cache: TieredCache, tokens, seed: int) -> torch.Tensor:
    return kv_for(cache, tokens, seed).to(cache.config.layout.torch_dtype)


def serve_as(cache: TieredCache, tokens, seed: int) -> None:
    """One request whose computed KV depends on `seed` (a stand-in for "another model's KV")."""
    m = cache.promote(cache.match(tokens))
    cache.lock(m.last_node)
    try:
        need = len(tokens) // cache.page_size - len(m.device_handles)
        fresh = cache.allocate_device(need)
        assert fresh is not None
        if fresh:
            cache.stores[DEVICE].write(fresh, kv(cache, tokens, seed)[len(m.device_handles) :])
        r = cache.insert(tokens, m.device_handles + fresh)
        cache.free_device(r.duplicates)
    finally:
        cache.unlock(m.last_node)


PROMPTS = [list(range(1000 * i, 1000 * i + 4 * PS)) for i in range(1, 7)]

TENANTS = {
    "salt": (dict(salt="tenant-A"), dict(salt="tenant-B")),
    "layout": (
        dict(layout=SMALL_LAYOUT),
        dict(layout=KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")),
    ),
    "dtype": (
        dict(layout=SMALL_LAYOUT),
        dict(layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")),
    ),
    "architecture": (
        dict(layout=SMALL_LAYOUT),
        dict(layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, architecture="qwen2")),
    ),
    "page_size": (dict(page_size=PS), dict(page_size=2 * PS)),
}


@pytest.mark.parametrize("what", sorted(TENANTS))
def test_two_namespaces_on_one_directory_never_share_pages(tmp_path: Path, what: str) -> None:
    directory = tmp_path / "shared-tier"
    a_kw, b_kw = TENANTS[what]
    a = cache_for(directory, **a_kw)
    for p in PROMPTS:
        serve_as(a, p, seed=0)
    a_pages = a.stores[DISK].stored_pages
    assert a_pages == len(PROMPTS) * 4
    del a

    b = cache_for(directory, **b_kw)  # restart as the other namespace
    disk = b.stores[DISK]
    assert disk.stored_pages == 0 and disk.counters["foreign_ignored"] == a_pages
    assert disk.counters["corrupt_removed"] == 0 and disk.free_pages == disk.capacity_pages
    for p in PROMPTS:
        m = b.match(p)
        assert m.tokens == 0, "a page of another namespace was matched"
        serve_as(b, p, seed=1)
    b.check()
    b_pages = disk.stored_pages
    assert b.snapshot()["hit_tokens"]["disk"] == 0
    del b

    for kw, seed, mine, theirs in ((a_kw, 0, a_pages, b_pages), (b_kw, 1, b_pages, a_pages)):
        c = cache_for(directory, **kw)
        disk = c.stores[DISK]
        assert disk.stored_pages == mine and disk.counters["foreign_ignored"] == theirs
        for p in PROMPTS:
            m = c.match(p)
            assert m.disk_tokens == len(p) - len(p) % c.page_size
            m = c.promote(m)
            got = c.stores[DEVICE].read(m.device_handles)
            assert torch.equal(got.view(torch.int16), kv(c, p, seed).view(torch.int16)), (what, seed)
        c.check()
        del c


def test_disk_eviction_never_deletes_another_namespace_pages(tmp_path: Path) -> None:
    """A namespace that fills its own disk capacity evicts only its own files."""
    directory = tmp_path / "shared-tier"
    a = cache_for(directory, salt="A")
    for p in PROMPTS:
        serve_as(a, p, seed=0)
    theirs = set(directory.rglob("*.page"))
    del a
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=8 * PS,
        host_tokens=8 * PS,
        disk_tokens=8 * PS,
        page_size=PS,
        disk_dir=directory,
        tenant_salt="B",
        write_policy="write_through",
        disk_write_policy="write_through",
        eviction_demotes="all",
        predictor="none",
    )
    b = TieredCache(cfg)
    for i in range(20):
        serve_as(b, list(range(500_000 + 100 * i, 500_000 + 100 * i + 4 * PS)), seed=1)
    b.check()
    assert b.snapshot()["evicted_tokens"]["disk"] > 0
    assert all(p.exists() for p in theirs)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))
def test_any_key_names_a_path_inside_the_directory(key: bytes) -> None:
    path = _STORE.page_path(key)
    assert path.parent.parent == _STORE.directory
    assert re.fullmatch(r"[0-9a-f]{2}", path.parent.name) and re.fullmatch(r"[0-9a-f]{32}\.page", path.name)
    assert os.path.commonpath([os.path.realpath(path), os.path.realpath(_STORE.directory)]) == os.path.realpath(
        _STORE.directory
    )


_STORE: DiskPageStore  # set by the module fixture below (hypothesis tests cannot take function fixtures)


@pytest.fixture(autouse=True, scope="module")
def _store(tmp_path_factory):
    global _STORE
    _STORE = DiskPageStore(SMALL_LAYOUT, PS, 8, tmp_path_factory.mktemp("keys"), Namespace.for_model(SMALL_LAYOUT, PS))


BAD_KEYS = [
    b"",
    b"\x00" * 15,
    b"\x00" * 17,
    b"../../../../etc/pass",
    "0" * 32,
    "../" * 6,
    bytearray(16),
    memoryview(b"x" * 16),
    7,
    None,
    1.5,
    ("a",),
]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda b: f"{type(b).__name__}{len(b) if hasattr(b, '__len__') else ''}")
def test_malformed_keys_raise_value_error_before_naming_a_path(bad) -> None:
    before = sorted(p.name for p in _STORE.directory.rglob("*"))
    for call in (
        lambda: _STORE.page_path(bad),
        lambda: _STORE.allocate([bad]),
        lambda: _STORE.free([bad]),
        lambda: _STORE.read([bad]),
        lambda: _STORE.write([bad], torch.zeros((1, *_STORE.page_shape), dtype=torch.bfloat16)),
        lambda: _STORE.read_into(bad, torch.zeros(_STORE.page_shape, dtype=torch.bfloat16)),
    ):
        with pytest.raises(ValueError):
            call()
    assert sorted(p.name for p in _STORE.directory.rglob("*")) == before


def test_cache_creates_owner_only_files_and_directories(tmp_path: Path) -> None:
    old = os.umask(0)  # the most permissive umask: the modes must come from the code
    try:
        c = cache_for(tmp_path / "a" / "b" / "tier")
        for p in PROMPTS:
            serve_as(c, p, seed=0)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    top = tmp_path / "a" / "b" / "tier"
    assert mode(top) == 0o700
    entries = list(top.rglob("*"))
    assert any(p.is_file() for p in entries)
    for p in entries:
        assert mode(p) == (0o700 if p.is_dir() else 0o600), (p, oct(mode(p)))
