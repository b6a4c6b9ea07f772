"""A replicated TP group (MLA at --tp 2) with two real ranks (two processes, torch.distributed on gloo, as
SGLang's TP cache group on CPU), no SGLang: `sglang/replicated.py` builds one shared host buffer and one
disk directory; a background copy device -> host and host -> disk is made by rank 0 alone, agreed by
the per-step all-reduce, and rank 1 then reads rank 0's bytes from the shared host slot; the trees,
host slots included, stay equal (digest checked; here each rank's device holds other bytes, to show
whose a rank reads); at a restart rank 1 indexes rank 0's disk pages.
The SGLang server at --tp 2: tests/server/test_sglang_e2e_mla.py::test_mla_tp2_one_rank_writes_both_read."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

from conftest import SYNCHRONOUS, run_ranks

LAYERS, WIDTH, PAGE = 2, 24, 4


def _group_cache(consensus, tmp: str):
    from sgl_hicache.config import CacheConfig, KVLayout
    from sgl_hicache.control.composition import build_cache
    from sgl_hicache.sglang.parallel.replicated_group import follow, replicated_tiers
    from sgl_hicache.tiers.memory import DeviceKVPool

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=WIDTH, kv_planes=1, architecture="mla-test")
    cfg = CacheConfig(
        layout,
        device_tokens=8 * PAGE,
        host_tokens=16 * PAGE,
        disk_tokens=32 * PAGE,
        page_size=PAGE,
        disk_dir=consensus.rank_dir(Path(tmp) / "disk"),
        tenant_salt=consensus.salt,
        **SYNCHRONOUS,
    )
    host, lower = replicated_tiers(consensus, cfg)
    cache = build_cache(cfg, device=DeviceKVPool(layout, PAGE, 8, device="cpu"), host=host, lower=lower)
    follow(cache, consensus)
    consensus.start(cache)
    return cache


def _agree(cache, consensus, op) -> None:
    """What the server does with a background copy: execute it here, agree at the next step, complete."""
    from sgl_hicache.sglang.parallel.rank_consensus import tree_digest
    from sgl_hicache.transfer.handlers import execute

    op.gated = True
    execute(op, cache.handlers)
    while not op.agreed:
        consensus.step([op], [], digest=lambda: tree_digest(cache, host_handles=True))
    assert cache.complete(op), op.error


def _rank_main(scenario: str, rank: int, store_path: str, tmp: str) -> None:
    """One rank: a gloo group of two, a replicated consensus, then `scenario`; what it found (or how it
    crashed) goes to `<tmp>/<scenario><rank>.json`."""
    import torch.distributed as dist

    from sgl_hicache.sglang.parallel.rank_consensus import RankConsensus

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
        c = RankConsensus(dist.group.WORLD, rank, 2, check=True)
        c.replicate()
        SCENARIOS[scenario](c, rank, tmp, out)
        dist.destroy_process_group()
    except BaseException:
        out["crash"] = traceback.format_exc()
    Path(tmp, f"{scenario}{rank}.json").write_text(json.dumps(out))


def _results(scenario: str, tmp_path) -> tuple[dict, dict]:
    run_ranks(_rank_main, [(scenario, r, str(tmp_path / "store"), str(tmp_path)) for r in range(2)])
    r0, r1 = (json.loads((tmp_path / f"{scenario}{r}.json").read_text()) for r in range(2))
    assert "crash" not in r0 and "crash" not in r1, (r0.get("crash"), r1.get("crash"))
    return r0, r1


def _writes_once(c, rank: int, tmp: str, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from sgl_hicache.sglang.parallel.rank_consensus import RankConsensus, tree_digest
    from sgl_hicache.tiers.base import DEVICE, DISK, HOST

    cache = _group_cache(c, tmp)
    host = cache.stores[HOST]
    out["pid"] = os.getpid()
    tokens = list(range(16))
    dev = cache.allocate_device(4)
    # other KV on each rank (MLA's is the same; here it shows whose bytes a rank reads)
    g = torch.Generator().manual_seed(7 + rank)
    cache.stores[DEVICE].write(dev, torch.randn((4, LAYERS, 1, PAGE, 1, WIDTH), generator=g).to(torch.bfloat16))
    cache.insert(tokens, dev)
    node = cache.match(tokens).last_node
    _agree(cache, c, cache.copies.reserve(node, HOST, "backup", evict=False))

    def sig(t):
        return int(t.view(torch.int16).to(torch.int64).abs().sum())

    out["host_sig"], out["device_sig"] = sig(host.read(node.host)), sig(cache.stores[DEVICE].read(node.device))
    out["host_slots"] = list(node.host)
    _agree(cache, c, cache.copies.reserve(node, DISK, "backup", evict=False))
    out["left_to_leader"] = dict(c.counts.left_to_leader)
    out["files"] = len(list((Path(tmp) / "disk").rglob("*.page")))
    out["dirs"] = sorted(p.name for p in (Path(tmp) / "disk").iterdir())
    keys = list(node.disk)
    c.step([], [], digest=lambda: tree_digest(cache, host_handles=True))
    out["digests"] = c.counts.digests_checked
    # a cancelled copy still running on rank 0 (rank 1 skipped it at once): neither rank frees its
    # slots until they agree rank 0 stopped, so no rank hands them to another page meanwhile
    from sgl_hicache.transfer.handlers import execute

    tokens2 = list(range(100, 108))
    cache.insert(tokens2, cache.allocate_device(2))
    node2 = cache.match(tokens2).last_node
    op = cache.copies.reserve(node2, HOST, "backup", evict=False)
    op.gated = op.shared_dst = True
    if rank == 1:
        execute(op, cache.handlers)
    op.cancelled = True
    c.step([op], [])
    out["stopped_before"] = [op.stopped, op.settled]
    if rank == 0:
        execute(op, cache.handlers)  # its worker ends
    while not op.agreed:
        c.step([op], [])
    out["stopped_after"] = op.stopped
    cache.complete(op)
    out["next_slots"] = list(host.allocate([b"k"]))
    close = getattr(cache.stores[DISK], "close", None)
    if close is not None:
        close()
    # a restart: a new group cache over the same directory; rank 1 indexes rank 0's pages
    c2 = RankConsensus(dist.group.WORLD, rank, 2, check=True)
    c2.replicate()
    again = _group_cache(c2, tmp)
    out["restart_has_pages"] = all(again.stores[DISK].contains(k) for k in keys)


def test_a_replicated_group_writes_once_and_reads_everywhere(tmp_path):
    r0, r1 = _results("writes_once", tmp_path)
    assert not list(Path("/dev/shm").glob(f"sgl_hicache-host-{r0['pid']}-*"))  # the name went once both mapped it
    # both ranks' host slots hold rank 0's device bytes: rank 0 wrote them, rank 1 reads them
    assert r0["host_sig"] == r1["host_sig"] == r0["device_sig"] != r1["device_sig"]
    assert r0["host_slots"] == r1["host_slots"]
    assert r0["left_to_leader"] == {} and r1["left_to_leader"] == {"device->host": 4, "host->disk": 4}
    assert r0["files"] == r1["files"] == 4 and r0["dirs"] == ["tp2-shared"]  # one copy, no rank directory
    assert r0["digests"] >= 3 and r1["digests"] >= 3
    assert r0["restart_has_pages"] and r1["restart_has_pages"]
    assert (
        r0["stopped_before"] == r1["stopped_before"] == [False, False] and r0["stopped_after"] and r1["stopped_after"]
    )
    assert r0["next_slots"] == r1["next_slots"]


def _too_big(c, rank: int, tmp: str, out: dict) -> None:
    from sgl_hicache.config import CacheConfig, KVLayout
    from sgl_hicache.sglang.parallel.replicated_group import replicated_tiers
    from sgl_hicache.tiers.replicated import shared_memory_dir

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=WIDTH, kv_planes=1)
    st = os.statvfs(shared_memory_dir())
    tokens = 2 * st.f_bavail * st.f_frsize // layout.bytes_per_token  # twice the room there is
    try:
        replicated_tiers(
            c, CacheConfig(layout, device_tokens=8 * PAGE, host_tokens=tokens, page_size=PAGE, **SYNCHRONOUS)
        )
        out["error"] = "none"
    except OSError as exc:
        out["error"] = str(exc)


SCENARIOS = {"writes_once": _writes_once, "too_big": _too_big}


def test_a_shared_host_buffer_that_does_not_fit_fails_on_every_rank_without_a_hang(tmp_path):
    r0, r1 = _results("too_big", tmp_path)
    assert r0["error"] == r1["error"] and "GiB free" in r0["error"] and "host_tokens" in r0["error"], (r0, r1)
