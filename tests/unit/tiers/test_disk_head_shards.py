"""A disk tier any TP size reads: caches holding different shards of the KV heads (TP ranks of
different TP sizes) share one base directory; each writes only its heads' directory and serves a page
the others wrote, assembled head by head, bit for bit, never from a page of the wrong shape."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from sgl_hicache.cache import TieredCache
from sgl_hicache.config import CacheConfig, ConfigError, HeadShard, KVLayout
from sgl_hicache.hashing import Namespace, chain_keys
from sgl_hicache.tiers.base import DEVICE, DISK, PageCorruptError, PageGoneError
from sgl_hicache.tiers.disk import DiskPageStore, HeadShardDiskStore
from sgl_hicache.tiers.disk.head_shards import cover, shard_dir, shards_under

HEADS = 4
PS = 4
WHOLE = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=8, dtype="bfloat16")


def shard_layout(shard: HeadShard) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=shard.heads, head_dim=8, dtype="bfloat16")


def model_kv(tokens: list[int]) -> torch.Tensor:
    """The whole model's KV pages of `tokens` (every head), a function of the tokens."""
    pages = len(tokens) // PS
    out = torch.empty((pages, 2, 2, PS, HEADS, 8), dtype=torch.bfloat16)
    for p in range(pages):
        g = torch.Generator().manual_seed(hash(tuple(tokens[: (p + 1) * PS])) % (2**31))
        out[p] = torch.randn(out.shape[1:], generator=g).to(torch.bfloat16)
    return out


def cache_for(base: Path, shard: HeadShard) -> TieredCache:
    cfg = CacheConfig(
        shard_layout(shard),
        device_tokens=8 * PS,
        host_tokens=8 * PS,
        disk_tokens=256 * PS,
        page_size=PS,
        disk_dir=base,
        write_policy="write_through",
        disk_write_policy="write_through",
        eviction_demotes="all",
        predictor="none",
        head_shard=shard,
    )
    return TieredCache(cfg)


def serve(cache: TieredCache, tokens: list[int]) -> None:
    """One request whose computed KV is this shard's heads of the model's; its pages reach disk."""
    shard = cache.config.head_shard
    assert shard is not None
    m = cache.promote(cache.match(tokens))
    cache.lock(m.last_node)
    try:
        need = len(tokens) // PS - len(m.device_handles)
        fresh = cache.allocate_device(need)
        assert fresh is not None
        if fresh:
            kv = model_kv(tokens)[len(m.device_handles) :, :, :, :, shard.lo : shard.hi]
            cache.stores[DEVICE].write(fresh, kv.contiguous())
        r = cache.insert(tokens, m.device_handles + fresh)
        cache.free_device(r.duplicates)
    finally:
        cache.unlock(m.last_node)


def served_kv(cache: TieredCache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """(tokens matched on disk, the KV the match puts on device)."""
    m = cache.match(tokens)
    disk_tokens = m.disk_tokens
    m = cache.promote(m)
    return disk_tokens, cache.stores[DEVICE].read(m.device_handles)


PROMPTS = [list(range(100 * i, 100 * i + 3 * PS)) for i in range(1, 5)]
TP = {
    1: [HeadShard(0, 4, 4)],
    2: [HeadShard(0, 2, 4), HeadShard(2, 4, 4)],
    4: [HeadShard(h, h + 1, 4) for h in range(4)],
}


@pytest.mark.parametrize(("written", "read"), [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4)])
def test_pages_written_at_one_tp_size_are_served_at_another(tmp_path: Path, written: int, read: int) -> None:
    for shard in TP[written]:  # every rank of the writing server
        c = cache_for(tmp_path, shard)
        for p in PROMPTS:
            serve(c, p)
        c.stores[DISK].close()
    for shard in TP[read]:
        c = cache_for(tmp_path, shard)
        disk = c.stores[DISK]
        assert disk.counters["borrowed_pages"] == len(PROMPTS) * 3 and list(disk.own_keys()) == []
        assert disk.free_pages == disk.capacity_pages  # borrowed pages take none of its room
        for p in PROMPTS:
            hit, got = served_kv(c, p)
            assert hit == len(p)
            want = model_kv(p)[:, :, :, :, shard.lo : shard.hi]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (written, read, shard)
        assert disk.counters["borrowed_reads"] == len(PROMPTS) * 3
        c.check()
        disk.close()
    # nothing was written into another shard's directory
    for shard in TP[written]:
        d = shard_dir(tmp_path, shard)
        assert len(list(d.glob("??/*.page"))) == len(PROMPTS) * 3


def test_a_page_some_of_whose_heads_are_missing_is_not_served(tmp_path: Path) -> None:
    lo, hi = TP[2]
    a = cache_for(tmp_path, lo)
    serve(a, PROMPTS[0])
    serve(a, PROMPTS[1])
    b = cache_for(tmp_path, hi)
    serve(b, PROMPTS[0])  # heads 2-3 of PROMPTS[1] were never written
    a.stores[DISK].close()
    b.stores[DISK].close()
    whole = cache_for(tmp_path, TP[1][0])
    assert served_kv(whole, PROMPTS[0])[0] == len(PROMPTS[0])
    assert whole.match(PROMPTS[1]).tokens == 0


