"""Rank agreement for `sgl_hicache` under tensor parallelism (`--tp N`).

Every TP rank runs the same `TieredRadixCache` on its own shard of the KV heads: its own host buffer
and its own disk directory. Where the ranks split the heads evenly (MHA / GQA: `shard_heads`), page
keys are named by the whole model, with no TP size, and a rank's directory is its heads'
(`<disk_dir>/heads<lo>-<hi>`), so a server of another TP size reads the pages too
(`tiers/disk/head_shards.py`). Otherwise each rank keeps `<disk_dir>/tp<N>-rank<r>` with `tp=<N>` in
the key namespace (a TP=4 cache is never read by TP=8). Where every rank holds the same KV (MLA:
`replicate`), the group keeps one copy instead: no tp salt, one directory `<disk_dir>/tp<N>-shared`,
one shared host buffer, written by rank 0 alone (`sglang/replicated.py`); at start a follower indexes
the leader's disk pages. SGLang's schedulers on the ranks are lock-stepped: they see the same requests
and call the cache in the same order, so the caches stay equal as long as every decision is taken
from the same facts. Decisions made from the tree and an agreed clock are equal by construction. The
facts that are local to a rank are agreed here, at fixed points outside the tree methods:

- startup (`RankConsensus.start`, once, in the factory): the clock origin (MAX), and the disk pages
  every rank holds (the intersection of the ranks' page-key sets; the rest is deleted), so restarts
  adopt the same pages everywhere;
- every scheduler step (`RankConsensus.step`, from a BEFORE hook on SGLang's
  `Scheduler.get_next_batch_to_run`, which every rank runs once per loop iteration; new background
  write-backs start from its AFTER hook, so they copy during the forward pass): ONE all-reduce
  of a fixed-size int64 vector over SGLang's TP cache group (`params.tp_cache_group`, gloo) carrying
  - per background transfer (write-back, prefetch, prediction; at most `max_ops` per step, the rest
    waits a step): executed on every rank (MIN) and its worst outcome (MAX: 0 ok, 1 I/O error,
    2 page gone). A transfer's outcome counts (`TransferOp.settled`) only once agreed, and every rank
    records the worst one: a disk read that fails or a page corrupt on ONE rank fails it on all (MIN of
    loadable lengths), so the request recomputes on every rank;
  - per request waiting for its prefetch: "give up and recompute" (MAX: any rank past its load timeout
    or expecting to be);
  - the clock (MAX): LRU stamps and write-back pacing read the agreed clock, never the local one;
  - the layer-wise host -> device loads (`layer_loads.py`): how many are queued (MIN and MAX) and how
    many, in queue order, have finished (MIN): a load's nodes stay locked until every rank finished
    it, so the ranks' evictable sets stay equal;
  - the disk -> host link's measured rate, in tokens/s (MIN: the slowest rank's; 0 while any rank
    has none), which sizes the predictor's budget (lead time x rate) alike on every rank;
  - the op and request counts (MIN and MAX) and, with `consensus_check`, a digest of each rank's tree
    and tier residency: a difference raises `RankDivergenceError` (the scheduler dies, the server
    exits) instead of letting the ranks run different batches into a hang.
  MAX is sent as MIN of the negated value, so one MIN all-reduce carries both.

The vector's size never depends on a rank's state, so a rank can never issue a collective its peers
do not: the only collectives are the two at startup and one per scheduler step, on every rank.

Known gaps (docs/reliability.md): synchronous copies on the scheduler thread (a demand load host ->
device, an eviction's inline demotion) are not agreed: a failure of one on one rank is caught by the
consensus check, not repaired; a disk store whose writes a failure disabled on one rank refuses
allocations there only, which the count check turns into a loud stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ...policy.admission import PrefillCost
from ...tiers.base import DISK, HOST, TIERS, PeerTierError, TierIOError
from ...transfer.executors import Executor, LoadTime

if TYPE_CHECKING:
    from ...cache import TieredCache
    from ...transfer.ops import PromotionJob, TransferOp

logger = logging.getLogger(__name__)

STEP_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
# ops count MIN/MAX, waiting count MIN/MAX, clock MAX, digest low half MIN/MAX, high half MIN/MAX,
# layer-wise loads queued MIN/MAX, loads done in queue order MIN, disk -> host tokens/s MIN,
# prefill fixed cost (µs) MAX, prefill cost per token (ps) MIN, per attention pair (1e-18 s) MIN,
# every rank has a prefill cost MIN
_HEADER = 17
_MASK31 = (1 << 31) - 1


class RankDivergenceError(RuntimeError):
    """The ranks of one tensor-parallel cache disagree on state that must be equal (a bug, or a
    failure the agreement does not cover). Raised on every rank at the same step."""


class AgreedClock:
    """A clock equal on every rank: the agreed time of the last step plus 1 ns per reading since
    (the ranks read it in the same order). Monotonic; set by `RankConsensus`."""

    def __init__(self) -> None:
        self._base = time.monotonic()
        self._ticks = 0

    def __call__(self) -> float:
        self._ticks += 1
        return self._base + self._ticks * 1e-9

    def advance(self, agreed: float) -> None:
        self._base = max(agreed, self._base + self._ticks * 1e-9)
        self._ticks = 0


def fail_kind(op: TransferOp) -> int:
    """0: the copy worked; 1: an I/O error (the page may still be there); 2: the page is gone."""
    if op.error is None:
        return 0
    return 2 if op.source_lost else 1


def tree_digest(cache: TieredCache, extra: Sequence[int] = (), host_handles: bool = False) -> int:
    """A 62-bit digest of the tree (each node's page key, page count, tiers and lock count, and with
    `host_handles` its host slots, which a shared host buffer needs equal; XOR-combined, so child
    order does not matter), its pages per tier and the host store's used pages. Equal caches give
    equal digests. The disk store's own count is left out: a background write or a corrupt read
    changes it on the transfer thread, before the ranks agree on that copy."""
    acc = 0
    tree = cache.tree
    stack = list(tree.root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        mask = sum(1 << i for i, t in enumerate(TIERS) if n.in_tier(t))
        h = xxhash.xxh3_64(tree.key_of(n))
        h.update(f"{n.num_pages}:{mask}:{n.lock_ref}".encode())
        if host_handles and n.host is not None:
            h.update(repr(n.host).encode())
        acc ^= h.intdigest()
    h = xxhash.xxh3_64(acc.to_bytes(8, "little"))
    for t in TIERS:
        h.update(f"{t}={tree.pages[t]};".encode())
    host = cache.stores.get(HOST)
    h.update(f"host:{host.used_pages if host is not None else -1};".encode())
    h.update(",".join(map(str, extra)).encode())
    return h.intdigest() >> 2


@dataclass
class StepCounts:
    """What the consensus did so far (published in the stats)."""

    steps: int = 0
    ops_agreed: int = 0
    ops_failed_elsewhere: int = 0  # succeeded here, failed on another rank: recorded as failed
    give_ups: int = 0
    digests_checked: int = 0
    startup_pages_dropped: int = 0  # disk pages only some ranks held at start
    layer_loads_agreed: int = 0  # layer-wise loads unlocked once every rank had finished them
    collective_seconds: float = 0.0
    role: str = "shard"  # "shard": each rank its own KV-head shard; replicated KV: "leader" / "follower"
    left_to_leader: dict[str, int] = field(default_factory=dict)  # a follower's pages per link it did not copy


class RankConsensus:
    """Agreement among the TP ranks of one cache (see the module docstring).

    Contract:
    - `start(cache)` and `step(...)` are collectives: every rank calls them at the same points
      (the factory; every scheduler step), never from a tree method, never conditionally on local state.
    - After `step`, every gated op it reported as executed everywhere is `agreed` with the same error
      on every rank, and `gave_up` answers alike on every rank for the waiting requests it was given.
    - Mismatched counts or digests raise `RankDivergenceError` on every rank.
    """

    def __init__(
        self, group: Any, rank: int, size: int, check: bool = False, max_ops: int = 256, max_waiting: int = 128
    ) -> None:
        if size < 2:
            raise ValueError(f"RankConsensus needs tp_size >= 2, got {size}")
        self.group = group
        self.rank = rank
        self.size = size
        self.check = check
        self.max_ops = max_ops
        self.max_waiting = max_waiting
        self.clock = AgreedClock()
        self.counts = StepCounts()
        self._gave_up: set[int] = set()  # id() of tickets every rank agreed to give up on
        self.replicated = False  # every rank holds the same KV (MLA): see `replicate`
        self.sharded = False  # the ranks split the KV heads evenly: see `shard_heads`
        self.disk_read_tokens_per_s = 0  # agreed at each step (MIN over the ranks; 0: unknown)
        self.prefill_cost: PrefillCost | None = None  # agreed at each step (step's docstring; None: unknown)

    # ---- identity -------------------------------------------------------------------------
    def replicate(self) -> None:
        """Every rank holds the same KV (the pool adapter's `replicated_across_tp`): one copy for the
        group, in one directory and one shared host buffer, written by the leader (rank 0) alone
        (`sglang/replicated.py`). Call before the cache is configured."""
        self.replicated = True
        self.counts.role = "leader" if self.leader else "follower"

    def shard_heads(self) -> None:
        """The ranks split the model's KV heads evenly (`parallel/head_shard.py`): page keys carry no
        TP size, and each rank's disk store keeps its heads' directory under the one directory this
        returns from `rank_dir` (`HeadShardDiskStore`). Call before the cache is configured."""
        self.sharded = True

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def salt(self) -> str:
        """Namespace salt: the TP size changes every page's bytes (the shard); none for replicated KV,
        whose pages are the same at every TP size, nor for head shards, whose directories and page
        headers say which heads a page holds."""
        return "" if self.replicated or self.sharded else f"tp={self.size}"

    def rank_dir(self, disk_dir: Path) -> Path:
        """This rank's disk directory: the group's one directory for replicated KV, the base of every
        shard's directory for head shards (the store adds its heads'), else this rank's own."""
        if self.sharded:
            return Path(disk_dir)
        return Path(disk_dir) / (f"tp{self.size}-shared" if self.replicated else f"tp{self.size}-rank{self.rank}")

    def gate(self, executor: Executor) -> GatedExecutor:
        return GatedExecutor(
            executor, shared=(HOST, DISK) if self.replicated else (), disk_read_rate=lambda: self.disk_read_tokens_per_s
        )

    # ---- collectives ------------------------------------------------------------------------
    def _all_reduce_min(self, vec: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self.group)
        self.counts.collective_seconds += time.perf_counter() - t0
        return vec

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a collective: every rank calls it at the same point)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def start(self, cache: TieredCache) -> None:
        """Startup agreement: the clock origin, and the disk pages every rank holds (replicated KV: a
        follower indexes the leader's pages, `MirrorDiskStore.adopt`)."""
        vec = self._all_reduce_min(torch.tensor([-time.monotonic_ns()], dtype=torch.int64))
        self.clock.advance(-int(vec[0]) / 1e9)
        store = cache.stores.get(DISK)
        have = set(store.keys()) if store is not None else set()  # type: ignore[attr-defined]
        everyone = self.gather(have)
        if self.replicated:
            if not self.leader and store is not None:
                store.adopt(everyone[0])  # type: ignore[attr-defined]
            return
        common = set.intersection(*everyone)
        drop = sorted(have - common)
        if drop and store is not None:
            store.free(drop)  # the tree adopts disk pages lazily: none of these is in it yet
            logger.warning(
                "sgl_hicache: rank %d dropped %d disk pages the other ranks do not hold", self.rank, len(drop)
            )
        self.counts.startup_pages_dropped = len(drop)

    def step(
        self,
        ops: Iterable[TransferOp],
        waiting: Sequence[tuple[Any, bool]],
        digest: Callable[[], int] | None = None,
        layer_loads: tuple[int, int] = (0, 0),
        disk_read_tokens_per_s: float = 0.0,
        prefill_cost: PrefillCost | None = None,
    ) -> int:
        """One scheduler step's agreement. `ops`: the background transfers in flight, in the same
        order on every rank; `waiting`: (ticket, this rank would give up on it now) for the requests
        whose prefetch is unfinished, in the same order on every rank; `layer_loads`: (layer-wise
        loads queued, how many of them in queue order have finished here). Returns how many of those
        loads have finished on every rank (MIN). `disk_read_tokens_per_s`: this rank's measured disk
        -> host rate (0: none yet); the slowest rank's becomes `disk_read_tokens_per_s` on every rank.
        `prefill_cost`: this rank's fitted prefill cost (None: not yet); every rank's `prefill_cost`
        becomes the largest fixed part with the smallest per-token and per-pair parts (the fewest
        holds), or None while any rank has none."""
        todo = [
            op for op in ops if op.gated and not op.agreed and not op.applied and (op.shared_dst or not op.cancelled)
        ][: self.max_ops]
        waiting = list(waiting)[: self.max_waiting]
        d = digest() if (self.check and digest is not None) else 0
        # built as a list and converted once: item assignment into a tensor costs ~10 µs per element
        vals = [
            len(todo),
            -len(todo),
            len(waiting),
            -len(waiting),
            -time.monotonic_ns(),
            d & _MASK31,
            -(d & _MASK31),
            d >> 31,
            -(d >> 31),
            layer_loads[0],
            -layer_loads[0],
            layer_loads[1],
            max(0, int(disk_read_tokens_per_s)),
            -int(prefill_cost.fixed_s * 1e6) if prefill_cost else 0,
            int(prefill_cost.per_token_s * 1e12) if prefill_cost else 0,
            int(prefill_cost.per_pair_s * 1e18) if prefill_cost else 0,
            int(prefill_cost is not None),
        ]
        base = _HEADER
        for op in todo:
            done = op.executed.is_set()
            vals += (int(done), -(fail_kind(op) if done else 0))
        vals += [0] * (2 * (self.max_ops - len(todo)))
        base2 = _HEADER + 2 * self.max_ops
        vals += [-int(give_up) for _, give_up in waiting]
        vals += [0] * (self.max_waiting - len(waiting))
        out = self._all_reduce_min(torch.tensor(vals, dtype=torch.int64)).tolist()
        self.counts.steps += 1
        if out[0] != -out[1] or out[2] != -out[3]:
            raise RankDivergenceError(
                f"sgl_hicache rank {self.rank}: the TP ranks disagree on the transfers in flight "
                f"({out[0]}..{-out[1]}) or the requests waiting ({out[2]}..{-out[3]}); this rank has "
                f"{len(todo)} and {len(waiting)}"
            )
        if out[9] != -out[10]:
            raise RankDivergenceError(
                f"sgl_hicache rank {self.rank}: the TP ranks disagree on the layer-wise loads queued "
                f"({out[9]}..{-out[10]}); this rank has {layer_loads[0]}"
            )
        if self.check and digest is not None:
            self.counts.digests_checked += 1
            if out[5] != -out[6] or out[7] != -out[8]:
                raise RankDivergenceError(
                    f"sgl_hicache rank {self.rank}: tree/residency digest differs across the TP ranks at step "
                    f"{self.counts.steps} (consensus_check)"
                )
        self.clock.advance(-out[4] / 1e9)
        for i, op in enumerate(todo):
            if not out[base + 2 * i]:
                continue  # still running on some rank: next step
            worst = -out[base + 2 * i + 1]
            mine = fail_kind(op)
            if worst > mine:
                if op.error is None:
                    self.counts.ops_failed_elsewhere += 1
                op.error = PeerTierError(
                    f"{op.link} of {op.node.num_pages} pages failed on another TP rank"
                    + (f" (here: {op.error})" if op.error is not None else ""),
                    page_gone=worst == 2,
                )
            op.agreed = True
            self.counts.ops_agreed += 1
        for j, (ticket, _) in enumerate(waiting):
            if -out[base2 + j] and id(ticket) not in self._gave_up:
                self._gave_up.add(id(ticket))
                self.counts.give_ups += 1
        self.counts.layer_loads_agreed += out[11]
        self.disk_read_tokens_per_s = out[12]
        self.prefill_cost = (
            PrefillCost(fixed_s=-out[13] / 1e6, per_token_s=out[14] / 1e12, per_pair_s=out[15] / 1e18)
            if out[16]
            else None
        )
        return out[11]

    def gave_up(self, ticket: Any) -> bool:
        """Every rank agreed that this request stops waiting for its prefetch and recomputes."""
        return id(ticket) in self._gave_up

    def forget(self, ticket: Any) -> None:
        self._gave_up.discard(id(ticket))


