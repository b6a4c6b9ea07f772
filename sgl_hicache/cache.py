"""The one composer: tree + tier stores + policies. The API the embedded engine and the SGLang
backend both call.

Moving a page between tiers is a two-phase transfer (`TransferOp`): *prepare* (under the cache
lock) allocates the destination and pins the node so nothing evicts or splits it; *execute* copies
the bytes (no lock needed: it touches only the op's own handles); *complete* (under the lock)
records the new residency, or rolls the allocation back when the copy failed. The synchronous
paths below run the three phases back to back; the asynchronous transfer engine runs *execute* on
worker threads.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import ne

from .config import CacheConfig
from .hashing import Namespace, chain_keys, page_key
from .policy.eviction import eviction_policy
from .policy.reuse import ReuseModel
from .stats import CacheStats
from .tiers.base import DEVICE, DISK, HOST, TIERS, Handle, KeyedStore, PageCorruptError, PageGoneError, PeerTierError, TierIOError, TierStore
from .tiers.memory import DeviceKVPool, HostKVBuffer
from .transfer.bandwidth import BandwidthMeter
from .transfer.handlers import default_handlers
from .transfer.ops import Cancelled, NodeStage, PromotionJob, TransferOp
from .tree.node import TreeNode, edge_key_of
from .tree.radix import InvariantError, RadixTree
from .tree.traffic import count_edge

log = logging.getLogger(__name__)

@dataclass
class MatchResult:
    """What of a prompt the tree holds, and in which tier.

    `path` is the matched chain of nodes from the root; the first `device_tokens` tokens are on the
    device, the next `host_tokens` only on host, the next `disk_tokens` only on disk (residency is
    prefix-closed per tier, so the attribution is always in that order). `device_handles` are the
    device pages of the device part, in order.
    """

    path: list[TreeNode]
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    device_handles: list[Handle]
    last_node: TreeNode
    last_device_node: TreeNode

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.disk_tokens

    @property
    def lower_tier_tokens(self) -> int:
        return self.host_tokens + self.disk_tokens

    def head(self, tokens: int) -> "MatchResult":
        """The match cut to its first `tokens` tokens: the figures exactly, the path to the whole
        nodes that fit."""
        covered = max(0, min(tokens, self.tokens))
        dev = min(self.device_tokens, covered)
        host = min(self.host_tokens, covered - dev)
        path: list[TreeNode] = []
        seen = 0
        for node in self.path:
            seen += len(node.tokens)
            if seen > covered:
                break
            path.append(node)
        page_size = len(self.path[0].tokens) // self.path[0].num_pages if self.path else 1
        last = path[-1] if path else self.last_device_node
        return MatchResult(path, dev, host, covered - dev - host, self.device_handles[: dev // page_size], last, self.last_device_node)


@dataclass
class InsertResult:
    """`prefix_tokens` were already in the tree's device tier; `duplicates` are the caller's device
    pages that the tree did not take (it already held those pages) and the caller must free."""

    prefix_tokens: int
    duplicates: list[Handle]
    last_node: TreeNode
    adopted_pages: int = 0  # caller's pages the tree took ownership of


class TieredCache:
    """A radix prefix cache whose nodes live in a device, a host and a disk tier.

    Contract:
    - `match(tokens)` never moves bytes; it may split a node and adopt disk pages left by an earlier
      process (restart), or written by another process sharing the directory, into the tree.
    - `promote(match)` brings the matched path to the device tier (disk -> host -> device), evicting
      colder unlocked nodes as needed; what cannot be brought up stays a miss. Never raises on a
      tier failure: a corrupt or unreadable page is a miss, counted in `stats.errors`.
    - `insert(tokens, handles)` hands the caller's device pages (one per whole page of `tokens`) to
      the tree; pages the tree already held come back in `InsertResult.duplicates`.
    - `allocate_device(n)` returns `n` free device pages, evicting (demoting) as needed, or None.
    - Eviction from a tier is leaf-first in that tier, ordered by the eviction policy, never touches
      a locked or pinned node, and demotes (device -> host -> disk) instead of dropping where the
      next tier can take the pages. A disk directory shared with other processes is one capacity:
      when this tree cannot free enough of it, the oldest pages the others wrote go.
    - `check()` verifies the tree's invariants and that every store's accounting equals the tree's.
    All public methods are thread-safe (one re-entrant lock; byte copies of asynchronous transfers
    run outside it).
    """

    def __init__(
        self,
        config: CacheConfig,
        device: TierStore | None = None,
        host: TierStore | None = None,
        disk: TierStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.namespace = Namespace.for_model(config.layout, config.page_size, config.tenant_salt)
        self.tree = RadixTree(config.page_size, self.namespace)
        self.stores: dict[str, TierStore] = {}
        self.stores[DEVICE] = device or DeviceKVPool(config.layout, config.page_size, config.device_pages)
        if host is None and config.host_pages > 0:
            host = HostKVBuffer(config.layout, config.page_size, config.host_pages)
        if host is not None:
            self.stores[HOST] = host
        if disk is None and config.disk_pages > 0:
            from .tiers.disk import DiskPageStore

            disk = DiskPageStore(config.layout, config.page_size, config.disk_pages, config.disk_dir, self.namespace, fsync=config.disk_fsync)
        if disk is None and config.store_url:
            from .tiers.store import open_store

            disk = open_store(config, self.namespace)
        if disk is not None:
            if not isinstance(disk, KeyedStore):
                raise TypeError(f"TieredCache: the disk slot needs a content-addressed KeyedStore, got {type(disk).__name__}")
            self.stores[DISK] = disk
        # the reuse model learns from served requests; it orders eviction under `reuse` and feeds
        # the `continuation` predictor
        self.reuse: ReuseModel | None = None
        if config.eviction_policy == "reuse" or config.predictor == "continuation" or config.admission_min_probability > 0:
            self.reuse = ReuseModel(lambda: self.clock(), admit_min_probability=config.admission_min_probability)
        self.priority = self.reuse.priority if config.eviction_policy == "reuse" else eviction_policy(config.eviction_policy)  # type: ignore[union-attr]
        self._order_leaves()
        self.handlers = default_handlers(self.stores)
        self.meter = BandwidthMeter()
        self.clock = clock
        self.stats = CacheStats()
        self._mutex = threading.RLock()
        # device pages handed out by allocate_device and not yet inserted or freed
        self.outstanding_device_pages = 0
        # cancelled copies of failed promotions still running on a worker (`_fail`, `reap_orphans`)
        self.orphans: list[TransferOp] = []
        # copies into the disk tier not applied yet: their pages may be stored before the tree
        # claims them, and must not be taken for orphaned files (`_evict_disk_orphans`)
        self._disk_writes: set[TransferOp] = set()
        # (error name, reason) pairs already logged at WARNING: the rest go to DEBUG (one line per reason)
        self._logged_errors: set[tuple[str, str]] = set()
        # per (src, dst) link, the state in which write-back planning last found nothing to do
        self._idle_plans: dict[tuple[str, str], tuple] = {}
        if DISK in self.stores and self.stores[DISK].overfull_pages:
            # restarted with a smaller disk capacity than the files found: trim to capacity
            self._evict_disk_orphans(self.stores[DISK].overfull_pages)

    def _order_leaves(self) -> None:
        """Keep the tree's eviction candidates ordered incrementally, where the policy's priorities
        only grow with use (`lru`, `lfu`: see `tree/leaves.py`); `reuse` priorities move with the
        clock, so its evictions order the leaves afresh each call."""
        if self.config.eviction_policy in ("lru", "lfu"):
            self.tree.order_leaves(self._leaf_key)

    # ---- queries ---------------------------------------------------------------------------
    def has_tier(self, tier: str) -> bool:
        return tier in self.stores

    def match(self, tokens: Sequence[int], touch: bool = True) -> MatchResult:
        with self._mutex:
            path, matched = self.tree.walk(tokens)
            if self.has_tier(DISK):
                path.extend(self._adopt_disk_pages(path, tokens, matched))
            if touch:
                now = self.clock()
                self.tree.version += 1  # recency changed: eviction order may have
                parent = self.tree.root
                for node in path:
                    node.last_access = now
                    count_edge(parent, node.edge_key, now)
                    parent = node
            return self._describe(path)

    def _describe(self, path: list[TreeNode]) -> MatchResult:
        ps = self.page_size
        dev = host = disk = 0
        handles: list[Handle] = []
        last_device = self.tree.root
        for node in path:
            tokens = node.num_pages * ps
            if node.device is not None:
                dev += tokens
                handles.extend(node.device)
                last_device = node
            elif node.host is not None:
                host += tokens
            else:
                disk += tokens
        return MatchResult(path, dev, host, disk, handles, path[-1] if path else self.tree.root, last_device)

    def _adopt_disk_pages(self, path: list[TreeNode], tokens: Sequence[int], matched: int) -> list[TreeNode]:
        """Pages of `tokens` past the tree's match that the disk store holds but the tree does not
        know (written by an earlier process, or by another process sharing the directory while it
        runs): adopt them as a disk-only node."""
        disk = self.stores[DISK]
        shared = disk.shared  # a shared store: other servers add pages any time
        peers = disk.peers_wrote  # a shared directory another process has written to
        if not (shared or peers) and disk.stored_pages <= self.tree.pages[DISK]:
            return []  # no orphan pages on disk and nobody else writes: nothing to find
        parent = path[-1] if path else self.tree.root
        if not (parent.is_root or parent.disk is not None):
            return []  # a disk node must hang under a disk node (prefix closure)
        ps = self.page_size
        if len(tokens) - matched < ps or edge_key_of(tokens[matched : matched + ps]) in parent.children:
            return []
        limit = self.tree.page_aligned(tokens)
        keys: list[bytes] = []
        if shared:  # one batched existence check for everything past the match
            wanted = chain_keys(self.tree.key_of(parent), tokens[matched:limit], ps)
            keys = list(wanted[: disk.count_present(wanted)])
        else:
            # keys one page at a time: a miss (the common case) hashes one page, not the whole rest
            find = disk.discover if peers else disk.contains
            key = self.tree.key_of(parent)
            for start in range(matched, limit, ps):
                key = page_key(key, tokens[start : start + ps])
                if not find(key):
                    break
                keys.append(key)
        if not keys:
            return []
        node = self.tree.add_child(parent, tokens[matched : matched + len(keys) * ps])
        node.set_keys(keys)
        self.tree.set_resident(node, DISK)
        return [node]

    # ---- locks -----------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        with self._mutex:
            self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        with self._mutex:
            self.tree.unlock(node)
            # a node can lose its only copy while locked (a corrupt disk page dropped it): the last
            # unlock removes it
            self._prune(node)

    # ---- device pages for computed KV --------------------------------------------------------
    def allocate_device(self, num_pages: int) -> list[Handle] | None:
        with self._mutex:
            store = self.stores[DEVICE]
            if store.free_pages < num_pages:
                self.evict(DEVICE, num_pages - store.free_pages)
            handles = store.allocate([b""] * num_pages)
            if handles is not None:
                self.outstanding_device_pages += num_pages
            return handles

    def free_device(self, handles: Sequence[Handle]) -> None:
        """Return device pages from `allocate_device` that were not inserted (or were duplicates)."""
        with self._mutex:
            self.stores[DEVICE].free(handles)
            self.outstanding_device_pages -= len(handles)

    def insert(self, tokens: Sequence[int], device_handles: Sequence[Handle], from_allocate_device: bool = True) -> InsertResult:
        """Insert the whole pages of `tokens`, whose KV the caller holds in `device_handles` (one per
        page, from `allocate_device` or from an earlier match). With `from_allocate_device=False`
        the new pages came from the device store's own allocator (SGLang's), not from
        `allocate_device`, so they are not counted against its outstanding pages."""
        with self._mutex:
            ps = self.page_size
            limit = self.tree.page_aligned(tokens)
            if len(device_handles) != limit // ps:
                raise ValueError(f"insert of {limit // ps} whole pages with {len(device_handles)} device handles")
            path, matched = self.tree.walk(tokens)
            duplicates: list[Handle] = []
            prefix_tokens = 0
            page = 0
            adopted = 0
            for node in path:
                mine = list(device_handles[page : page + node.num_pages])
                if node.device is not None:
                    if mine != node.device:  # the usual SGLang case reuses the tree's pages: equal lists
                        duplicates.extend(compress(mine, map(ne, mine, node.device)))
                    if prefix_tokens == page * ps:
                        prefix_tokens += node.num_pages * ps
                elif node.pins == 0 and (node.parent.is_root or node.parent.device is not None):  # type: ignore[union-attr]
                    # the caller recomputed pages the tree holds only in lower tiers: keep its copy
                    self.tree.set_resident(node, DEVICE, mine)
                    adopted += len(mine)
                else:
                    duplicates.extend(mine)
                page += node.num_pages
            new_nodes: list[TreeNode] = []
            last = path[-1] if path else self.tree.root
            if matched < limit:
                # a pinned node the walk could not split holds the next page: the caller keeps its copy
                blocked = edge_key_of(tokens[matched : matched + ps]) in last.children
                if not blocked and (last.is_root or last.device is not None):
                    node = self.tree.add_child(last, tokens[matched:limit])
                    node.last_access = self.clock()  # before it is queued for eviction with that key
                    self.tree.set_resident(node, DEVICE, list(device_handles[page:]))
                    adopted += node.num_pages
                    new_nodes.append(node)
                    last = node
                else:
                    duplicates.extend(device_handles[page:])
            now = self.clock()
            self.tree.version += 1
            for node in new_nodes:
                node.last_access = now
            if from_allocate_device:
                self.outstanding_device_pages -= adopted
            if self.reuse is not None:
                self.reuse.on_insert(new_nodes)
            self._after_insert(new_nodes)
            return InsertResult(prefix_tokens, duplicates, last, adopted)

    def _after_insert(self, new_nodes: list[TreeNode]) -> None:
        if self.config.write_policy == "write_through" and self.has_tier(HOST):
            for node in new_nodes:
                self.ensure(node, HOST, kind="backup", may_evict=True)

    # ---- promotion -------------------------------------------------------------------------
    def promote(self, match: MatchResult, kind: str = "demand", lock: bool = False) -> MatchResult:
        """Bring the matched path to the device tier now (disk -> host -> device), root first; stops at
        the first page that cannot come up (no room, or a failed read). Returns the path described
        afresh. With `lock`, the returned path is locked for the caller (who must `unlock` its
        `last_node`), atomically, so no other thread can evict the device pages it reports.
        The synchronous form of `plan_promotion` + execute + `advance`."""
        with self._mutex:
            job = self.plan_promotion(match, kind)
            if job is not None:
                for st in job.stages:
                    for op in st.ops:
                        self.execute(op)
                self.advance(job)
                self.release(job)
            result = self._describe([n for n in match.path if n.parent is not None])
            if lock:
                self.tree.lock(result.last_node)
            return result

    def ensure(self, node: TreeNode, tier: str, kind: str, may_evict: bool) -> bool:
        """Make `node` (and, for prefix closure, its ancestors) resident in `tier`; synchronous.
        Returns False when the pages could not be placed or read; the tree stays consistent."""
        with self._mutex:
            if tier not in self.stores:
                return False
            path = node.path_from_root()
            for n in path:  # pinned, so evictions made to room for the chain cannot take its head
                self.tree.pin(n)
            try:
                for n in path:
                    if n.in_tier(tier):
                        continue
                    if n.parent is None:
                        return False  # removed meanwhile (a corrupt ancestor dropped its subtree)
                    pending = n.incoming.get(tier)
                    if pending is not None:
                        # a background copy into this tier: use it if its bytes are there, never
                        # race it (a second copy, or adopting its files before it completes)
                        if not (pending.kind == "backup" and pending.settled and self.complete(pending)):  # type: ignore[attr-defined]
                            return False
                        continue
                    if tier == DISK and all(map(self._on_disk_already, n.keys)):
                        self.tree.set_resident(n, DISK)  # content-addressed: already written, by us, an earlier process or a peer
                        continue
                    op = self.prepare(n, tier, kind, may_evict)
                    if op is None:
                        return False
                    self.execute(op)
                    if not self.complete(op):
                        return False
                return True
            finally:
                for n in path:
                    self.tree.unpin(n)
                self._prune(node)

    def _on_disk_already(self, key: Handle) -> bool:
        """The disk store holds the page (a peer sharing the directory may have written it)."""
        disk = self.stores[DISK]
        return disk.discover(key)

    def _source_for(self, node: TreeNode, dst: str, kind: str, may_evict: bool) -> str | None:
        """Which tier to copy from into `dst`: the fastest other tier that holds the node, bringing it
        through host first when disk is the only copy and the destination is the device."""
        order = {DEVICE: (HOST,), HOST: (DEVICE, DISK), DISK: (HOST, DEVICE)}[dst]
        for src in order:
            if node.in_tier(src):
                return src
        if dst == DEVICE and node.disk is not None and self.ensure(node, HOST, kind, may_evict):
            return HOST
        return None

    def prepare(
        self, node: TreeNode, dst: str, kind: str, may_evict: bool, src: str | None = None, src_handles: list[Handle] | None = None
    ) -> TransferOp | None:
        """Phase one: pick a source (or take the given one), allocate in `dst`, pin the node.
        None if it cannot be done now (no room, no source, or a transfer into `dst` is pending)."""
        with self._mutex:
            if node.parent is None or node.in_tier(dst) or dst in node.incoming:
                return None
            if src is None:
                src = self._source_for(node, dst, kind, may_evict)
                if src is None:
                    return None
                src_handles = list(node.keys) if src == DISK else list(getattr(node, src))
            store = self.stores[dst]
            if dst == DISK:  # pages an earlier process left under these keys are rewritten
                stale = [k for k in node.keys if store.contains(k)]
                if stale:
                    store.free(stale)
            self.tree.pin(node)  # pinned before evicting, so the eviction cannot pick it
            # nor its parent: evicting the parent from `dst` now would leave the copy's destination
            # tier not prefix-closed once it lands (the caller checked the parent is there)
            parent = node.parent if not node.parent.is_root else None
            if parent is not None:
                self.tree.pin(parent)
            try:
                if store.free_pages < node.num_pages and may_evict:
                    self.evict(dst, node.num_pages - store.free_pages)
                handles = store.allocate(node.keys) if store.free_pages >= node.num_pages else None
            except BaseException:
                self.tree.unpin(node)
                raise
            finally:
                if parent is not None:
                    self.tree.unpin(parent)
            if handles is None:
                self.tree.unpin(node)
                return None
            op = TransferOp(node, src, dst, list(src_handles or []), list(handles), node.num_pages * self.config.page_bytes, kind)
            node.incoming[dst] = op
            if dst == DISK:
                self._disk_writes.add(op)
            return op

    def execute(self, op: TransferOp) -> None:
        """Phase two, inline: copy the bytes with the link's handler; records the error, never raises."""
        start = time.perf_counter()
        if op.cancelled:
            op.error = Cancelled()
        else:
            try:
                self.handlers[(op.src, op.dst)](op, 0, len(op.dst_handles))
            except (TierIOError, OSError, KeyError, ValueError, RuntimeError) as exc:
                op.record_error(exc)
        op.seconds = time.perf_counter() - start
        op.executed.set()

    def complete(self, op: TransferOp) -> bool:
        """Phase three: record the new copy (or undo the allocation if the copy failed or was cancelled)."""
        with self._mutex:
            if op.applied:  # completed already (a background copy an eviction used early)
                return op.error is None
            node = op.node
            self.tree.unpin(node)
            if op.locks_path:
                self.tree.unlock(node)
            node.incoming.pop(op.dst, None)
            self._disk_writes.discard(op)
            op.applied = True
            if op.cancelled and (op.error is None or op.gated):
                op.error = Cancelled()  # gated: a local I/O error must not change this rank's tree alone
            if op.error is not None:
                self.stores[op.dst].free(op.dst_handles)
                self.tree.push_leaf(node.parent, op.dst)  # no longer waiting for this child
                if not isinstance(op.error, Cancelled):
                    self._on_transfer_error(op)
                return False
            self.tree.set_resident(node, op.dst, op.dst_handles)
            tokens = node.num_pages * self.page_size
            self.stats.add("bytes_moved", op.nbytes, op.link)
            self.stats.add("transfer_seconds", op.seconds, op.link)
            self.meter.record(op.link, op.nbytes, op.seconds)
            if op.kind == "demote":
                self.stats.add("demoted_tokens", tokens, op.src)
            elif op.kind != "backup":
                self.stats.add("promoted_tokens", tokens, op.dst)
                # a speculative copy counts once per node, until a request uses it
                if op.kind in ("prefetch", "predict") and not node.prefetched:
                    node.prefetched = op.kind
                    self.stats.add_prefetch(op.kind, "promoted_tokens", tokens)
            if op.dst == HOST and self.config.disk_write_policy == "write_through" and node.disk is None:
                self.ensure(node, DISK, kind="backup", may_evict=True)
            return True

    # ---- asynchronous promotion ------------------------------------------------------------
    def plan_promotion(
        self,
        match: MatchResult | Sequence[TreeNode],
        kind: str = "demand",
        target: str = DEVICE,
        evict: bool = True,
    ) -> PromotionJob | None:
        """Phase one for a whole path (a match, or nodes from the root down): lock it, allocate every
        destination page, and return the job; None when nothing needs to move or nothing could be
        placed. `target=HOST` brings disk-only nodes to host only. With `evict=False` the copies only
        fill free pages and never push anything out (what a prediction may do). The caller must `release`
        the job once it is finished or cancelled."""
        with self._mutex:
            path = list(match.path if isinstance(match, MatchResult) else match)
            todo = [n for n in path if not n.in_tier(target) and n.parent is not None and (target == DEVICE or n.device is None)]
            if not todo:
                return None
            anchor = path[-1]
            self.tree.lock(anchor)
            stages: list[NodeStage] = []
            staged_host: set[TreeNode] = set()
            for node in todo:
                pending = node.incoming.get(target)
                if pending is not None:
                    stages.append(NodeStage(node, [], waits_for=pending))  # type: ignore[arg-type]
                    staged_host.add(node)
                    continue
                ops: list[TransferOp] = []
                if node.host is None:
                    parent = node.parent
                    if not (parent.is_root or parent.host is not None or parent in staged_host):  # type: ignore[union-attr]
                        if not self.ensure(parent, HOST, kind, may_evict=evict):  # type: ignore[arg-type]
                            break
                    up = self.prepare(node, HOST, kind, may_evict=evict)
                    if up is None:
                        break
                    ops.append(up)
                if target == DEVICE:
                    if ops:
                        down = self.prepare(node, DEVICE, kind, evict, src=HOST, src_handles=ops[0].dst_handles)
                    else:
                        down = self.prepare(node, DEVICE, kind, evict)
                    if down is None:
                        for op in ops:
                            op.cancelled = True
                            op.executed.set()
                            self.complete(op)
                        break
                    ops.append(down)
                stages.append(NodeStage(node, ops))
                staged_host.add(node)
            if not stages:
                self.tree.unlock(anchor)
                self._prune(anchor)
                return None
            return PromotionJob(kind, anchor, stages, self.page_size, target)

    def advance(self, job: PromotionJob) -> bool:
        """Apply, in path order, the stages whose bytes have arrived. Returns True when the job is
        finished (every stage applied, or a stage failed and the rest was cancelled)."""
        with self._mutex:
            self.reap_orphans()
            while not job.failed and job.applied < len(job.stages):
                st = job.stages[job.applied]
                if st.waits_for is not None:
                    if st.node.in_tier(job.target):
                        job.applied += 1
                        continue
                    if st.waits_for.applied or st.node.parent is None:
                        self._fail(job, wait=False)  # the other job's transfer failed
                        break
                    return False
                for op in st.ops:
                    if op.applied:
                        continue
                    if not op.settled:
                        return False
                    if not self.complete(op):
                        self._fail(job, wait=False)
                        return True
                job.applied += 1
            return True

    def cancel(self, job: PromotionJob) -> None:
        """Give up the stages not applied yet (the caller recomputes them). Waits for copies already
        running, since their destination pages cannot be reused before they finish."""
        with self._mutex:
            self.advance(job)
            if not job.finished:
                self._fail(job, wait=True)
            for op in job.ops():  # a stage that failed inside `advance` may have orphaned the rest
                if op in self.orphans and not op.executed.wait(timeout=60):
                    raise RuntimeError(f"transfer {op.link} did not finish within 60 s; cannot free its pages")
            self.reap_orphans()

    def _fail(self, job: PromotionJob, wait: bool) -> None:
        """End `job`'s stages not applied yet as cancelled. A copy a worker is still running keeps its
        destination pages until it ends: with `wait` (an explicit `cancel`) wait for it here; without
        (a stage failed inside `advance`, on the caller's scheduling thread) hand it to `orphans`,
        which `reap_orphans` completes once its bytes stop moving."""
        job.failed = True
        for st in job.stages[job.applied :]:
            for op in st.ops:
                if op.applied:
                    continue
                op.cancelled = True
                if not op.submitted:
                    op.executed.set()  # nobody else will run it
                if not op.executed.is_set() and not wait:
                    self.orphans.append(op)
                    continue
                if not op.executed.wait(timeout=60):
                    raise RuntimeError(f"transfer {op.link} did not finish within 60 s; cannot free its pages")
                self.complete(op)

    def reap_orphans(self) -> None:
        """Complete (as cancelled: free their destination pages) the orphaned copies that ended. Never waits."""
        with self._mutex:
            if self.orphans:
                ended, running = [], []
                for op in self.orphans:  # one read per op: a copy ending between two reads is lost to both lists
                    (ended if op.executed.is_set() else running).append(op)
                self.orphans = running
                for op in ended:
                    self.complete(op)

    def release(self, job: PromotionJob) -> None:
        """End a finished job: unlock its path."""
        with self._mutex:
            if job.released:
                return
            if not job.finished:
                self.cancel(job)
            job.released = True
            self.tree.unlock(job.anchor)
            self._prune(job.anchor)

    def _on_transfer_error(self, op: TransferOp) -> None:
        if isinstance(op.error, PageGoneError):  # another process sharing the directory evicted it: a miss
            self.stats.errors["vanished_pages"] += 1
            log.debug("tier transfer %s of %d pages missed: %s", op.link, op.node.num_pages, op.error)
            self._drop_disk_subtree(op.node)
            return
        if isinstance(op.error, PeerTierError):
            name = "peer_rank_errors"
        else:
            name = "corrupt_pages" if isinstance(op.error, PageCorruptError) else f"{op.link}_errors"
        if name != "corrupt_pages":
            self.stats.errors[name] += 1
        if op.corrupt_pages or name == "corrupt_pages":  # per page: one op's chunks may each meet one
            self.stats.errors["corrupt_pages"] += max(1, op.corrupt_pages)
        reason = getattr(op.error, "reason", None) or str(getattr(op.error.__cause__, "errno", None) or type(op.error).__name__)
        first = (name, reason) not in self._logged_errors
        self._logged_errors.add((name, reason))
        (log.warning if first else log.debug)("tier transfer %s of %d pages failed: %s", op.link, op.node.num_pages, op.error)
        if op.src == DISK and op.source_lost:
            self._drop_disk_subtree(op.node)

    def _drop_disk_subtree(self, node: TreeNode) -> None:
        """A disk page is gone: the disk copies of the node and of everything below it are unusable
        (their prefix cannot be read); forget them, and the nodes held nowhere else."""
        stack = [node]
        order: list[TreeNode] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # leaves first
            if n.disk is not None:
                self._free_disk(self.tree.clear_resident(n, DISK))
            self._prune(n)

    def _prune(self, node: TreeNode) -> None:
        """Remove `node` and its ancestors while they are resident nowhere, childless and unused
        (a node that lost its only copy while a transfer or a request held it)."""
        while node.parent is not None and not node.tiers() and not node.children and node.evictable:
            parent = node.parent
            self.tree.remove_leaf(node)
            self.stats.add("dropped_tokens", node.num_pages * self.page_size)
            node = parent

    def _free_disk(self, keys: Sequence[Handle]) -> None:
        store = self.stores[DISK]
        for key in keys:
            try:
                store.free([key])
            except KeyError:
                pass  # the store already discarded it (corrupt file)

    # ---- background write-back ---------------------------------------------------------------
    def plan_disk_writeback(self, clean_target_pages: int, max_pages: int) -> list[TransferOp]:
        """`plan_writeback(HOST, DISK, ...)`: background host -> disk write-back."""
        return self.plan_writeback(HOST, DISK, clean_target_pages, max_pages)

    def plan_writeback(self, src: str, dst: str, clean_target_pages: int, max_pages: int) -> list[TransferOp]:
        """Phase one of background write-back, `src` -> the next tier down `dst` (device -> host or
        host -> disk): while fewer than `clean_target_pages` evictable pages of `src` are *clean*
        (`dst` already holds them, so evicting them from `src` is a free drop: the watermark),
        prepare copies of the coldest dirty ones, at most `max_pages` and no more than the watermark
        lacks. Done ahead of need by a transfer engine, this keeps copies off the thread that evicts.
        Only nodes whose parent is already in `dst` qualify (`dst` stays prefix-closed; their children
        follow in a later round), in use or not (a locked prefix would otherwise keep every node below
        it out of `dst` for as long as requests hold it), but not one a transfer is moving (pinned). Each op locks its node's path until `complete` (so the
        ancestors a copy keeps from being leaves are not counted as evictable either). The caller
        executes the ops and passes each to `complete`."""
        if (src, dst) not in ((DEVICE, HOST), (HOST, DISK)):
            raise ValueError(f"write-back goes one tier down (device -> host, host -> disk), not {src} -> {dst}")
        with self._mutex:
            if src not in self.stores or dst not in self.stores:
                return []
            if self._clean_pages(src) >= clean_target_pages:
                return []  # clean enough already (what the scan below would find, in O(1))
            # nothing changed since this very plan found nothing to do: it would find nothing again
            # (the engine asks every scheduler step; most steps only decode)
            memo = (src, dst, clean_target_pages, max_pages, self.tree.version, self.stores[dst].free_pages)
            if self._idle_plans.get((src, dst)) == memo:
                return []
            ops = self._plan_writeback(src, dst, clean_target_pages, max_pages)
            if not ops:
                self._idle_plans[(src, dst)] = memo
            return ops

    def _plan_writeback(self, src: str, dst: str, clean_target_pages: int, max_pages: int) -> list[TransferOp]:
        with self._mutex:
            clean = self._clean_pages(src)
            # a shared store takes the pages worth sharing (hit at least `min_hits` times), paced by
            # `max_pages` per round, whether or not the device also holds them
            shared_hits = self.stores[dst].min_hits if self.stores[dst].shared else None
            if shared_hits is None:
                candidates, incoming = self._writeback_candidates(src, dst)
                clean += incoming  # clean once their copies land
            else:
                candidates = self._shared_candidates(src, dst, shared_hits)
            budget = max_pages if shared_hits is not None else min(max_pages, clean_target_pages - clean)
            if budget <= 0 or not candidates:
                return []
            if shared_hits is None and budget + 1 < len(candidates):
                # at most `budget` nodes are taken (a page each at least), then one that does not fit
                candidates = heapq.nsmallest(budget + 1, candidates, key=self.priority)
            else:
                candidates.sort(key=self.priority)
            ops: list[TransferOp] = []
            for n in candidates:
                if n.num_pages > budget:
                    if shared_hits is None:
                        break
                    if ops:
                        continue  # the store's pacing: a later round takes it
                    # else a node larger than a whole batch goes alone, or it would never be shared
                op = self.prepare(n, dst, "backup", may_evict=True)
                if op is None:
                    break
                self.tree.lock(n)
                op.locks_path = True
                ops.append(op)
                budget -= n.num_pages
            return ops

    def _writeback_candidates(self, src: str, dst: str) -> tuple[list[TreeNode], int]:
        """`_plan_writeback`'s scan for a tier below that is not a shared store: the unpinned nodes
        of `src` not in `dst` nor on their way there whose parent `dst` holds (or is the root), and
        the pages on their way to `dst`. (A host page also on the device is not on disk yet:
        evicting it from the device later would leave the disk tier without it.) One pass over
        `src`'s resident nodes with the attribute reads inlined: it runs whenever the watermark is
        short."""
        candidates: list[TreeNode] = []
        incoming = 0
        append = candidates.append
        for n in self.tree.resident[src]:
            if getattr(n, dst) is not None:
                continue
            if dst in n.incoming:
                incoming += n.num_pages
                continue
            parent = n.parent
            # in use or not (a prefix every request holds locked, a shared system prompt, must reach
            # `dst` first or nothing below it ever could; its bytes are final), but not being moved
            if n.pins == 0 and parent is not None and (parent.parent is None or getattr(parent, dst) is not None):
                append(n)
        return candidates, incoming

    def _shared_candidates(self, src: str, dst: str, min_hits: int) -> list[TreeNode]:
        """`_plan_writeback`'s scan for a shared store below: nodes of `src` not in the store nor
        on their way, hit at least `min_hits` times, that the store accepts, whose parent the store
        holds (or is the root). A shared store also takes pages in use: a hot prefix is the one most
        worth sharing."""
        out = []
        for n in self.tree.resident[src]:
            if n.disk is not None or dst in n.incoming:
                continue
            if n.hit_count < min_hits or not self.stores[dst].accepts(n.keys):
                continue
            if n.parent.is_root or n.parent.in_tier(dst):  # type: ignore[union-attr]
                out.append(n)
        return out

    def _clean_pages(self, tier: str) -> int:
        """Evictable pages of `tier` that `_clean` holds for, from the tree's O(1) counts."""
        shared = self.tree.evictable_shared_pages
        if tier == DEVICE:
            return shared(DEVICE, HOST)
        return shared(HOST, DISK) + shared(HOST, DEVICE) - shared(DEVICE, HOST, DISK)

    @staticmethod
    def _clean(node: TreeNode, tier: str) -> bool:
        """Evicting `node` from `tier` copies nothing: the tier it would be demoted to holds it
        (mirrors `_evict_node`: device demotes to host; host to disk unless the device holds it)."""
        if tier == DEVICE:
            return node.host is not None
        return node.disk is not None or node.device is not None

    # ---- eviction --------------------------------------------------------------------------
    def evict(self, tier: str, num_pages: int) -> int:
        """Free at least `num_pages` pages of `tier` if possible, leaf-first, coldest first;
        demote where the next tier can take the pages (`eviction_demotes`), else free clean leaves
        before dirty ones (a dirty page dropped is counted in `dropped_dirty_tokens`). Never takes a
        locked or pinned node (a copy in flight pins it). Returns the pages freed."""
        with self._mutex:
            freed = self._evict_disk_orphans(num_pages) if tier == DISK else 0
            if self.tree.leaves is not None:
                freed += self._evict_ordered(tier, num_pages - freed)
            else:
                freed += self._evict_rebuilt(tier, num_pages - freed)
            if tier == DISK and freed < num_pages and self.stores[DISK].peers_wrote:
                # a shared directory full of other processes' pages this one cannot free through its
                # tree: the oldest of those go, so no process is locked out of the one capacity
                freed += self.stores[DISK].evict_unindexed(num_pages - freed)
            return freed

    def _leaf_key(self, node: TreeNode, tier: str) -> tuple:
        """Eviction order in `tier`: the policy's priority; without demotion, clean leaves (held one
        tier down: a free drop) before dirty ones."""
        if self._demotes(tier):
            return self.priority(node)
        return (not self._clean(node, tier), self.priority(node))

    def _evict_ordered(self, tier: str, num_pages: int) -> int:
        """`evict` over the tree's incrementally kept leaf queue (`tree/leaves.py`): O(log n) per
        page freed or stale entry skipped, plus the locked or pinned leaves it must step over."""
        queue = self.tree.leaves[tier]  # type: ignore[index]
        freed = 0
        held: list[TreeNode] = []  # in use now: queued again once this eviction is done
        while freed < num_pages:
            entry = queue.pop()
            if entry is None:
                break
            key, node = entry
            if node.parent is None or not node.in_tier(tier) or self._has_child_in(node, tier):
                continue  # stale: queued again when it becomes a leaf of `tier` again
            if not node.evictable:
                held.append(node)
                continue
            now = queue.key(node)
            if now > key:  # used since it was queued: its turn comes later
                queue.push(node)
                continue
            freed += self._evict_node(node, tier)  # (its parent is queued as it becomes a leaf)
        for node in held:
            queue.push(node)
        return freed

    def _evict_rebuilt(self, tier: str, num_pages: int) -> int:
        """`evict` for a policy whose priorities change with time (`reuse`): a heap built over the
        tier's evictable leaves on each call."""
        freed = 0
        key = lambda n: self._leaf_key(n, tier)  # noqa: E731
        heap = [(key(n), n.id, n) for n in self.tree.tier_leaves(tier) if n.evictable]
        heapq.heapify(heap)
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not node.in_tier(tier) or not node.evictable or self._has_child_in(node, tier):
                continue
            parent = node.parent
            freed += self._evict_node(node, tier)
            if parent is not None and not parent.is_root and parent.in_tier(tier) and parent.evictable:
                if not self._has_child_in(parent, tier):
                    heapq.heappush(heap, (key(parent), parent.id, parent))
        return freed

    @staticmethod
    def _has_child_in(node: TreeNode, tier: str) -> bool:
        """A child is in `tier`, or a copy into `tier` is on its way (a background write-back
        prepared while `node` was there): evicting `node` would break prefix closure."""
        return any(c.in_tier(tier) or tier in c.incoming for c in node.children.values())

    def _evict_disk_orphans(self, num_pages: int) -> int:
        """Free disk pages no tree node refers to (left by an earlier process and not matched since
        the restart): by LRU they are the coldest pages there are."""
        store = self.stores[DISK]
        if store.stored_pages <= self.tree.pages[DISK]:
            return 0
        referenced = {k for n in self.tree.resident[DISK] for k in n.keys}
        # a write in flight may have stored its pages already: they are the tree's a moment later,
        # or freed by the copy's own completion (an orphaned copy stays in `_disk_writes` until then)
        referenced.update(k for op in self._disk_writes for k in op.dst_handles)
        # in key order, not the store's index order (a directory scan's), so that every rank of a
        # tensor-parallel cache frees the same pages; O(n log num_pages)
        victims = heapq.nsmallest(num_pages, (k for k in store.keys() if k not in referenced))
        self._free_disk(victims)
        return len(victims)

    def _demotes(self, tier: str) -> bool:
        """Whether evicting a dirty page from `tier` copies it down (`CacheConfig.eviction_demotes`)."""
        mode = self.config.eviction_demotes
        return mode == "all" or (mode == "host" and tier == DEVICE)

    def _evict_node(self, node: TreeNode, tier: str) -> int:
        tokens = node.num_pages * self.page_size
        below = HOST if tier == DEVICE else DISK if tier == HOST else None
        dirty = below is not None and self.has_tier(below) and not self._clean(node, tier)
        if dirty and below == DISK and not self.stores[DISK].demote_on_evict:
            dirty = False  # the shared store is written by background write-back only, never here
        # write-back admission (policy/reuse.py): is this page worth a copy below?
        keep = dirty and (self.reuse is None or self.reuse.admit(node))
        if keep and self._demotes(tier):
            self.tree.pin(node)  # keep it out of the nested evictions its demotion may cause
            try:
                self.ensure(node, below, kind="demote", may_evict=True)  # type: ignore[arg-type]
            finally:
                self.tree.unpin(node)
        elif dirty:  # never copy here: the page is lost to the tiers below
            self.stats.add("dropped_dirty_tokens", tokens, tier)
        handles = self.tree.clear_resident(node, tier)
        if tier == DISK:
            self._free_disk(handles)
        else:
            self.stores[tier].free(handles)
        self.stats.add("evicted_tokens", tokens, tier)
        if node.prefetched and (tier == DEVICE or (tier == HOST and node.device is None)):
            self.stats.add_prefetch(node.prefetched, "wasted_tokens", tokens)
            node.prefetched = None
        if not node.tiers():
            self.tree.remove_leaf(node)
            self.stats.add("dropped_tokens", tokens)
        return node.num_pages

    # ---- accounting --------------------------------------------------------------------------
    def record_request(self, prompt_tokens: int, match: MatchResult, covered_by_prefetch: int = 0) -> None:
        """Count one scheduled request's hits per tier (call once per request, with the match taken
        before its promotion) and credit prefetches that it used."""
        with self._mutex:
            self.stats.record_request(prompt_tokens, match.device_tokens, match.host_tokens, match.disk_tokens, covered_by_prefetch)
            self.tree.version += 1  # hit counts changed (lfu orders by them)
            if self.reuse is not None:
                self.reuse.on_request(match.path)
            for node in match.path:
                node.hit_count += 1
                if node.prefetched:
                    self.stats.add_prefetch(node.prefetched, "used_tokens", node.num_pages * self.page_size)
                    node.prefetched = None
                if (
                    self.config.write_policy == "write_through_selective"
                    and node.host is None
                    and node.device is not None
                    and node.hit_count >= self.config.write_through_threshold
                    and self.has_tier(HOST)
                ):
                    self.ensure(node, HOST, kind="backup", may_evict=False)

    def stored_pages(self) -> dict[str, int]:
        return dict(self.tree.pages)

    def snapshot(self) -> dict:
        snap = self.stats.snapshot()
        snap["stored_tokens"] = {t: self.tree.pages[t] * self.page_size for t in TIERS}
        snap["capacity_tokens"] = {t: (self.stores[t].capacity_pages * self.page_size if t in self.stores else 0) for t in TIERS}
        lower = self.stores.get(DISK)
        lower_snap = lower.snapshot() if lower is not None else None
        if lower_snap is not None:
            # the lower-tier slot holds the shared store: its "disk" figures are store figures
            snap["lower_tier"] = lower.name
            snap["store"] = lower_snap
        return snap

    def check(self) -> None:
        """Tree invariants plus store accounting: each store's used pages equal what the tree holds
        there (the device also counts pages handed out by `allocate_device` and not yet returned)."""
        with self._mutex:
            self.tree.check()
            dev = self.stores[DEVICE]
            if dev.used_pages != self.tree.pages[DEVICE] + self.outstanding_device_pages:
                raise InvariantError(
                    f"device store uses {dev.used_pages} pages; tree holds {self.tree.pages[DEVICE]} and {self.outstanding_device_pages} are outstanding"
                )
            if HOST in self.stores and self.stores[HOST].used_pages != self.tree.pages[HOST]:
                raise InvariantError(f"host store uses {self.stores[HOST].used_pages} pages; tree holds {self.tree.pages[HOST]}")
            if DISK in self.stores:
                disk = self.stores[DISK]
                # a shared directory's used pages are every process's: compare with what this store indexes
                held = disk.stored_pages
                if held < self.tree.pages[DISK]:
                    raise InvariantError(f"disk store holds {held} pages; tree claims {self.tree.pages[DISK]}")

    def reset(self) -> None:
        """Forget the tree's device and host copies (SGLang's flush); disk files stay for a restart."""
        with self._mutex:
            for node in list(self.tree.nodes()):
                for tier in (DEVICE, HOST):
                    if node.in_tier(tier):
                        self.stores[tier].free(self.tree.clear_resident(node, tier))
            self.tree = RadixTree(self.page_size, self.namespace)
            self._order_leaves()

    def nodes_in(self, tier: str) -> Iterable[TreeNode]:
        return iter(self.tree.resident[tier])
