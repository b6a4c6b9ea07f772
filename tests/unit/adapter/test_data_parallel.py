"""Data parallelism (`sglang/data_parallel.py`: `placement`, `group_consensus`, which the factory calls): each attention-DP rank is a tree
of its own that agrees only with its attention-TP group, the group SGLang passes the cache.

- `placement` reads the DP rank and the cache group from SGLang's context; the disk directory is
  shared by DP ranks whose groups have one rank and kept apart otherwise;
- four real ranks (gloo, as SGLang's CPU groups) at `--tp 4 --dp 2 --enable-dp-attention`: two
  attention-TP groups of two. The factory builds each rank's agreement over its group, not the TP
  world: a fault on one rank of group 0 fails that copy on both of group 0's ranks, and group 1,
  which runs a different number of steps meanwhile (its DP rank schedules other requests), never
  waits on group 0 (a collective over all four ranks would hang the test);
- `--tp 2 --dp 2 --enable-dp-attention`: each group has one rank, so no agreement is built.
The real server at `--tp 2 --dp 2 --enable-dp-attention` is tests/server/test_sglang_dp_attention.py.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import make_cache, run_ranks

from sgl_hicache.sglang.parallel.data_parallel import DPPlacement, placement


def _ctx(tp_size: int, tp_rank: int, group=None, **server_args):
    sa = SimpleNamespace(**{"enable_dp_attention": False, "dp_size": 1, "pp_size": 1, **server_args})
    return SimpleNamespace(
        server_args=sa, tp_size=tp_size, tp_rank=tp_rank, tp_group=None, params=SimpleNamespace(tp_cache_group=group)
    )


def test_placement_from_sglang_flags():
    # --tp 2 --dp 2 --enable-dp-attention: one rank per attention-TP group, DP rank = TP rank
    p = placement(_ctx(2, 1, enable_dp_attention=True, attn_dp_size=2))
    assert (p.dp_rank, p.dp_size, p.group_rank, p.group_size, p.attention_dp) == (1, 2, 0, 1, True)
    # the deprecated spelling (--dp-size N --enable-dp-attention, unresolved) means the same
    assert placement(_ctx(2, 1, enable_dp_attention=True, dp_size=2)) == p
    # --tp 4 --dp 2 --enable-dp-attention: groups of two; TP rank 3 is rank 1 of DP rank 1's group
    p = placement(_ctx(4, 3, attn_dp_size=2))
    assert (p.dp_rank, p.group_rank, p.group_size, p.tp_rank) == (1, 1, 2, 3)
    # no DP: the TP group is the cache group
    p = placement(_ctx(2, 1))
    assert (p.dp_size, p.group_rank, p.group_size, p.data_parallel) == (1, 1, 2, False)
    assert p.labels() == {}
    with pytest.raises(ValueError, match="inconsistent DP placement"):
        DPPlacement(dp_rank=2, dp_size=2)


def test_dp_ranks_share_a_directory_only_without_a_group_to_agree_with(tmp_path):
    alone = [DPPlacement(r, 2, 0, 1, r, True) for r in (0, 1)]
    assert {p.disk_dir(tmp_path) for p in alone} == {tmp_path}  # the shared-directory protocol
    grouped = [DPPlacement(r, 2, 0, 2, 2 * r, True) for r in (0, 1)]
    assert [p.disk_dir(tmp_path) for p in grouped] == [tmp_path / "dp2-rank0", tmp_path / "dp2-rank1"]
    assert DPPlacement().disk_dir(tmp_path) == tmp_path and alone[1].labels() == {"dp_rank": "1"}


def test_every_scheduler_process_has_its_own_stats_file_suffix():
    attn = [DPPlacement(r // 2, 2, r % 2, 2, r, True) for r in range(4)]  # --tp 4 --dp 2 --enable-dp-attention
    assert [p.file_suffix() for p in attn] == ["", ".rank1", ".rank2", ".rank3"]
    replicas = [DPPlacement(d, 2, t, 2, t) for d in range(2) for t in range(2)]  # --dp-size 2 --tp 2
    assert [p.file_suffix() for p in replicas] == ["", ".rank1", ".dp1", ".dp1.rank1"]


def _rank_main(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.parallel import rank_consensus
    from sgl_hicache.sglang.parallel.data_parallel import group_consensus
    from sgl_hicache.tiers.base import TierIOError
    from sgl_hicache.transfer.ops import TransferOp

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)
        # SGLang's attention-TP groups at --tp 4 --dp 2 --enable-dp-attention: {0, 1} and {2, 3}
        groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
        rank_consensus._hook_installed = True  # the plugin installs it in a server
        ctx = _ctx(4, rank, groups[rank // 2], enable_dp_attention=True, attn_dp_size=2)
        where = placement(ctx)
        c = group_consensus(ctx, DebugSettings(consensus_check=True), where)  # what the factory builds
        out["placement"] = where.describe()
        out["consensus"] = [c.rank, c.size, c.group is groups[rank // 2]]
        cache = make_cache(page_size=4)
        tokens = list(range(8))
        cache.insert(tokens, cache.allocate_device(2))
        op = TransferOp(cache.match(tokens).last_node, "disk", "host", [], [], 0, "prefetch")
        op.gated = True
        op.executed.set()
        if rank == 1:  # the fault: one rank of DP rank 0's group
            op.error = TierIOError("read fault injected")
        # DP rank 0's group agrees once; DP rank 1's group runs three steps of its own meanwhile
        steps = 1 if rank < 2 else 3
        for _ in range(steps):
            c.step([op], [], digest=lambda: rank_consensus.tree_digest(cache))
        out["op"] = [op.settled, type(op.error).__name__ if op.error is not None else None]
        out["steps"] = c.counts.steps
        dist.destroy_process_group()
    except BaseException:
        out["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def test_each_attention_tp_group_agrees_alone_and_a_fault_stays_in_its_group(tmp_path):
    run_ranks(_rank_main, [(r, str(tmp_path / "store"), str(tmp_path)) for r in range(4)], timeout_s=180)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in res:
        assert "crash" not in r, r.get("crash")
    for r, got in enumerate(res):
        assert got["placement"]["rank"] == r // 2 and got["placement"]["group_size"] == 2, got
        assert got["consensus"] == [r % 2, 2, True], got  # over the attention-TP group, not the TP world of 4
    # the fault on rank 1 fails the copy on both ranks of its group (rank 0 records the peer's failure)
    assert res[0]["op"] == [True, "PeerTierError"] and res[1]["op"] == [True, "TierIOError"]
    # DP rank 1's group saw no fault and agreed three steps without waiting for group 0
    assert res[2]["op"] == res[3]["op"] == [True, None]
    assert [r["steps"] for r in res] == [1, 1, 3, 3]


def test_one_rank_per_group_builds_no_agreement():
    from sgl_hicache.client.debug_settings import DebugSettings
    from sgl_hicache.sglang.parallel.data_parallel import group_consensus

    ctx = _ctx(2, 1, enable_dp_attention=True, attn_dp_size=2)  # --tp 2 --dp 2 --enable-dp-attention
    assert group_consensus(ctx, DebugSettings(), placement(ctx)) is None
    ctx = _ctx(4, 1, enable_dp_attention=True, attn_dp_size=2)  # --tp 4 --dp 2: a group of two, no group given
    with pytest.raises(ValueError, match="no group to agree over"):
        group_consensus(ctx, DebugSettings(), placement(ctx))