class GatedExecutor(Executor):
    """An executor whose background transfers wait for the ranks' agreement before they count
    (`TransferOp.gated`); inline copies (`run_now`) are not gated. Its disk -> host rate is the
    ranks' agreed one (`disk_read_rate`), so a budget sized from it is equal on every rank; it
    reports no other link's rate. Everything else is the inner one's."""

    def __init__(
        self, inner: Executor, shared: Sequence[str] = (), disk_read_rate: Callable[[], float] = lambda: 0.0
    ) -> None:
        self.inner = inner
        self.shared = tuple(shared)  # tiers every rank shares (replicated KV): their copies free only once agreed
        self.disk_read_rate = disk_read_rate

    def link_tokens_per_s(self, link: str) -> float:
        return float(self.disk_read_rate()) if link == "disk->host" else 0.0

    def local_link_tokens_per_s(self, link: str) -> float:
        """This rank's own measurement (what it contributes to the agreement)."""
        return self.inner.link_tokens_per_s(link)

    def _gate(self, ops: Iterable[TransferOp]) -> None:
        for op in ops:
            op.gated = True
            op.shared_dst = op.dst in self.shared

    def submit_job(self, job: PromotionJob, speculative: bool = False) -> None:
        self._gate(job.ops())
        self.inner.submit_job(job, speculative)

    def submit_ops(self, ops: Sequence[TransferOp], kind: str = "backup") -> None:
        self._gate(ops)
        self.inner.submit_ops(ops, kind)

    def poll(self) -> None:
        self.inner.poll()

    def eta(self, job: PromotionJob) -> float:
        return self.inner.eta(job)

    def cancel(self, ops: Iterable[TransferOp]) -> None:
        self.inner.cancel(ops)

    def run_now(self, job: PromotionJob) -> LoadTime:
        return self.inner.run_now(job)

    def stop(self) -> None:
        self.inner.stop()


