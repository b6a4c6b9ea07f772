"""The composed cache: demotion down the tiers, promotion back up, restart, corruption, policies."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_device_kv, kv_for, make_cache, serve

from sgl_hicache.cache import TieredCache
from sgl_hicache.tiers.base import DEVICE, DISK, HOST
from sgl_hicache.transfer.handlers import execute


def seq(start: int, pages: int, page_size: int = 4) -> list[int]:
    return list(range(start, start + pages * page_size))


def fill(cache: TieredCache, prompts):
    for p in prompts:
        serve(cache, p)
        cache.check()


def test_device_eviction_demotes_to_host_then_disk(tmp_path):
    cache = make_cache(tmp_path, device=4, host=4, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(6)]
    fill(cache, prompts)
    m = cache.match(prompts[0], touch=False)
    assert m.tokens == 16 and m.disk_tokens == 16  # oldest went device -> host -> disk
    m = cache.match(prompts[4], touch=False)
    assert m.host_tokens == 16
    m = cache.match(prompts[5], touch=False)
    assert m.device_tokens == 16
    snap = cache.snapshot()
    assert snap["demoted_tokens"][DEVICE] >= 16 and snap["demoted_tokens"][HOST] >= 16
    assert snap["bytes_moved"]["host->disk"] > 0


def test_promotion_brings_pages_back_bit_identical(tmp_path):
    cache = make_cache(tmp_path, device=4, host=4, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(6)]
    fill(cache, prompts)
    assert cache.match(prompts[0], touch=False).disk_tokens == 16
    m = cache.promote(cache.match(prompts[0]))
    assert m.device_tokens == 16
    got = cache.stores[DEVICE].read(m.device_handles)
    assert torch.equal(got.view(torch.int16), kv_for(cache, prompts[0]).view(torch.int16))
    snap = cache.snapshot()
    assert snap["promoted_tokens"][HOST] >= 16 and snap["promoted_tokens"][DEVICE] >= 16
    cache.check()


def test_without_lower_tiers_eviction_drops(tmp_path):
    cache = make_cache(None, device=4, host=0)
    prompts = [seq(1000 * i, 4) for i in range(3)]
    fill(cache, prompts)
    assert cache.match(prompts[0], touch=False).tokens == 0
    assert cache.snapshot()["dropped_tokens"] == 32


def test_locked_nodes_are_never_evicted(tmp_path):
    cache = make_cache(None, device=4, host=0)
    a = seq(0, 2)
    serve(cache, a)
    m = cache.match(a)
    cache.lock(m.last_node)
    assert cache.allocate_device(3) is None  # only 2 free pages; a's 2 are locked
    fresh = cache.allocate_device(2)
    assert fresh is not None
    cache.free_device(fresh)
    assert cache.match(a, touch=False).device_tokens == 8
    cache.unlock(m.last_node)
    assert cache.allocate_device(4) is not None


def test_lru_and_lfu_pick_different_victims():
    def run(policy):
        clock = iter(range(10**6))
        cache = make_cache(None, device=4, host=0, eviction_policy=policy)
        cache.clock = lambda: next(clock)
        a, b, c = seq(0, 2), seq(100, 2), seq(200, 2)
        serve(cache, a)
        serve(cache, a)
        serve(cache, a)  # a: frequent but older
        serve(cache, b)  # b: recent, once
        serve(cache, c)  # needs 2 pages: evicts a (LRU) or b (LFU)
        return cache.match(a, touch=False).tokens, cache.match(b, touch=False).tokens

    assert run("lru") == (0, 8)
    assert run("lfu") == (8, 0)


def test_restart_gets_disk_hits_with_the_same_bytes(tmp_path):
    # write-through on both links: every inserted page reaches disk (the persistent configuration)
    cache = make_cache(
        tmp_path, device=4, host=4, disk=64, write_policy="write_through", disk_write_policy="write_through"
    )
    prompts = [seq(1000 * i, 4) for i in range(8)]
    fill(cache, prompts)
    del cache
    fresh = make_cache(tmp_path, device=4, host=4, disk=64)
    for p in prompts:
        m = fresh.match(p)
        assert m.disk_tokens == 16, p[:2]
        m = fresh.promote(m)
        assert m.device_tokens == 16
        got = fresh.stores[DEVICE].read(m.device_handles)
        assert torch.equal(got.view(torch.int16), kv_for(fresh, p).view(torch.int16))
        fresh.check()


def test_restart_extends_a_shared_prefix_from_disk(tmp_path):
    cache = make_cache(
        tmp_path, device=8, host=8, disk=64, write_policy="write_through", disk_write_policy="write_through"
    )
    fill(cache, [seq(0, 2) + seq(500, 2), seq(0, 2) + seq(900, 2)])
    fresh = make_cache(tmp_path, device=8, host=8, disk=64)
    assert fresh.match(seq(0, 2) + seq(500, 2)).disk_tokens == 16
    assert fresh.match(seq(0, 2) + seq(900, 2)).disk_tokens == 16  # sibling adopted under the shared prefix
    fresh.check()


def test_a_node_written_back_to_disk_frees_what_an_earlier_process_left_under_its_keys(tmp_path):
    # the tree looks at the disk only on a match: an insert makes a device node whose pages an
    # earlier process stored; writing it back must free those files first (else its allocation
    # finds its own keys taken) and store it in their place
    first = make_cache(
        tmp_path, device=4, host=4, disk=64, write_policy="write_through", disk_write_policy="write_through"
    )
    p, q = seq(0, 4), seq(7000, 4)
    fill(first, [p])
    assert first.stores[DISK].stored_pages == 4
    del first
    fresh = make_cache(tmp_path, device=8, host=8, disk=64)
    disk = fresh.stores[DISK]

    def write_back(cache, tokens):
        cache.insert(tokens, cache.allocate_device(4))
        [node] = cache.match(tokens, touch=False).path
        assert cache.copy_now(node, HOST, "backup", may_evict=False)
        ops = cache.plan_writeback(HOST, DISK, 10**6, 10**6)
        assert [op.node for op in ops] == [node]
        for op in ops:
            execute(op, cache.handlers)
            assert cache.complete(op)
        assert node.tiers() == (DEVICE, HOST, DISK)

    write_back(fresh, p)
    assert disk.stored_pages == 4  # rewritten in place of the earlier process's files
    fresh.check()
    write_back(fresh, q)
    assert disk.stored_pages == 8
    fresh.check()
    del fresh, disk
    again = make_cache(tmp_path, device=8, host=8, disk=64)
    for tokens in (p, q):
        assert again.match(tokens).disk_tokens == 16


def test_corrupt_disk_page_is_a_miss_counted_and_removed(tmp_path):
    cache = make_cache(
        tmp_path, device=4, host=4, disk=64, write_policy="write_through", disk_write_policy="write_through"
    )
    a, b = seq(0, 4), seq(5000, 4)
    fill(cache, [a, b])
    del cache
    fresh = make_cache(tmp_path, device=4, host=4, disk=64)
    disk = fresh.stores[DISK]
    second_key = fresh.match(a).path[0].keys[1]
    path = disk.page_path(second_key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    m = fresh.promote(fresh.match(a))
    # a transfer moves a whole node: the corrupt page makes the node (and all below it) a miss
    assert m.device_tokens == 0
    assert fresh.snapshot()["errors"].get("corrupt_pages") == 1
    assert not path.exists()
    fresh.check()
    assert fresh.match(a, touch=False).tokens == 0
    # the other prompt is untouched and still served from disk, bit-identical
    m = fresh.promote(fresh.match(b))
    assert m.device_tokens == 16
    got = fresh.stores[DEVICE].read(m.device_handles)
    assert torch.equal(got.view(torch.int16), kv_for(fresh, b).view(torch.int16))


def test_write_through_backs_up_inserts_to_host():
    cache = make_cache(None, device=8, host=8, write_policy="write_through")
    serve(cache, seq(0, 3))
    node = cache.match(seq(0, 3), touch=False).last_node
    assert node.host is not None and node.device is not None
    cache.check()


def test_selective_write_through_after_threshold_hits():
    cache = make_cache(None, device=8, host=8, write_policy="write_through_selective", write_through_threshold=2)
    a = seq(0, 2)
    serve(cache, a)
    serve(cache, a)
    assert cache.match(a, touch=False).last_node.host is None
    serve(cache, a)
    assert cache.match(a, touch=False).last_node.host is not None


def test_hit_accounting_per_tier(tmp_path):
    cache = make_cache(tmp_path, device=5, host=4, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(6)]
    fill(cache, prompts)
    assert cache.match(prompts[4], touch=False).host_tokens == 16
    serve(cache, prompts[4] + seq(77, 1))  # host hit of 16 + 4 new
    assert cache.match(prompts[0], touch=False).disk_tokens == 16
    serve(cache, prompts[0])  # disk hit
    hits = cache.snapshot()["hit_tokens"]
    assert hits[DISK] == 16 and hits[HOST] == 16 and hits[DEVICE] == 0
    assert cache.snapshot()["miss_tokens"] == 6 * 16 + 4


def test_a_job_waiting_on_another_jobs_host_copy_succeeds(tmp_path):
    cache = make_cache(tmp_path, device=4, host=8, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(5)]
    fill(cache, prompts)
    m = cache.match(prompts[0])
    assert m.disk_tokens == 16
    first = cache.plan_promotion(m, "prefetch", target=HOST)
    second = cache.plan_promotion(cache.match(prompts[0]), "prefetch", target=HOST)
    assert first is not None and second is not None
    assert all(st.waits_for is not None for st in second.stages)  # nothing copied twice
    for op in first.ops():
        execute(op, cache.handlers)
    assert cache.advance(first) and not first.failed
    assert cache.advance(second) and not second.failed
    cache.release(first)
    cache.release(second)
    assert cache.match(prompts[0], touch=False).host_tokens == 16
    cache.check()


def run_backups(cache: TieredCache, ops, link: str) -> int:
    """Execute and complete planned background copies inline; returns the bytes the link moved."""
    for op in ops:
        execute(op, cache.handlers)
        assert cache.complete(op)
    cache.check()
    moved = cache.snapshot()["bytes_moved"][link]
    assert moved == sum(op.nbytes for op in ops) > 0
    return moved


def test_a_disk_eviction_never_frees_the_pages_of_a_write_still_in_flight(tmp_path):
    """A background host -> disk copy stores its pages before the tree claims them (the claim comes
    when the copy is completed). A disk eviction in between must not take those pages for files no
    node refers to (orphans): before, it freed them and the tree then claimed pages the store no
    longer held (found by a long `predict` replay's end-of-run check)."""
    cache = make_cache(tmp_path, device=4, host=8, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(3)]
    fill(cache, prompts)  # 2 prompts demoted to host, not yet on disk
    ops = cache.plan_disk_writeback(clean_target_pages=8, max_pages=8)
    assert ops
    for op in ops:
        execute(op, cache.handlers)  # the bytes are on disk; the tree does not claim them yet
    disk = cache.stores[DISK]
    assert disk.stored_pages > cache.tree.pages[DISK]
    cache.evict(DISK, 2)
    assert all(disk.contains(k) for op in ops for k in op.dst_handles)
    for op in ops:
        assert cache.complete(op)
    cache.check()
    assert cache.tree.pages[DISK] == disk.stored_pages


def test_background_writeback_makes_host_eviction_a_free_drop(tmp_path):
    cache = make_cache(tmp_path, device=4, host=8, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(3)]
    fill(cache, prompts)  # 2 prompts demoted to host, not yet on disk
    assert cache.snapshot()["bytes_moved"]["host->disk"] == 0
    ops = cache.plan_disk_writeback(clean_target_pages=8, max_pages=8)
    assert ops and all(op.src == HOST and op.dst == DISK and op.kind == "backup" for op in ops)
    assert not cache.plan_disk_writeback(clean_target_pages=8, max_pages=8)  # nothing twice while in flight
    written = run_backups(cache, ops, "host->disk")
    assert cache.plan_disk_writeback(clean_target_pages=8, max_pages=8) == []  # target met: all host pages clean
    # evicting the host now drops clean copies: no further disk write, and the pages are still served
    cache.evict(HOST, 8)
    assert cache.snapshot()["bytes_moved"]["host->disk"] == written
    assert cache.promote(cache.match(prompts[0])).device_tokens == 16
    assert assert_device_kv(cache, prompts[0]) == 16
    cache.check()


def test_writeback_copies_a_prefix_in_use_so_its_children_can_follow(tmp_path):
    """A shared prefix that running requests always hold locked (a system prompt) is still written
    back: otherwise no node below it could ever reach the tier below (it stays prefix-closed) and every
    eviction of them would drop them (the real server got 0 host hits on the shipped trace this way)."""
    cache = make_cache(tmp_path, device=16, host=16, disk=32)
    system = seq(90_000, 1)
    turns = [system + seq(1000 * i, 2) for i in range(1, 4)]
    fill(cache, turns)
    held = cache.match(system + seq(5000, 1)).path[0]  # a running request holds the shared prefix
    cache.tree.lock(held)
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8)
    assert [op.node for op in ops] == [held]  # the prefix first: nothing below it qualifies yet
    run_backups(cache, ops, "device->host")
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=8, max_pages=8)
    assert ops and {op.node.parent for op in ops} == {held}  # then the turns below it
    for op in ops:
        execute(op, cache.handlers)
        assert cache.complete(op)
    cache.tree.unlock(held)
    copied = cache.snapshot()["bytes_moved"]["device->host"]
    assert cache.evict(DEVICE, cache.tree.pages[DEVICE]) > 0
    assert cache.snapshot()["bytes_moved"]["device->host"] == copied  # every page was clean: free drops
    for t in turns:  # and every turn is still served, from host
        assert cache.match(t, touch=False).host_tokens == len(t)
    cache.check()


