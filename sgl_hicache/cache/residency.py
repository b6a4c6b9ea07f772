"""The residency manager: which pages of which prefixes each tier holds, and the request API over it.

`TieredCache` answers matches, takes inserts, locks paths, hands out device pages and checks its
books; the jobs it delegates live beside it, one module each: transfers (`transaction.py`), the
copies it makes itself (`copies.py`), promotion jobs (`jobs.py`), eviction (`evictor.py`),
write-back planning (`writeback.py`) and the lower tier's own cases (`lower.py`), each seeing the
cache through the narrow protocols of `protocols.py`.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence

from ..config import CacheConfig
from ..hashing import Namespace, int64_tokens
from ..policy.eviction import eviction_policy, orders_incrementally
from ..policy.reuse import ReuseModel
from ..policy.rewarm_choice import rewarm_paths
from ..policy.writeback_choice import disk_write_through_due, selective_write_through_due, write_through_on_insert
from ..stats import CacheStats
from ..tiers.base import DEVICE, DISK, HOST, TIERS, Handle, TierStore
from ..tiers.build import build_stores
from ..transfer.bandwidth import BandwidthMeter
from ..transfer.handlers import default_handlers, execute
from ..transfer.ops import PromotionJob, TransferOp
from ..tree.node import TreeNode, differing, slot_array
from ..tree.radix import InvariantError, RadixTree
from ..tree.traffic import count_edge, count_request, count_stop
from .copies import Copies
from .evictor import Evictor
from .jobs import PromotionJobs
from .lower import LowerTier
from .protocols import Priority
from .results import InsertOutcome, PrefixMatch
from .transaction import Transactions
from .writeback import WritebackPlanner


class TieredCache:
    """A radix prefix cache whose nodes live in a device, a host and a lower (disk or store) tier.

    Contract:
    - `match(tokens)` never moves bytes; it may split a node and adopt disk pages left by an earlier
      process (restart), or written by another process sharing the directory, into the tree.
    - `promote(match)` brings the matched path to the device tier (disk -> host -> device), evicting
      colder unlocked nodes as needed; what cannot be brought up stays a miss. Never raises on a
      tier failure: a corrupt or unreadable page is a miss, counted in `stats.errors`.
    - `insert(tokens, handles)` hands the caller's device pages (one per whole page of `tokens`) to
      the tree; pages the tree already held come back in `InsertOutcome.duplicates`.
    - `allocate_device(n)` returns `n` free device pages, evicting (demoting) as needed, or None.
    - Eviction from a tier is leaf-first in that tier, ordered by the eviction policy, never touches
      a locked or pinned node, and demotes (device -> host -> disk) instead of dropping where the
      next tier can take the pages. A disk directory shared with other processes is one capacity:
      when this tree cannot free enough of it, the oldest pages the others wrote go.
    - With `inline_writes` (a cache driven without a `RequestController`) write-through copies run
      synchronously in `insert`, `record_request` and `complete`; without, the controller's pump
      plans them as background copies (`plan_write_through`).
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
        *,
        priority: Priority | None = None,
        inline_writes: bool = True,
    ) -> None:
        """`priority`: the eviction order (lowest goes first) in place of `config.eviction_policy`'s
        (the oracle's Belady order)."""
        self.config = config
        self.page_size = config.page_size
        self.clock = clock
        self.inline_writes = inline_writes
        self.namespace = Namespace.for_model(config.key_layout, config.page_size, config.tenant_salt)
        self.tree = RadixTree(config.page_size, self.namespace)
        self.stores: dict[str, TierStore] = build_stores(config, self.namespace, device, host, disk)
        self.tree.gaps.track_only(self.stores)  # write-back links between the tiers it has only
        # learns from served requests: `reuse` eviction, `continuation`, hint ranking (`learn_reuse`)
        self._mutex = threading.RLock()
        self.reuse: ReuseModel | None = None
        if config.eviction_policy == "reuse" or config.predictor == "continuation" or config.admission_min_probability:
            self.learn_reuse()
        # a given priority (the oracle's Belady key) falls as the future comes closer: never incremental
        self._incremental_order = orders_incrementally(config.eviction_policy, custom_priority=priority is not None)
        if priority is None:
            if config.eviction_policy == "reuse":
                priority = self.learn_reuse().priority
            else:
                priority = eviction_policy(config.eviction_policy)
        self.priority: Priority = priority
        self.handlers = default_handlers(self.stores)
        self.meter = BandwidthMeter()
        self.stats = CacheStats()
        # device pages handed out by allocate_device and not yet inserted or freed
        self.outstanding_device_pages = 0
        # pages inserted as new nodes, and copies completed, so far (the controller's pump starts a
        # write-through round when either moved)
        self.committed_pages = 0
        self.landed_copies = 0
        # the helpers, each given the narrow state it reads (`protocols.py`) and the helpers it calls
        self.lower = LowerTier(self)
        self.tx = Transactions(self, self.lower, self.meter)
        self.evictor = Evictor(self, self.lower)
        self.copies = Copies(self, self.tx, self.lower, self.evictor)
        self.evictor.demoter = self.copies  # the one two-way link: copies make room by evicting
        self.jobs = PromotionJobs(self, self.copies)
        self.writeback = WritebackPlanner(self, self.copies)
        self._order_leaves()
        if DISK in self.stores and self.stores[DISK].overfull_pages:
            # restarted with a smaller disk capacity than the files found: trim to capacity
            self.lower.evict_orphans(self.stores[DISK].overfull_pages)

    def _order_leaves(self) -> None:
        """Keep the tree's eviction candidates ordered incrementally, where the policy's priorities
        only grow with use (`lru`, `lfu`: see `tree/leaves.py`); other orders (`reuse`, the oracle's)
        move with the clock, so their evictions order the leaves afresh each call."""
        if self._incremental_order:
            self.tree.order_leaves(self.evictor.leaf_entry_for)

    @property
    def orphans(self) -> list[TransferOp]:
        return self.jobs.orphans

    # ---- queries ---------------------------------------------------------------------------
    def has_tier(self, tier: str) -> bool:
        return tier in self.stores

    def match(self, tokens: Sequence[int], touch: bool = True, count: bool | None = None) -> PrefixMatch:
        """The longest cached prefix of `tokens`. `touch` refreshes its recency; `count` (default:
        `touch`) counts its edges as one request's traffic: once per request (its first match), never
        for a re-match of a request already counted."""
        with self._mutex:
            path, matched = self.tree.walk(tokens)
            if self.has_tier(DISK):
                path.extend(self.lower.adopt(path, tokens, matched))
            if touch:
                now = self.clock()
                self.tree.touched()  # recency changed: eviction order may have
                if count if count is not None else touch:
                    count_request(self.tree.root, self.tree.half_life, path, now)
                for node in path:
                    node.last_access = now
            return self.describe(path)

    def split_head(self, node: TreeNode, pages: int) -> TreeNode:
        """`node`'s first `pages` pages as a node of their own (the upper half of a split), or `node`
        itself where it cannot be split now (pinned, a copy into it in flight, or `pages` not inside it)."""
        with self._mutex:
            if not 0 < pages < node.num_pages or node.pins or node.incoming or node.parent is None:
                return node
            return self.tree.split(node, pages)

    def describe(self, path: list[TreeNode]) -> PrefixMatch:
        """`path`'s tokens attributed to the highest tier holding each node."""
        ps = self.page_size
        dev = host = disk = 0
        handles = array("q")
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
        return PrefixMatch(path, dev, host, disk, handles, path[-1] if path else self.tree.root, last_device)

    # ---- locks -----------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        with self._mutex:
            self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        with self._mutex:
            self.tree.unlock(node)
            # a node can lose its only copy while locked (a corrupt disk page dropped it): the last
            # unlock removes it
            self.prune(node)

    # ---- device pages for computed KV --------------------------------------------------------
    def allocate_device(self, num_pages: int) -> array | None:
        """`num_pages` free device pages (an int64 `array`), evicting as needed; None if they cannot be had."""
        with self._mutex:
            store = self.stores[DEVICE]
            if store.free_pages < num_pages:
                self.evictor.evict(DEVICE, num_pages - store.free_pages)
            handles = store.allocate([b""] * num_pages)
            if handles is None:
                return None
            self.outstanding_device_pages += num_pages
            return handles if type(handles) is array else slot_array(handles)

    def free_device(self, handles: Sequence[Handle]) -> None:
        """Return device pages from `allocate_device` that were not inserted (or were duplicates)."""
        with self._mutex:
            self.stores[DEVICE].free(handles)
            self.outstanding_device_pages -= len(handles)

    def insert(
        self, tokens: Sequence[int], device_handles: Sequence[Handle], from_allocate_device: bool = True
    ) -> InsertOutcome:
        """Insert the whole pages of `tokens`, whose KV the caller holds in `device_handles` (one per
        page, from `allocate_device` or from an earlier match). With `from_allocate_device=False`
        the new pages came from the device store's own allocator (SGLang's), not from
        `allocate_device`, so they are not counted against its outstanding pages."""
        with self._mutex:
            ps = self.page_size
            limit = self.tree.page_aligned(tokens)
            if len(device_handles) != limit // ps:
                raise ValueError(f"insert of {limit // ps} whole pages with {len(device_handles)} device handles")
            if not (isinstance(tokens, array) and tokens.typecode == "q"):
                tokens = int64_tokens(tokens)  # once: the walk and the new node's edge use it as is
            path, matched = self.tree.walk(tokens)
            duplicates = array("q")
            prefix_tokens = 0
            page = 0
            adopted = 0
            if not (type(device_handles) is array and device_handles.typecode == "q"):
                device_handles = slot_array(device_handles)  # slices of an int64 array are arrays already
            for node in path:
                mine = device_handles[page : page + node.num_pages]
                if node.device is not None:
                    if mine != node.device:  # the usual SGLang case reuses the tree's pages: equal (memcmp)
                        duplicates.extend(differing(mine, node.device))
                    if prefix_tokens == page * ps:
                        prefix_tokens += node.num_pages * ps
                elif (
                    node.parent is not None
                    and DEVICE not in node.incoming
                    and (node.parent.is_root or node.parent.device is not None)
                ):
                    # the caller recomputed pages the tree holds only in lower tiers: keep its copy
                    # (not while a copy to the device is in flight: that one lands there)
                    self.tree.set_resident(node, DEVICE, mine, owned=True)
                    adopted += len(mine)
                else:
                    duplicates.extend(mine)
                page += node.num_pages
            new_nodes: list[TreeNode] = []
            last = path[-1] if path else self.tree.root
            if matched < limit:
                # the walk splits every node it ends inside, so no child holds the next page here
                if last.is_root or last.device is not None:
                    node = self.tree.add_child(last, tokens[matched:limit], owned=True)
                    node.last_access = self.clock()  # before it is queued for eviction with that key
                    self.tree.set_resident(node, DEVICE, device_handles[page:], owned=True)
                    adopted += node.num_pages
                    new_nodes.append(node)
                    last = node
                else:
                    duplicates.extend(device_handles[page:])
            now = self.clock()
            self.tree.touched()
            hl = self.tree.half_life.value
            for node in new_nodes:
                node.last_access = now
                count_edge(node.parent, node.edge_key, now, hl)  # type: ignore[arg-type]
            if not last.is_root:
                count_stop(last, now, hl)  # the request's path ends here
            if from_allocate_device:
                self.outstanding_device_pages -= adopted
            self.committed_pages += adopted
            if self.reuse is not None:
                self.reuse.on_insert(new_nodes)
            if self.inline_writes and write_through_on_insert(self.config) and self.has_tier(HOST):
                for node in new_nodes:
                    self.copies.copy_now(node, HOST, kind="backup", evict=True)
            return InsertOutcome(prefix_tokens, duplicates, last, adopted, tuple(new_nodes))

    # ---- transfers and promotion (delegated) ---------------------------------------------------
    def promote(self, match: PrefixMatch, kind: str = "demand", lock: bool = False) -> PrefixMatch:
        """Bring the matched path to the device tier now (disk -> host -> device), root first; stops at
        the first page that cannot come up (no room, or a failed read). Returns the path described
        afresh. With `lock`, the returned path is locked for the caller (who must `unlock` its
        `last_node`), atomically, so no other thread can evict the device pages it reports.
        The synchronous form of `plan_promotion` + execute + `advance`."""
        with self._mutex:
            job = self.jobs.plan(match, kind, DEVICE, evict=True)
            if job is not None:
                for st in job.stages:
                    for op in st.ops:
                        execute(op, self.handlers)
                self.jobs.advance(job)
                self.jobs.release(job)
            result = self.describe([n for n in match.path if n.parent is not None])
            if lock:
                self.tree.lock(result.last_node)
            return result

    def copy_now(self, node: TreeNode, tier: str, kind: str, may_evict: bool) -> bool:
        """Make `node` (and its ancestors) resident in `tier` synchronously, on this thread (copies
        and, with `may_evict`, evictions). False when the pages could not be placed or read."""
        with self._mutex:
            return self.copies.copy_now(node, tier, kind, may_evict)

    def prepare(
        self,
        node: TreeNode,
        dst: str,
        kind: str,
        may_evict: bool,
        src: str | None = None,
        src_handles: list[Handle] | None = None,
    ) -> TransferOp | None:
        """Phase one of a transfer: make room (with `may_evict`), allocate in `dst`, pin the node.
        None if it cannot be done now (no room, no source, or a transfer into `dst` is pending)."""
        with self._mutex:
            return self.copies.reserve(node, dst, kind, may_evict, src, src_handles)

    def complete(self, op: TransferOp) -> bool:
        """Phase three: record the new copy (or undo the allocation if the copy failed or was
        cancelled). With `inline_writes`, a page landed on host is then written through to disk
        when the disk write policy says so."""
        with self._mutex:
            done = self.tx.complete(op)
            self.landed_copies += done
            if (
                done
                and self.inline_writes
                and op.dst == HOST
                and self.has_tier(DISK)
                and disk_write_through_due(self.config, op.node)
            ):
                self.copies.copy_now(op.node, DISK, kind="backup", evict=True)
            return done

    def plan_promotion(
        self, match: PrefixMatch | Sequence[TreeNode], kind: str = "demand", target: str = DEVICE, evict: bool = True
    ) -> PromotionJob | None:
        """Phase one for a whole path (a match, or nodes from the root down): lock it, allocate every
        destination page, and return the job; None when nothing needs to move or nothing could be
        placed. `target=HOST` brings disk-only nodes to host only. With `evict=False` the copies only
        fill free pages and never push anything out (what a prediction may do). The caller must
        `release` the job once it is finished or cancelled."""
        with self._mutex:
            return self.jobs.plan(match, kind, target, evict)

    def advance(self, job: PromotionJob) -> bool:
        """Apply, in path order, the stages whose bytes have arrived. Returns True when the job is
        finished (every stage applied, or a stage failed and the rest was cancelled)."""
        with self._mutex:
            return self.jobs.advance(job)

    def cancel(self, job: PromotionJob) -> None:
        """Give up the stages not applied yet (the caller recomputes them). Waits for copies already
        running, since their destination pages cannot be reused before they finish."""
        with self._mutex:
            self.jobs.cancel(job)

    def reap_orphans(self) -> None:
        """Complete (as cancelled: free their destination pages) the orphaned copies that ended. Never waits."""
        with self._mutex:
            self.jobs.reap_orphans()

    def release(self, job: PromotionJob) -> None:
        """End a finished job: unlock its path."""
        with self._mutex:
            self.jobs.release(job)

    def evict(self, tier: str, num_pages: int) -> int:
        """Free at least `num_pages` pages of `tier` if possible (`Evictor`). Returns the pages freed."""
        with self._mutex:
            return self.evictor.evict(tier, num_pages)

    def plan_writeback(
        self,
        src: str,
        dst: str,
        clean_target_pages: int,
        max_pages: int,
        only: Callable[[TreeNode], bool] | None = None,
    ) -> list[TransferOp]:
        """Phase one of background write-back `src` -> `dst` (`WritebackPlanner.plan`)."""
        with self._mutex:
            return self.writeback.plan(src, dst, clean_target_pages, max_pages, only)

    def plan_write_through(self, src: str, dst: str, nodes: list[TreeNode], max_pages: int) -> list[TransferOp]:
        """Write-through at commit of one committed path (`WritebackPlanner.plan_path`)."""
        with self._mutex:
            return self.writeback.plan_path(src, dst, nodes, max_pages)

    def plan_disk_writeback(self, clean_target_pages: int, max_pages: int) -> list[TransferOp]:
        """`plan_writeback(HOST, DISK, ...)`: background host -> disk write-back."""
        return self.plan_writeback(HOST, DISK, clean_target_pages, max_pages)

    def learn_reuse(self) -> ReuseModel:
        """The reuse model, made on the first call: it learns from the requests served from then on."""
        with self._mutex:
            if self.reuse is None:
                floor = self.config.admission_min_probability
                self.reuse = ReuseModel(lambda: self.clock(), admit_min_probability=floor)
            return self.reuse

    def prune(self, node: TreeNode) -> None:
        """Remove `node` and its ancestors while they are resident nowhere, childless and unused
        (a node that lost its only copy while a transfer or a request held it)."""
        while node.parent is not None and not node.tiers() and not node.children and node.evictable:
            parent = node.parent
            self.tree.remove_leaf(node)
            self.stats.add("dropped_tokens", node.num_pages * self.page_size)
            node = parent

    # ---- accounting --------------------------------------------------------------------------
    def record_request(self, prompt_tokens: int, match: PrefixMatch, covered_by_prefetch: int = 0) -> None:
        """Count one scheduled request's hits per tier (call once per request, with the match taken
        before its promotion) and credit prefetches that it used."""
        with self._mutex:
            self.stats.record_request(
                prompt_tokens, match.device_tokens, match.host_tokens, match.disk_tokens, covered_by_prefetch
            )
            self.tree.touched()  # hit counts changed (lfu orders by them)
            if self.reuse is not None:
                self.reuse.on_request(match.path)
            for node in match.path:
                node.hit_count += 1
                if node.prefetched:
                    self.stats.add_prefetch(
                        node.prefetched, "used_tokens", node.num_pages * self.page_size, node.prefetch_trigger
                    )
                    node.prefetched = node.prefetch_trigger = None
                if self.inline_writes and selective_write_through_due(self.config, node) and self.has_tier(HOST):
                    self.copies.copy_now(node, HOST, kind="backup", evict=False)

    def stored_pages(self) -> dict[str, int]:
        return dict(self.tree.pages)

    def snapshot(self) -> dict:
        snap = self.stats.snapshot()
        snap["stored_tokens"] = {t: self.tree.pages[t] * self.page_size for t in TIERS}
        snap["capacity_tokens"] = {
            t: (self.stores[t].capacity_pages * self.page_size if t in self.stores else 0) for t in TIERS
        }
        lower = self.stores.get(DISK)
        lower_snap = lower.snapshot() if lower is not None else None
        if lower is not None and lower_snap is not None:
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
                    f"device store uses {dev.used_pages} pages; tree holds {self.tree.pages[DEVICE]} "
                    f"and {self.outstanding_device_pages} are outstanding"
                )
            if HOST in self.stores and self.stores[HOST].used_pages != self.tree.pages[HOST]:
                raise InvariantError(
                    f"host store uses {self.stores[HOST].used_pages} pages; tree holds {self.tree.pages[HOST]}"
                )
            if DISK in self.stores:
                # a shared directory's used pages are every process's: compare with what this store indexes
                held = self.stores[DISK].stored_pages
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

    def hottest_paths(self, budget_pages: int) -> list[array]:
        """The prefixes used most recently and most often, within `budget_pages` (what a re-warm
        record keeps: `policy/rewarm_choice.py`)."""
        with self._mutex:
            return rewarm_paths(self.tree, budget_pages)

    def nodes_in(self, tier: str) -> Iterable[TreeNode]:
        return iter(self.tree.resident[tier])
