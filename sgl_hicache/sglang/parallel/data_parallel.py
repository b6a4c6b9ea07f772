"""Where one backend instance sits in SGLang's data parallelism: DP attention (`--enable-dp-attention`,
`--attn-dp-size`) and data-parallel replicas (`--dp-size`).

Every attention-DP rank and every replica runs its own scheduler with its own tree cache, so each is a
tree of its own. The ranks a tree must agree with are the group SGLang hands the cache
(`CacheInitParams.tp_cache_group`: `get_dp_tp_group()`, the attention-TP group of this DP rank with
DP attention, the whole TP group otherwise, `mem_cache/kv_cache_builder.py:402`), never the full
`--tp`: at `--tp 8 --dp 8 --enable-dp-attention` each rank's group has size 1 and it agrees with
nobody; at `--tp 4 --dp 2` it agrees with one peer.

Files: the DP ranks of one server are replicas of one model, so their pages are the same bytes.
- Cache group of size 1 (no agreement): the DP ranks share the one disk directory through the
  shared-directory protocol that separate servers use (`tiers/disk`, `flock`): a page one DP rank
  wrote is a disk hit on the others.
- Cache group of size >= 2: each DP rank keeps its own subdirectory, `<disk_dir>/dp<D>-rank<d>`
  (then `tp<N>-rank<r>` or `tp<N>-shared` inside, `RankConsensus.rank_dir`): the ranks of a group
  adopt disk pages only at the agreed start, and a page another group wrote meanwhile would appear
  on one rank's disk before its peer's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...client.debug_settings import DebugSettings
from ..coverage import PREFIX as _REFUSAL
from .rank_consensus import RankConsensus, step_hook_installed


@dataclass(frozen=True)
class DPPlacement:
    """One cache's place: `dp_rank` of `dp_size` (attention-DP ranks, or replicas; 0 of 1 without
    DP), `group_rank` of `group_size` (the cache group it agrees over), `tp_rank` (SGLang's global TP
    rank, which names per-process files)."""

    dp_rank: int = 0
    dp_size: int = 1
    group_rank: int = 0
    group_size: int = 1
    tp_rank: int = 0
    attention_dp: bool = False

    def __post_init__(self) -> None:
        if not (0 <= self.dp_rank < self.dp_size and 0 <= self.group_rank < self.group_size and self.tp_rank >= 0):
            raise ValueError(f"sgl_hicache: inconsistent DP placement {self}")

    @property
    def data_parallel(self) -> bool:
        return self.dp_size > 1

    def disk_dir(self, base: Path) -> Path:
        """The DP rank's directory under `base` (see the module docstring)."""
        if self.data_parallel and self.group_size > 1:
            return Path(base) / f"dp{self.dp_size}-rank{self.dp_rank}"
        return Path(base)

    def file_suffix(self) -> str:
        """What tells this scheduler process's per-process files (the stats file) apart from its
        peers': `.rank<tp_rank>` (the TP rank is unique across attention-DP ranks), and `.dp<d>` before
        it for a replica past the first (replicas repeat TP ranks). Empty for TP rank 0 of DP rank 0."""
        replica = f".dp{self.dp_rank}" if self.data_parallel and not self.attention_dp and self.dp_rank else ""
        return replica + (f".rank{self.tp_rank}" if self.tp_rank else "")

    def labels(self) -> dict[str, str]:
        """Prometheus labels that tell the DP ranks' figures apart (none without DP)."""
        return {"dp_rank": str(self.dp_rank)} if self.data_parallel else {}

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.dp_rank,
            "size": self.dp_size,
            "attention_dp": self.attention_dp,
            "group_rank": self.group_rank,
            "group_size": self.group_size,
            "tp_rank": self.tp_rank,
        }


def _group_rank_size(group: Any) -> tuple[int, int] | None:
    """(rank, size) of this process in a torch.distributed group (None: no group / not initialised)."""
    if group is None:
        return None
    try:
        import torch.distributed as dist

        return dist.get_rank(group=group), dist.get_world_size(group=group)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None


def _sglang_parallel() -> Any:
    """SGLang's published parallel context, where this process runs SGLang (None elsewhere: a
    context built by hand, or not published yet)."""
    module = sys.modules.get("sglang.srt.runtime_context")  # a scheduler has loaded it long before
    try:
        return module.get_parallel() if module is not None else None
    except Exception:
        return None


def _read(obj: Any, name: str, default: Any) -> Any:
    try:
        value = getattr(obj, name)
    except Exception:
        return default
    return default if value is None else value


def placement(ctx: Any) -> DPPlacement:
    """This cache's `DPPlacement`, from SGLang's tree-cache context (`TreeCacheBuildContext`): the
    cache group `ctx.params.tp_cache_group` (its rank and size; without one, `ctx.tp_rank` of
    `ctx.tp_size`), the attention-DP rank and size (`get_parallel()`, else derived from
    `--enable-dp-attention` / `--attn-dp-size` and the TP rank), or the replica's `dp_rank`."""
    sa = ctx.server_args
    tp_size, tp_rank = int(ctx.tp_size or 1), int(ctx.tp_rank or 0)
    par = _sglang_parallel()
    attn_dp = int(_read(par, "attn_dp_size", 0) or _read(sa, "attn_dp_size", 1) or 1)
    if attn_dp <= 1 and _read(sa, "enable_dp_attention", False):
        attn_dp = int(_read(sa, "dp_size", 1) or 1)  # the deprecated spelling: --dp-size N --enable-dp-attention
    params = getattr(ctx, "params", None)
    got = _group_rank_size(getattr(params, "tp_cache_group", None))
    if got is None:
        size = tp_size // attn_dp if attn_dp > 1 else tp_size
        got = (tp_rank % size, size)
    group_rank, group_size = got
    if attn_dp > 1:
        dp_rank = int(_read(par, "attn_dp_rank", tp_rank // group_size))
        return DPPlacement(dp_rank, attn_dp, group_rank, group_size, tp_rank, attention_dp=True)
    replicas = int(_read(sa, "dp_size", 1) or 1)
    dp_rank = int(_read(par, "dp_rank", 0)) if replicas > 1 else 0
    return DPPlacement(dp_rank, replicas, group_rank, group_size, tp_rank)


def group_consensus(ctx: Any, debug: DebugSettings, where: DPPlacement) -> RankConsensus | None:
    """A cache group of >= 2 ranks: their per-step agreement over the CPU group SGLang passes the
    cache (`params.tp_cache_group`: the attention-TP group under DP attention, the TP group otherwise);
    None for a group of one (TP = 1, or one attention-TP rank per DP rank)."""
    size = where.group_size
    if size <= 1:
        return None
    group = ctx.params.tp_cache_group
    if group is None and not where.attention_dp:
        group = getattr(ctx.tp_group, "cpu_group", None)
    if group is None:
        raise ValueError(
            f"{_REFUSAL}a cache group of {size} ranks (tp_size={ctx.tp_size}) but SGLang gave the "
            "cache no group to agree over"
        )
    if not step_hook_installed():
        raise ValueError(
            f"{_REFUSAL}tp_size={size} needs the per-step hook on the scheduler, "
            "which the sgl_hicache plugin did not install (see the log); run with --tp 1"
        )
    return RankConsensus(group, where.group_rank, size, check=debug.consensus_check)


__all__ = ["DPPlacement", "group_consensus", "placement"]