def test_background_device_writeback_makes_device_eviction_a_free_drop(tmp_path):
    cache = make_cache(tmp_path, device=8, host=16, disk=32)
    prompts = [seq(1000 * i, 4) for i in range(2)]
    fill(cache, prompts)  # both on the device only (write-back: copied to host at eviction)
    assert cache.snapshot()["bytes_moved"]["device->host"] == 0
    ops = cache.plan_writeback(DEVICE, HOST, clean_target_pages=4, max_pages=8)
    # only the coldest prompt: the target is 4 clean pages
    assert [op.node for op in ops] == [cache.match(prompts[0], touch=False).path[-1]]
    assert all(op.src == DEVICE and op.dst == HOST and op.kind == "backup" for op in ops)
    assert not cache.plan_writeback(DEVICE, HOST, clean_target_pages=4, max_pages=8)  # in flight
    copied = run_backups(cache, ops, "device->host")
    assert cache.plan_writeback(DEVICE, HOST, clean_target_pages=4, max_pages=8) == []  # target met
    m = cache.match(prompts[0], touch=False)
    assert m.device_tokens == 16 and m.path[-1].host is not None  # on both tiers now
    # the coldest device pages go first and are clean: evicting them copies nothing
    assert cache.evict(DEVICE, 4) == 4
    assert cache.snapshot()["bytes_moved"]["device->host"] == copied
    assert cache.promote(cache.match(prompts[0])).device_tokens == 16
    assert assert_device_kv(cache, prompts[0]) == 16
    cache.check()
    with pytest.raises(ValueError, match="one tier down"):
        cache.plan_writeback(HOST, DEVICE, 4, 4)