def test_a_corrupt_or_vanished_piece_fails_the_read_and_forgets_the_page(tmp_path: Path) -> None:
    for shard in TP[2]:
        c = cache_for(tmp_path, shard)
        serve(c, PROMPTS[0])
        c.stores[DISK].close()
    ns = Namespace.for_model(WHOLE, PS)
    keys = chain_keys(ns.root, PROMPTS[0], PS)
    victim = shard_dir(tmp_path, TP[2][1]) / keys[1].hex()[:2] / f"{keys[1].hex()}.page"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    store = HeadShardDiskStore(WHOLE, PS, 64, tmp_path, TP[1][0], ns)
    (shard_dir(tmp_path, TP[2][0]) / keys[2].hex()[:2] / f"{keys[2].hex()}.page").unlink()  # after it opened
    out = torch.empty(store.page_shape, dtype=torch.bfloat16)
    store.read_into(keys[0], out)
    assert torch.equal(out.view(torch.int16), model_kv(PROMPTS[0])[0].view(torch.int16))
    with pytest.raises(PageCorruptError):
        store.read_into(keys[1], out)
    with pytest.raises(PageGoneError):
        store.read_into(keys[2], out)
    assert not store.contains(keys[1]) and not store.contains(keys[2]) and store.contains(keys[0])
    store.close()


def test_freeing_a_borrowed_page_forgets_it_and_keeps_its_files(tmp_path: Path) -> None:
    c = cache_for(tmp_path, TP[1][0])
    serve(c, PROMPTS[0])
    c.stores[DISK].close()
    ns = Namespace.for_model(WHOLE, PS)
    keys = chain_keys(ns.root, PROMPTS[0], PS)
    shard = TP[2][0]
    store = HeadShardDiskStore(shard_layout(shard), PS, 64, tmp_path, shard, ns)
    assert store.stored_pages == 3 and sorted(store.keys()) == sorted(keys)
    store.free([keys[0]])
    assert not store.contains(keys[0]) and store.stored_pages == 2
    assert len(list(tmp_path.glob("??/*.page"))) == 3
    with pytest.raises(KeyError):
        store.free([keys[0]])
    # its own copy replaces a borrowed one
    assert store.allocate([keys[1]]) == [keys[1]]
    mine = torch.zeros((1, *store.page_shape), dtype=torch.bfloat16)
    store.write([keys[1]], mine)
    out = torch.empty(store.page_shape, dtype=torch.bfloat16)
    store.read_into(keys[1], out)
    assert torch.equal(out, mine[0]) and list(store.own_keys()) == [keys[1]] and store.stored_pages == 2
    store.close()


def test_pages_another_shard_writes_later_are_discovered(tmp_path: Path) -> None:
    ns = Namespace.for_model(WHOLE, PS)
    writer_shard = TP[2][1]
    writer = DiskPageStore(shard_layout(writer_shard), PS, 64, shard_dir(tmp_path, writer_shard), ns)
    reader_shard = TP[4][3]
    reader = HeadShardDiskStore(shard_layout(reader_shard), PS, 64, tmp_path, reader_shard, ns)
    key = chain_keys(ns.root, PROMPTS[0], PS)[0]
    assert not reader.discover(key)
    page = model_kv(PROMPTS[0])[:1, :, :, :, 2:4].contiguous()
    writer.allocate([key])
    writer.write([key], page)
    assert reader.discover(key) and reader.contains(key)
    out = torch.empty(reader.page_shape, dtype=torch.bfloat16)
    reader.read_into(key, out)
    assert torch.equal(out, page[0, :, :, :, 1:2])
    writer.close()
    reader.close()


def test_keys_and_namespace_do_not_depend_on_the_tp_size(tmp_path: Path) -> None:
    caches = [cache_for(tmp_path / str(s), s) for s in (TP[1][0], TP[2][1], TP[4][0])]
    roots = {c.tree.namespace.root for c in caches}
    assert roots == {Namespace.for_model(WHOLE, PS).root}
    with pytest.raises(ConfigError, match="head_shard"):
        CacheConfig(WHOLE, device_tokens=PS, page_size=PS, head_shard=HeadShard(0, 2, 4))
    with pytest.raises(ConfigError, match="HeadShard"):
        HeadShard(2, 2, 4)


def test_cover_and_the_directories_found(tmp_path: Path) -> None:
    two, four = TP[2], TP[4]
    assert cover(TP[1][0], two) == two
    assert cover(HeadShard(1, 3, 4), four) == four[1:3]
    assert cover(HeadShard(1, 3, 4), [TP[1][0], *four]) == [TP[1][0]]
    assert cover(TP[1][0], four[:3]) is None
    for s in (*two, four[3]):
        shard_dir(tmp_path, s).mkdir()
    (tmp_path / "heads3-9").mkdir()  # not a shard of a 4-head model
    (tmp_path / "notes").mkdir()
    assert shards_under(tmp_path, 4) == [two[0], two[1], four[3]]
    (tmp_path / "ab").mkdir()  # a fan-out directory: the whole model's pages live in the base
    assert shards_under(tmp_path, 4)[0] == TP[1][0]


def test_a_directory_of_the_tp_keyed_layout_is_named_and_not_read(tmp_path: Path, caplog) -> None:
    (tmp_path / "tp2-rank0").mkdir()
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tiers.disk"):
        c = cache_for(tmp_path, TP[2][0])
    assert "tp2-rank0" in caplog.text and "not read" in caplog.text
    assert c.stores[DISK].stored_pages == 0
    c.stores[DISK].close()