# ---- fault injection (tests) ------------------------------------------------------------------
def inject_read_faults(store: Any, rank: int, flag_file: str) -> None:
    """Make this rank's disk reads fail while `flag_file` exists and names this rank (its text is a
    comma-separated list of ranks). For tests of rank skew: the failure is real to the cache (a
    `TierIOError` from the store), the switch is the file."""
    path = Path(flag_file)

    def active() -> bool:
        try:
            ranks = {int(x) for x in path.read_text().replace(",", " ").split()}
        except (OSError, ValueError):
            return False
        return rank in ranks

    for name in ("read", "read_into"):
        original = getattr(store, name, None)
        if original is None:
            continue

        def faulty(*args, _original=original, **kwargs):
            if active():
                raise TierIOError(f"disk: read fault injected on rank {rank} ({flag_file})")
            return _original(*args, **kwargs)

        setattr(store, name, faulty)
    logger.warning("sgl_hicache: rank %d: disk read faults are injected while %s names this rank", rank, flag_file)


# ---- the per-step hook ---------------------------------------------------------------------------
def _before_step(*args: Any, **kwargs: Any) -> None:
    """BEFORE `Scheduler.get_next_batch_to_run`: let the cache agree with its peer ranks."""
    scheduler = args[0] if args else None
    step = getattr(getattr(scheduler, "tree_cache", None), "sgl_hicache_on_step", None)
    if step is not None:
        step()  # raises RankDivergenceError into the scheduler on purpose: the server must stop
    return None


