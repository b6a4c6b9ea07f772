"""Which recurrent-state snapshots a hybrid model keeps (policy/snapshots.py): reuse x FLOPs saved
per byte (Marconi), never one per node blindly. No SGLang."""

from __future__ import annotations

import pytest

from sgl_hicache.policy.snapshots import Candidate, SnapshotCosts, keep, priority

# Qwen3-Next-80B-A3B at TP 1, roughly: a 73.7 MiB state, ~3 B active parameters (6 GFLOP a token),
# 12 attention layers x 16 query heads x 256 dims (4 x that = 196,608 FLOPs per context token)
QWEN3_NEXT = SnapshotCosts(state_bytes=77_266_944, flops_per_token=6e9, attention_flops_per_context_token=196_608.0)


def test_recompute_flops_is_the_prefill_of_the_gap():
    c = SnapshotCosts(state_bytes=10, flops_per_token=2.0, attention_flops_per_context_token=1.0)
    # tokens 2, 3, 4: 3 x 2 + (2 + 3 + 4) x 1
    assert c.recompute_flops(2, 5) == 15.0
    assert c.recompute_flops(7, 7) == 0.0
    # the same gap deeper in a context costs more (attention over a longer prefix)
    assert c.recompute_flops(100, 110) > c.recompute_flops(0, 10)
    with pytest.raises(ValueError, match="start <= end"):
        c.recompute_flops(5, 2)


def test_a_snapshot_just_below_another_is_worth_little():
    """Not one per node: a node 16 tokens below a kept snapshot saves 16 tokens' prefill for a whole
    state's bytes; one 4,000 tokens below saves 250x more for the same bytes."""
    near = Candidate("near", depth=4016, ancestor_depth=4000)
    far = Candidate("far", depth=4000, ancestor_depth=0)
    assert priority(QWEN3_NEXT, far) > 200 * priority(QWEN3_NEXT, near)
    assert keep(QWEN3_NEXT, [near, far], budget_bytes=QWEN3_NEXT.state_bytes) == ["far"]
    assert keep(QWEN3_NEXT, [near, far], budget_bytes=10 * QWEN3_NEXT.state_bytes, min_gap_tokens=64) == ["far"]


def test_reuse_weighs_in():
    """A prefix hit often is worth its snapshot over a longer gap hit never (reuse x FLOPs saved)."""
    hot = Candidate("hot", depth=1000, ancestor_depth=0, reuse=9)
    cold = Candidate("cold", depth=3000, ancestor_depth=0, reuse=0)
    assert keep(QWEN3_NEXT, [cold, hot], budget_bytes=QWEN3_NEXT.state_bytes) == ["hot"]


def test_the_budget_counts_whole_snapshots_at_their_size():
    cands = [Candidate(i, depth=1000 * (i + 1), ancestor_depth=1000 * i) for i in range(5)]
    assert keep(QWEN3_NEXT, cands, budget_bytes=3 * QWEN3_NEXT.state_bytes - 1) == [4, 3]  # deeper gaps cost more
    assert keep(QWEN3_NEXT, cands, budget_bytes=0) == []
    with pytest.raises(ValueError, match="budget_bytes"):
        keep(QWEN3_NEXT, cands, budget_bytes=-1)


def test_bad_costs_are_named():
    with pytest.raises(ValueError, match="state_bytes"):
        SnapshotCosts(state_bytes=0, flops_per_token=1.0, attention_flops_per_context_token=0.0)
    with pytest.raises(ValueError, match="FLOPs"):
        SnapshotCosts(state_bytes=1, flops_per_token=-1.0, attention_flops_per_context_token=0.0)
