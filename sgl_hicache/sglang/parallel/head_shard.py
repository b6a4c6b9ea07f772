"""Which KV heads of the model this rank's cache holds (`config.HeadShard`), from SGLang's pool and
model config: what lets servers of different TP sizes read one disk directory.

SGLang splits an MHA / GQA model's KV heads evenly over the attention TP ranks (rank r of N holds
heads `[r*H/N, (r+1)*H/N)`), so a rank's page is a slice of the whole model's page along the heads.
No shard (the per-rank layout keyed by TP size, `RankConsensus.rank_dir`) where that does not hold:
heads replicated over ranks (TP above the KV head count), every rank holding the same KV (MLA: one
copy for the group already), and kinds whose pages carry more than KV heads (a hybrid model's
recurrent-state snapshots are sharded otherwise; DSA's indexer keys).
"""

from __future__ import annotations

from typing import Any

from ...config import HeadShard

SHARDABLE_KINDS = frozenset({"mha", "swa", "draft"})


def total_kv_heads(model_config: Any) -> int | None:
    """The model's KV head count before TP splits it (SGLang's `ModelConfig.get_total_num_kv_heads`), or None."""
    get = getattr(model_config, "get_total_num_kv_heads", None)
    try:
        return int(get()) if callable(get) else None
    except Exception:
        return None


def head_shard(adapter: Any, local_heads: int, rank: int, size: int, total: int | None) -> HeadShard | None:
    """This rank's shard of the heads (`whole` at TP 1), or None where pages cannot be split by head
    (see the module docstring). `local_heads`: the heads of this rank's pool; `total`: the model's
    (None: taken as `local_heads * size`)."""
    if getattr(adapter, "kind", "") not in SHARDABLE_KINDS or getattr(adapter, "replicated_across_tp", False):
        return None
    total = local_heads * size if total is None else total
    if local_heads * size != total:
        return None  # TP above the KV head count: ranks hold replicated heads
    return HeadShard(rank * local_heads, (rank + 1) * local_heads, total)


__all__ = ["SHARDABLE_KINDS", "head_shard", "total_kv_heads"]
