"""Which recurrent-state snapshots of a hybrid model to keep (Mamba / linear attention + attention).

A hybrid model resumes a prefix only from the recurrent state at exactly the hit point, so a tree
node is a hit point only while a snapshot of the state at its end is kept. A snapshot costs its bytes
(SGLang's `mamba_cache_per_req`: 73.7 MiB for Qwen3-Next-80B at TP 1, the host room of ~3,100 tokens of
its KV); it saves recomputing the tokens between the nearest ancestor that has one and its node. One
per node, blindly, spends the tiers on states that each save a handful of tokens (sglang #24561).

The rule is Marconi's (Pan et al., MLSys 2025): keep a snapshot by its expected reuse times the FLOPs
it saves, per byte. Here: `priority = (1 + reuse) * recompute_flops(ancestor, depth) / state_bytes`,
where `recompute_flops` is the marginal prefill cost of the gap (linear in its length for the linear
and projection layers, growing with the context for the attention layers). Lowest first out, as the
eviction policies' `priority` (policy/eviction.py); `keep` fills a byte budget by priority.

Pure decisions: no tree, no store; the caller says each candidate's depth, its kept ancestor's
depth and its reuse count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class SnapshotCosts:
    """A hybrid model's costs, per TP rank.

    `state_bytes`: one snapshot (every linear layer's conv and recurrent state);
    `flops_per_token`: a token's prefill FLOPs that do not depend on its context (projections, MLP
    or MoE, the linear-attention recurrence), about 2 x the active parameters;
    `attention_flops_per_context_token`: what each earlier token adds to a token's attention FLOPs
    (about 4 x attention layers x query heads x head dim)."""

    state_bytes: int
    flops_per_token: float
    attention_flops_per_context_token: float

    def __post_init__(self) -> None:
        if self.state_bytes <= 0:
            raise ValueError(f"SnapshotCosts.state_bytes must be > 0, got {self.state_bytes!r}")
        if self.flops_per_token < 0 or self.attention_flops_per_context_token < 0:
            raise ValueError(
                "SnapshotCosts: FLOPs must be >= 0, got "
                f"{self.flops_per_token!r} / {self.attention_flops_per_context_token!r}"
            )

    def recompute_flops(self, start: int, end: int) -> float:
        """The prefill FLOPs of tokens `start .. end - 1` over the context before them."""
        if not 0 <= start <= end:
            raise ValueError(f"recompute_flops: need 0 <= start <= end, got {start}, {end}")
        n = end - start
        # sum over t in [start, end) of (flops_per_token + attention * t)
        return n * self.flops_per_token + self.attention_flops_per_context_token * n * (start + end - 1) / 2


class Candidate(NamedTuple):
    """A node that could hold a snapshot: `key` names it for the caller; `depth` is its end (tokens
    from the root); `ancestor_depth` the end of its nearest ancestor that keeps one (0: the root,
    whose state is the zero state); `reuse` how many hits its prefix has seen."""

    key: object
    depth: int
    ancestor_depth: int
    reuse: int = 0


def priority(costs: SnapshotCosts, c: Candidate) -> float:
    """FLOPs saved per byte, weighted by reuse: the lowest goes first."""
    return (1 + max(0, c.reuse)) * costs.recompute_flops(c.ancestor_depth, c.depth) / costs.state_bytes


def keep(
    costs: SnapshotCosts, candidates: Sequence[Candidate], budget_bytes: int, min_gap_tokens: int = 0
) -> list[object]:
    """The keys of the snapshots to keep within `budget_bytes`, highest priority first. A candidate
    closer than `min_gap_tokens` to its kept ancestor is never worth a snapshot. Ancestors are as the
    caller gives them: a candidate dropped here leaves its descendants' gaps longer, which the caller
    sees at its next decision (the choice is greedy, one step at a time)."""
    if budget_bytes < 0:
        raise ValueError(f"keep: budget_bytes must be >= 0, got {budget_bytes!r}")
    ranked = sorted(
        (c for c in candidates if c.depth - c.ancestor_depth >= max(1, min_gap_tokens)),
        key=lambda c: (-priority(costs, c), c.depth),
    )
    room = budget_bytes // costs.state_bytes
    return [c.key for c in ranked[:room]]


__all__ = ["Candidate", "SnapshotCosts", "keep", "priority"]