def test_eviction_never_races_a_background_writeback(tmp_path):
    """A host eviction that needs a node's ancestor on disk while the ancestor's background copy is
    in flight: it must not adopt the half-recorded files (the copy would then complete onto a node
    already on disk), and it must use the copy once its bytes are there."""
    cache = make_cache(tmp_path, device=4, host=8, disk=32)
    a = seq(0, 2)
    fill(cache, [a, a[:8] + seq(500, 2), seq(9000, 4), seq(9500, 4)])  # a-prefix and its child pushed to host
    parent = cache.match(a, touch=False).path[0]
    assert parent.host is not None and parent.disk is None
    ops = cache.plan_disk_writeback(clean_target_pages=8, max_pages=parent.num_pages)
    assert [op.node for op in ops] == [parent]
    execute(ops[0], cache.handlers)  # bytes written, not yet completed (the engine's worker finished)
    child = next(iter(parent.children.values()))
    assert child.host is not None
    cache.copy_now(child, DISK, kind="demote", may_evict=True)  # completes the parent's backup, then writes the child
    assert ops[0].applied and parent.disk is not None and child.disk is not None
    assert cache.complete(ops[0])  # the worker's own completion later is harmless
    cache.check()
    # and while a copy's bytes are still in flight, the demotion gives up instead of racing it
    cache2 = make_cache(tmp_path / "b", device=4, host=8, disk=32)
    fill(cache2, [a, a[:8] + seq(500, 2), seq(9000, 4), seq(9500, 4)])
    p2 = cache2.match(a, touch=False).path[0]
    ops2 = cache2.plan_disk_writeback(clean_target_pages=8, max_pages=p2.num_pages)
    c2 = next(iter(p2.children.values()))
    assert not cache2.copy_now(c2, DISK, kind="demote", may_evict=True)
    execute(ops2[0], cache2.handlers)
    assert cache2.complete(ops2[0]) and p2.disk is not None
    cache2.check()
