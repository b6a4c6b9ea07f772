"""`sglang/rank_consensus.py` with two real ranks (two processes, torch.distributed on gloo, as SGLang's
TP cache group on CPU): transfer outcomes, give-ups and the clock agreed alike on both ranks; a digest
or count difference raises on BOTH ranks (never one rank waiting in a collective the other skipped).
The SGLang server at --tp 2 is covered by tests/server/test_sglang_e2e.py."""

from __future__ import annotations

import json
import os
import traceback

import pytest
from conftest import make_cache, run_ranks


def _op(cache, tokens):
    from sgl_hicache.transfer.ops import TransferOp

    cache.insert(tokens, cache.allocate_device(len(tokens) // cache.page_size))
    node = cache.match(tokens).last_node
    op = TransferOp(node, "disk", "host", [], [], 0, "prefetch")
    op.gated = True
    return op


class _RateOnly:
    """An executor stand-in that only reports a measured link rate (this rank's)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def link_tokens_per_s(self, link: str) -> float:
        return self.rate


def _rank_main(rank: int, size: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from sgl_hicache.policy.admission import PrefillCost
    from sgl_hicache.sglang.parallel.rank_consensus import RankConsensus, RankDivergenceError, tree_digest
    from sgl_hicache.tiers.base import PageCorruptError, PeerTierError, TierIOError

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
        c = RankConsensus(dist.group.WORLD, rank, size, check=True, max_ops=4, max_waiting=2)
        cache = make_cache(page_size=4)
        a, b = _op(cache, list(range(8))), _op(cache, list(range(100, 108)))
        # step 1: `a` has finished on rank 0 only; nothing is agreed yet
        if rank == 0:
            a.executed.set()
        c.step([a, b], [], digest=lambda: tree_digest(cache))
        out["a_agreed_early"] = a.agreed or a.settled
        # step 2: both finished everywhere; `a` failed on rank 1 (I/O), `b` is corrupt on rank 1
        a.executed.set()
        b.executed.set()
        if rank == 1:
            a.error = TierIOError("read failed")
            b.error = PageCorruptError("bad checksum")
        ticket = object()
        c.step([a, b], [(ticket, rank == 1)], digest=lambda: tree_digest(cache))
        out["a"] = [a.settled, type(a.error).__name__, getattr(a.error, "page_gone", None)]
        out["b"] = [b.settled, type(b.error).__name__, getattr(b.error, "page_gone", None)]
        out["peer_is_tier_error"] = isinstance(a.error, TierIOError) and (
            rank == 1 or isinstance(a.error, PeerTierError)
        )
        out["gave_up"] = c.gave_up(ticket)
        out["clock"] = c.clock()
        out["counts"] = vars(c.counts)
        # layer-wise loads: rank 0 finished both queued loads, rank 1 only the first: one is agreed on
        out["loads_agreed"] = c.step([], [], layer_loads=(2, 2 if rank == 0 else 1))
        # the disk -> host rate: the slowest rank's, on both; unknown while one rank has none
        gated = c.gate(_RateOnly(5000.0 if rank == 0 else 3000.0))
        c.step([], [], disk_read_tokens_per_s=gated.local_link_tokens_per_s("disk->host"))
        out["rate"] = [gated.link_tokens_per_s("disk->host"), gated.link_tokens_per_s("host->device")]
        c.step([], [], disk_read_tokens_per_s=5000.0 if rank == 0 else 0.0)
        out["rate_unknown"] = gated.link_tokens_per_s("disk->host")
        # the prefill cost admission weighs: the largest fixed part, the smallest per-token and per-pair parts
        mine = PrefillCost(0.05, 2e-5, 4e-7) if rank == 0 else PrefillCost(0.08, 3e-5, 2e-7)
        c.step([], [], prefill_cost=mine)
        out["cost"] = [c.prefill_cost.fixed_s, c.prefill_cost.per_token_s, c.prefill_cost.per_pair_s]
        c.step([], [], prefill_cost=PrefillCost(0.05, 0.0, 4e-7))  # no per-token part is still a cost
        out["cost_no_token_term"] = [c.prefill_cost.fixed_s, c.prefill_cost.per_token_s, c.prefill_cost.per_pair_s]
        c.step([], [], prefill_cost=mine if rank == 0 else None)
        out["cost_unknown"] = c.prefill_cost
        try:  # a different number of loads queued: both raise
            c.step([], [], layer_loads=(1 + rank, 0))
            out["loads_count"] = "no error"
        except RankDivergenceError as e:
            out["loads_count"] = str(e)
        # a tree that differs on one rank: both ranks raise at the same step
        if rank == 1:
            cache.insert(list(range(200, 204)), cache.allocate_device(1))
        try:
            c.step([], [], digest=lambda: tree_digest(cache))
            out["digest"] = "no error"
        except RankDivergenceError as e:
            out["digest"] = str(e)
        # different numbers of transfers in flight: both raise too (the vector's size is fixed)
        extra = [_op(cache, list(range(300, 304)))] if rank == 0 else []
        try:
            c.step(extra, [])
            out["count"] = "no error"
        except RankDivergenceError as e:
            out["count"] = str(e)
        dist.destroy_process_group()
    except BaseException:
        out["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_two_ranks_agree_and_fail_together(tmp_path):
    run_ranks(_rank_main, [(r, 2, str(tmp_path / "store"), str(tmp_path)) for r in range(2)])
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert "crash" not in r, r.get("crash")
    r0, r1 = res
    assert not r0["a_agreed_early"] and not r1["a_agreed_early"]
    # `a`: an I/O error on rank 1 only -> recorded as failed on both, the page kept (not gone)
    assert r0["a"] == [True, "PeerTierError", False] and r1["a"][:2] == [True, "TierIOError"]
    # `b`: corrupt on rank 1 -> failed on both, and gone on both (both drop the disk copy)
    assert r0["b"] == [True, "PeerTierError", True] and r1["b"][:2] == [True, "PageCorruptError"]
    assert r0["peer_is_tier_error"] and r1["peer_is_tier_error"]
    assert r0["gave_up"] and r1["gave_up"]  # rank 1 wanted to give up: both do
    assert r0["clock"] == r1["clock"]
    assert r0["counts"]["ops_failed_elsewhere"] == 2 and r1["counts"]["ops_failed_elsewhere"] == 0
    assert "digest differs" in r0["digest"] and "digest differs" in r1["digest"]
    assert "disagree" in r0["count"] and "disagree" in r1["count"]
    assert r0["loads_agreed"] == r1["loads_agreed"] == 1  # MIN of the loads finished in queue order
    # the predictor's budget reads the agreed disk -> host rate: equal on both ranks, the slower one's
    assert r0["rate"] == r1["rate"] == [3000.0, 0.0]
    assert r0["rate_unknown"] == r1["rate_unknown"] == 0.0
    # admission holds the same requests on both ranks: one agreed prefill cost, the fewest holds
    assert r0["cost"] == r1["cost"] and r0["cost"] == pytest.approx([0.08, 2e-5, 2e-7])
    assert r0["cost_no_token_term"] == r1["cost_no_token_term"] == pytest.approx([0.05, 0.0, 4e-7])
    assert r0["cost_unknown"] is None and r1["cost_unknown"] is None  # unknown while one rank has none
    assert "layer-wise loads" in r0["loads_count"] and "layer-wise loads" in r1["loads_count"]