def _after_step(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `Scheduler.get_next_batch_to_run` (the batch is chosen, its evictions are done): start
    background copies now, so they run during the forward pass and are agreed at the next step
    instead of pinning the coldest pages through this step's evictions. No collective here."""
    scheduler = args[0] if args else None
    after = getattr(getattr(scheduler, "tree_cache", None), "sgl_hicache_after_step", None)
    if after is not None:
        after()
    return None


_hook_installed = False


def install_step_hook() -> None:
    """Register the per-step hook with SGLang's plugin hooks (from `plugin.register`, before SGLang
    applies them). It does nothing for other radix caches or at TP=1."""
    global _hook_installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not _hook_installed:
        HookRegistry.register(STEP_TARGET, _before_step, HookType.BEFORE)
        HookRegistry.register(STEP_TARGET, _after_step, HookType.AFTER)
        _hook_installed = True


def step_hook_installed() -> bool:
    """Whether this process registered the per-step hook (without it TP ranks cannot agree)."""
    return _hook_installed


__all__ = [
    "AgreedClock",
    "GatedExecutor",
    "RankConsensus",
    "RankDivergenceError",
    "StepCounts",
    "fail_kind",
    "inject_read_faults",
    "install_step_hook",
    "step_hook_installed",
    "tree_digest",
]
