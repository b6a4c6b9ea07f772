"""Shared fixtures: a small KV layout and tiered caches built on it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

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
# What a test that needs SGLang carries: the `sglang` mark, and a skip where SGLang is not installed.
NEEDS_SGLANG = [pytest.mark.sglang, pytest.mark.skipif(SGLANG_MISSING is not None, reason=SGLANG_MISSING or "")]

# The tests are in folders by what they need, and the folder sets the marks (`_mark_by_folder`):
#   unit/         no SGLang: the core suite (mirrors the package: unit/cache/ tests sgl_hicache/cache/, ...;
#                 unit/adapter/ tests the SGLang adapter's parts that import no sglang)
#   with_sglang/  imports sglang, starts no server: marked `sglang`
#   server/       starts a real SGLang server: marked `sglang` and `server`
# (not `tests/sglang/`: tests/ is on sys.path, and a folder named sglang there would be an importable
# namespace package `sglang` in the core venv.) A test outside those two folders that needs SGLang carries
# the marks itself.
TESTS = Path(__file__).resolve().parent
FOLDER_MARKS = {"with_sglang": NEEDS_SGLANG, "server": [*NEEDS_SGLANG, pytest.mark.server]}

# Test modules import from one another by basename (`from test_sglang_e2e import make_model`), across
# folders too: every folder holding tests is on sys.path, as the one tests/ folder was. Basenames are
# unique over all the folders (pytest's default import mode refuses two of one name).
for _d in sorted({p.parent for p in TESTS.rglob("test_*.py")}):
    if str(_d) not in sys.path:
        sys.path.append(str(_d))

SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"

# SGLang servers the tests start on a CPU run with the CPU test layer (scripts/cpu/layer), which
# patches a process only when asked for; the product itself patches nothing.
os.environ.setdefault("SGLANG_CPU_TEST_LAYER", "1")


def mooncake_trace() -> Path:
    """The Mooncake conversation trace the repository ships (traces/). A missing file FAILS the test
    that needs it (never a skip): a test that silently does not run hides a broken checkout."""
    if not TRACE.is_file():
        pytest.fail(f"the shipped trace {TRACE} is missing from the checkout", pytrace=False)
    return TRACE


@pytest.fixture(scope="session", autouse=True)
def _no_shm_left_behind():
    """A stopped SGLang server leaves /dev/shm names behind, however a test started it (the README's
    commands, the example script, `SGLangServer`): at the session's end, remove those of SGLang's kinds
    made during it that no live process holds."""
    from sgl_hicache.client.server import orphan_shm_files

    since = time.time()
    yield
    for f in orphan_shm_files(since):
        f.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def mooncake_service():
    """A real Mooncake master + one holder on free ports of 127.0.0.1, for the whole session."""
    from sgl_hicache.tiers.store_local import start_mooncake

    with start_mooncake(segment_mb=128) as store:
        yield store


@pytest.fixture(scope="session")
def redis_service():
    """A real redis-server on a free port of 127.0.0.1, for the whole session."""
    from sgl_hicache.tiers.store_local import start_redis

    with start_redis(maxmemory_mb=128) as store:
        yield store


def run_ranks(target, args: list[tuple], timeout_s: float = 120.0) -> None:
    """Run `target(*args[r])` in one spawned process per rank (torch.distributed tests) and wait; a
    rank still running after `timeout_s` (a collective its peer skipped) is killed and fails the test."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"rank processes {hung} hung in a collective"


# The mechanism tests' configuration: eviction itself copies a dirty page one tier down and nothing runs
# in the background (no write-through at commit, no prediction), so each test decides every move.
# A test of the shipped policy passes its knobs (or uses `config.DEFAULT_POLICY`).
SYNCHRONOUS = dict(write_policy="write_back", disk_write_policy="write_back", eviction_demotes="all", predictor="none")


def make_cache(tmp_path=None, device=8, host=16, disk=32, page_size=4, priority=None, **kw) -> TieredCache:
    """A cache whose capacities are given in pages, in the `SYNCHRONOUS` configuration unless `kw` says otherwise."""
    kw = {**SYNCHRONOUS, **kw}
    cfg = CacheConfig(
        SMALL_LAYOUT,
        device_tokens=device * page_size,
        host_tokens=host * page_size,
        disk_tokens=disk * page_size if tmp_path is not None else 0,
        page_size=page_size,
        disk_dir=(tmp_path / "disk") if tmp_path is not None else None,
        **kw,
    )
    return TieredCache(cfg, priority=priority)


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
            kv = kv_for(cache, tokens)[len(m2.device_handles) :]
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
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                f"device KV differs for prompt {tokens[:2]}"
            )
        return n * cache.page_size
    finally:
        cache.unlock(m.last_node)


@pytest.fixture
def small_cache(tmp_path):
    return make_cache(tmp_path)


# ---- the SGLang suite must not pass by skipping ------------------------------------------------
# Tests marked `sglang` skip themselves where SGLang is not installed, so a plain `pytest` in the core
# venv still runs. A run that asked for them -- a `-m` expression that keeps them (`-m sglang`), or
# SGLHICACHE_REQUIRE_SGLANG=1 (scripts/test.sh sets it for the SGLang suite) -- is an error instead.
REQUIRE_SGLANG_ENV = "SGLHICACHE_REQUIRE_SGLANG"


def _sglang_import_error() -> str | None:
    try:
        import sglang  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import is "not available"
        return f"{type(exc).__name__}: {exc}"
    return None


def pytest_itemcollected(item):
    """Marks set by folder (`FOLDER_MARKS`), added as each test is collected, so `-m` sees them."""
    try:
        folder = item.path.relative_to(TESTS).parts[0]
    except ValueError:  # a test outside tests/
        return
    for mark in FOLDER_MARKS.get(folder, ()):
        item.add_marker(mark)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    required = os.environ.get(REQUIRE_SGLANG_ENV, "") not in ("", "0")
    selected = bool(config.getoption("markexpr", "")) and any(item.get_closest_marker("sglang") for item in items)
    if not (required or selected):
        return
    err = _sglang_import_error()
    if err is not None:
        why = (
            f"{REQUIRE_SGLANG_ENV}=1"
            if required
            else f"-m {config.getoption('markexpr')!r} selects tests marked sglang"
        )
        raise pytest.UsageError(
            f"{why}, but sglang cannot be imported ({err}) in {sys.executable}; these tests would only skip. "
            "Run them with the SGLang venv (scripts/install_sglang_cpu.sh), or deselect them with -m 'not sglang'."
        )
