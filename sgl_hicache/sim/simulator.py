"""The embedded engine: an in-process stand-in for an SGLang server, on a virtual clock.

It drives the same `TieredCache` the SGLang backend drives. Real bytes move through the real host
and disk stores (in a scaled-down KV layout, `EngineConfig.storage_layout`, so a production trace
fits this machine); time is charged from the cost model at the preset's full KV size:

- a request arrives (trace clock scaled by `time_scale`, or closed-loop at `concurrency`), is
  matched, and waits in a FIFO queue. Under `prefetch`/`predict` the disk part of its match starts
  moving up to host as soon as it is among the first `prefetch_window` waiting requests (at once,
  unless the queue is long): each link (disk->host, host->device) is a FIFO pipe at the preset bandwidth,
  and a stage's bytes are really copied when its virtual finish time is reached;
- a continuous-batching scheduler with chunked prefill: each step's prefill budget
  (`max_batch_tokens`) goes first to prompts being prefilled, then to waiting requests (FIFO),
  admitted while device pages allow; a long prompt is prefilled over several steps. When a
  request whose prefetch is still in flight is admitted, the step waits for the rest if that is
  estimated to be faster than recomputing it; otherwise the rest is cancelled and recomputed
  (`loads_waited` / `loads_recomputed`);
- under `demote` (SGLang HiCache's behaviour) the lower-tier part is loaded when the request is
  scheduled. Disk reads must land in host memory first, so they block the step; host->device
  copies overlap the forward pass layer by layer:
  step = disk_load + max(compute, host_to_device) + host_to_device / num_layers;
- demotions that made room for a step (device -> host copies of evicted pages) are charged to it
  at the host link's bandwidth; host -> disk writes do not block a step (the SGLang backend writes
  back in the background) but occupy the disk: reads and writes share one FIFO pipe, so a write
  delays the disk reads queued after it;
- one step = one batched prefill of the step's chunks plus one decode token for every running
  request; a request's first token comes at the end of the step that computes its last chunk.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

from ..config import DEFAULT_POLICY, CacheConfig, KVLayout, TieringPolicy
from ..control.composition import build_cache, build_controller
from ..control.lifecycle import Admission, Ticket
from ..control.rewarm import save_rewarm, start_rewarm
from ..policy.hint_rules import Hint, HintError, hint_tokens
from ..policy.oracle import Oracle
from ..records import RecordColumns
from ..replay.trace import Request
from ..tiers.base import DEVICE, DISK, HOST, TierStore
from ..transfer.executors import VirtualExecutor, VirtualPipes
from ..tree.node import TreeNode
from . import cost
from .presets import HardwarePreset, ModelPreset

POLICIES = ("recompute", "demote", "prefetch", "predict", "oracle")
BYTE_MODES = ("real", "metadata")
# a metadata disk tier has no directory; CacheConfig only needs one to size the tier
_METADATA_DISK_DIR = Path("<metadata: no files>")
_context = attrgetter("context")
_LINK_TIERS = {
    "disk->host": (DISK, HOST),
    "host->device": (HOST, DEVICE),
    "device->host": (DEVICE, HOST),
    "host->disk": (HOST, DISK),
}


@dataclass(frozen=True)
class EngineConfig:
    """One replay's settings. Capacities are in tokens of the trace."""

    policy: str
    model: ModelPreset
    hardware: HardwarePreset
    device_tokens: int
    host_tokens: int = 0
    disk_tokens: int = 0
    page_size: int = 256
    disk_dir: Path | None = None
    concurrency: int | None = 16
    time_scale: float = 1.0
    max_batch_tokens: int = 16384
    max_running: int = 64
    # the policy knobs: the shipped defaults (`config.TieringPolicy`), the same as the server's
    eviction_policy: str = DEFAULT_POLICY.eviction_policy
    write_policy: str = DEFAULT_POLICY.write_policy
    write_through_threshold: int = DEFAULT_POLICY.write_through_threshold
    disk_write_policy: str = DEFAULT_POLICY.disk_write_policy
    eviction_demotes: str = DEFAULT_POLICY.eviction_demotes
    predictor_budget_tokens: int = DEFAULT_POLICY.predictor_budget_tokens
    predictor: str = DEFAULT_POLICY.predictor  # what `predict` runs (config.PREDICTORS); the other policies run none
    admission_min_probability: float = DEFAULT_POLICY.admission_min_probability
    learn_returns: bool = DEFAULT_POLICY.learn_returns  # the server's own retentions (`TieringPolicy`)
    device_writeback_clean_fraction: float = DEFAULT_POLICY.device_writeback_clean_fraction
    writeback_clean_fraction: float = DEFAULT_POLICY.writeback_clean_fraction
    writeback_batch_pages: int = DEFAULT_POLICY.writeback_batch_pages
    prefetch_window: int = 16
    storage_layout: KVLayout = field(
        default_factory=lambda: KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    )
    # "real": bytes really copied through the real stores (proves the data path); "metadata": the
    # same decisions and virtual times, pages accounted but no bytes held or copied (`tiers/metadata.py`)
    byte_mode: str = "real"
    # a shared store in the disk tier's place (`engine/fleet.py`): each server's link to it
    store_bandwidth: float = 0.0  # bytes/s; 0: no store
    store_latency_s: float = 0.0  # per transfer
    # re-warm at start (`control/rewarm.py`): a replay on a `disk_dir` that holds a re-warm record
    # brings its prefixes to host in the background; the record is saved at `end()`
    rewarm: bool = DEFAULT_POLICY.rewarm

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.max_batch_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        if self.byte_mode not in BYTE_MODES:
            raise ValueError(f"unknown byte mode {self.byte_mode!r}; choose one of {', '.join(BYTE_MODES)}")
        if self.store_bandwidth < 0 or self.store_latency_s < 0:
            raise ValueError(
                f"store_bandwidth and store_latency_s must be >= 0, got {self.store_bandwidth}, {self.store_latency_s}"
            )

    def tiering(self) -> TieringPolicy:
        """The policy this replay runs: the knobs above, with the predictor and the queue prefetch
        that `policy` implies (`predict` runs `predictor`; `prefetch` and `predict` prefetch)."""
        return TieringPolicy(
            eviction_policy=self.eviction_policy,
            write_policy=self.write_policy,
            write_through_threshold=self.write_through_threshold,
            disk_write_policy=self.disk_write_policy,
            eviction_demotes=self.eviction_demotes,
            predictor=self.predictor if self.policy == "predict" else "none",
            predictor_budget_tokens=self.predictor_budget_tokens,
            prefetch=self.policy in ("prefetch", "predict"),
            device_writeback_clean_fraction=self.device_writeback_clean_fraction,
            writeback_clean_fraction=self.writeback_clean_fraction,
            writeback_batch_pages=self.writeback_batch_pages,
            admission_min_probability=self.admission_min_probability,
            learn_returns=self.learn_returns,
            rewarm=self.rewarm,
        )

    def cache_config(self, disk_dir: Path | None) -> CacheConfig:
        tiered = self.policy != "recompute"
        return CacheConfig(
            layout=self.storage_layout,
            device_tokens=self.device_tokens,
            host_tokens=self.host_tokens if tiered else 0,
            disk_tokens=self.disk_tokens if tiered and disk_dir is not None else 0,
            page_size=self.page_size,
            disk_dir=disk_dir if tiered else None,
            eviction_policy=self.eviction_policy,
            write_policy=self.write_policy,
            write_through_threshold=self.write_through_threshold,
            disk_write_policy=self.disk_write_policy,
            predictor=self.predictor if self.policy == "predict" else "none",
            admission_min_probability=self.admission_min_probability,
            eviction_demotes=self.eviction_demotes,
        )


@dataclass(eq=False)
class _Flight:
    """One request inside the engine, from arrival to completion; its token ids go with it."""

    req: Request
    arrival: float
    ticket: Ticket
    first_token: float | None = None
    remaining: int = 0
    context: int = 0
    anchor: TreeNode | None = None
    output_pages: Sequence[int] = ()
    prefill_left: int = 0
    prefetch_tried: bool = False
    hits: tuple[int, int, int] = (0, 0, 0)
    short_pages: int = 0  # device pages it lacked at its last failed admission (beyond free + evictable)
    finish_hints: list = field(default_factory=list)  # (hint, prefix) pairs that run when it finishes


def _scratch_dir() -> str | None:
    """Where a replay's throw-away disk tier goes: RAM-backed /dev/shm when there is one, so that a
    replay measures the cache rather than this machine's file-creation rate (its time is virtual
    anyway); `EngineConfig.disk_dir` puts the tier on a real disk instead."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class VirtualLinks(VirtualPipes):
    """The tier links as FIFO pipes in virtual time at the hardware preset's bandwidth (disk reads
    and writes share one pipe, the disk). With `store_bandwidth`, the lower tier is a shared store
    reached over this server's network link: ``latency + bytes / store_bandwidth`` per transfer."""

    def __init__(
        self, model: ModelPreset, hw: HardwarePreset, store_bandwidth: float = 0.0, store_latency_s: float = 0.0
    ) -> None:
        def seconds(link: str, tokens: int) -> float:
            if store_bandwidth > 0 and DISK in _LINK_TIERS[link]:
                return cost.transfer_seconds(tokens * model.kv_bytes_per_token, store_bandwidth, store_latency_s)
            return cost.kv_transfer_seconds(model, hw, tokens, *_LINK_TIERS[link])

        super().__init__(seconds)


class EmbeddedEngine:
    """Replays requests through the shared `RequestController` on a virtual clock; see the module
    docstring.

    `run(requests)` returns the per-request records; `cache` holds the tier statistics. The same
    inputs give the same records and statistics (nothing depends on wall time).
    """

    def __init__(
        self,
        config: EngineConfig,
        progress: Callable[..., None] | None = None,
        checkpoint: Callable[[EmbeddedEngine], None] | None = None,
        checkpoint_every: int = 0,
        store: TierStore | None = None,
    ) -> None:
        """`store`: a shared store tier (`tiers/store.py`) in the disk tier's place."""
        if store is not None and config.store_bandwidth <= 0:
            raise ValueError("a store tier needs EngineConfig.store_bandwidth > 0 (its link's cost)")
        if store is not None and config.byte_mode == "metadata":
            raise ValueError("a store tier moves real bytes: use byte_mode='real' with a store")
        self.config = config
        self._tmp = None
        self.now = 0.0
        # `oracle`: Belady eviction in every tier and perfect prefetch; it learns the future in `run`
        self.oracle: Oracle | None = (
            Oracle(config.page_size, lookahead=config.prefetch_window) if config.policy == "oracle" else None
        )
        priority = self.oracle.priority if self.oracle is not None else None
        clock = lambda: self.now  # noqa: E731
        if config.byte_mode == "metadata":
            from ..tiers.metadata import metadata_stores

            cache_config = config.cache_config(_METADATA_DISK_DIR)
            stores = metadata_stores(
                cache_config.layout,
                config.page_size,
                cache_config.device_pages,
                cache_config.host_pages,
                cache_config.disk_pages,
            )
            self.cache = build_cache(
                cache_config,
                device=stores["device"],
                host=stores.get("host"),
                lower=stores.get("disk"),
                clock=clock,
                priority=priority,
            )
        else:
            disk_dir = config.disk_dir
            if disk_dir is None and store is None and config.disk_tokens > 0 and config.policy != "recompute":
                self._tmp = tempfile.TemporaryDirectory(prefix="sgl-hicache-replay-", dir=_scratch_dir())
                disk_dir = Path(self._tmp.name)
            self.cache = build_cache(
                config.cache_config(disk_dir),
                lower=store if config.policy != "recompute" else None,
                clock=clock,
                priority=priority,
            )
        self.links = VirtualLinks(
            config.model, config.hardware, config.store_bandwidth if store is not None else 0.0, config.store_latency_s
        )
        self.executor = VirtualExecutor(self.cache, self.links, clock, config.page_size)
        # the oracle's prefetch is its predictor (the next requests' paths, before they arrive), not
        # the queue prefetch, which on long agentic prompts crowds the host tier (docs/results.md)
        self.controller = build_controller(
            self.cache,
            self.executor,
            config.tiering(),
            clock,
            predictor=self.oracle.predictor if self.oracle is not None else None,
        )
        self.progress = progress  # (done, total, hit_rate so far); total is None when unknown
        self.checkpoint = checkpoint  # called with the engine every `checkpoint_every` completions
        self.checkpoint_every = checkpoint_every
        self.records = RecordColumns()
        self.total: int | None = None
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self.demote_seconds = 0.0  # virtual seconds steps spent copying evicted pages device -> host
        self._inline_charged = {"device->host": 0, "host->disk": 0}
        self.steps = 0
        self._position: dict[int, int] = {}
        self._sessions: dict[str, Sequence[int]] = {}  # each session's latest prompt (hints name sessions)
        self._hints: list[tuple[float, int, Hint, Sequence[int]]] = []  # (due, seq, hint, prefix)
        self._hint_seq = itertools.count()
        self.hints_rejected = 0  # trace hints that could not run (unknown session, oversized pin)

    def _install_oracle(self, ordered: Sequence[Request]) -> None:
        """`oracle`: the requests to come, in arrival order."""
        self._position = {id(r): i for i, r in enumerate(ordered)}
        self.oracle.bind([r.input_ids for r in ordered], self.cache.tree)  # type: ignore[union-attr]

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def disk_write_seconds(self) -> float:
        """Virtual seconds the disk spent on host -> disk writes (background and inline)."""
        return self.links.seconds(
            "host->disk", self.cache.stats.bytes_moved["host->disk"] // self.config.storage_layout.bytes_per_token
        )

    # ---- copies the cache made inline (eviction demotions), not through the executor ----------
    def _inline_tokens(self, link: str) -> int:
        """Tokens copied on `link` inline since the last call (the executor's copies excluded)."""
        inline = self.cache.stats.bytes_moved[link] - self.executor.executed_bytes.get(link, 0)
        new = inline - self._inline_charged[link]
        self._inline_charged[link] = inline
        return max(0, new) // self.config.storage_layout.bytes_per_token

    def _charge_disk_writes(self) -> None:
        """Put the inline host -> disk writes made since the last call on the disk pipe, from now
        (background write-back is on the pipe already: the executor scheduled it)."""
        tokens = self._inline_tokens("host->disk")
        if tokens:
            self.links.schedule("host->disk", tokens, self.now, backup=True)

    # ---- request lifecycle -----------------------------------------------------------------
    def _arrive(self, req: Request, arrival: float, waiting: deque) -> None:
        if self.oracle is not None:
            self.oracle.arrived(self._position[id(req)])
        at_finish: list[tuple[Hint, Sequence[int]]] = []
        for hint in req.hints:  # resolved now (a session names its latest prompt before this one)
            try:
                tokens = hint_tokens(hint, self._sessions)
            except HintError:
                self.hints_rejected += 1
                continue
            if hint.at_finish:
                at_finish.append((hint, tokens))
            else:
                self._queue_hint(hint, tokens, arrival)
        if req.session is not None:
            self._sessions[req.session] = req.input_ids
        ticket, _ = self.controller.arrive(req.input_ids)
        self._apply_hints()  # after the request's own match and prediction: a hint adds what they left
        waiting.append(_Flight(req, arrival, ticket, finish_hints=at_finish))

    def _queue_hint(self, hint: Hint, tokens: Sequence[int], start: float) -> None:
        heapq.heappush(self._hints, (start + hint.after_s, next(self._hint_seq), hint, tokens))

    def _apply_hints(self) -> None:
        """Run the queued hints that are due, through the controller (`HintDesk`)."""
        while self._hints and self._hints[0][0] <= self.now:
            _, _, hint, tokens = heapq.heappop(self._hints)
            try:
                self.controller.hints.apply(hint, tokens)
            except HintError:
                self.hints_rejected += 1

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from any tier / prompt tokens, over the requests finished so far."""
        return self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0

    def _issue_prefetches(self, waiting: deque) -> None:
        """Start the disk -> host prefetch of the first `prefetch_window` waiting requests. Host ->
        device waits until the request is scheduled: device pages are the scarcest, and a queue of
        prefetched paths would crowd running requests out. The window paces prefetch under
        overload: pages fetched for a request far back in the queue would only push out pages
        needed sooner (and hold their locks for as long as it waits)."""
        window = min(self.config.prefetch_window, len(waiting))
        if not window or waiting[window - 1].prefetch_tried:
            # the flights tried are always a prefix of the queue (tried front to back; arrivals join
            # at the back; admission takes from the front): the window is done, O(1) per step
            return
        for i, flight in enumerate(waiting):
            if i >= window:
                break
            if not flight.prefetch_tried:
                flight.prefetch_tried = True
                self.controller.prefetch(flight.ticket, head=i == 0)

    def _try_admit(self, flight: _Flight) -> tuple[bool, int, tuple[float, float]]:
        """Admit `flight` into this step if it fits. Returns (admitted, new tokens, load seconds as
        (blocking, overlapped))."""
        cfg = self.config
        cache = self.cache
        ps = cfg.page_size
        tokens = flight.req.input_ids
        ticket = flight.ticket
        waited_s = 0.0
        if ticket.job is not None:
            pending = self.controller.pending_tokens(ticket)
            prefill_s = cost.prefill_seconds(cfg.model, cfg.hardware, pending, len(tokens) - pending)
            # waiting for a low-priority prefetch must not be slower than loading the rest on demand
            # (which `load` below does when the rest is dropped)
            demand_s = self.executor.demand_eta(ticket.job)
            decision, eta = self.controller.admit(ticket, min(prefill_s, demand_s))
            if decision is Admission.WAIT:  # wait for the rest inside this step
                self.executor.finish_all(ticket.job.ops())
                self.controller.admit(ticket, min(prefill_s, demand_s))
                waited_s = eta
                cache.stats.add("load_wait_seconds", eta)
        m = cache.match(tokens, count=False)  # re-matched each step: counted once, at arrival
        if m.disk_tokens:
            m = self.controller.read_or_recompute(
                m, cost.prefill_seconds(cfg.model, cfg.hardware, m.disk_tokens, m.device_tokens + m.host_tokens)
            )
        out_pages = math.ceil((flight.req.output_length + len(tokens) % ps) / ps)
        need_pages = len(tokens) // ps - m.device_tokens // ps
        # its own matched device pages are locked for it below: room comes from the free pages and
        # the *other* evictable ones (counting its own, a request that could not fit looked as if it
        # did, so no prefetch lock was ever given up for it and the queue stalled behind it)
        own = sum(n.num_pages for n in m.path if n.device is not None and n.lock_ref == 0 and n.pins == 0)
        flight.short_pages = (
            need_pages + out_pages - cache.stores[DEVICE].free_pages - (self._evictable_device_pages() - own)
        )
        if flight.short_pages > 0:
            return False, 0, (0.0, 0.0)
        self.controller.admitted(ticket)
        flight.hits = self.controller.account(ticket, len(tokens), m)
        if self.oracle is not None:
            self.oracle.admitted(self._position[id(flight.req)])
        self.controller.release(ticket)
        lower = m.lower_tier_tokens
        m, load = self.controller.load(
            tokens, m, cost.prefill_seconds(cfg.model, cfg.hardware, lower, m.device_tokens) if lower else 0.0
        )
        load_s = (max(load.blocking, waited_s), load.overlapped)
        cache.lock(m.last_node)
        fresh = cache.allocate_device(len(tokens) // ps - len(m.device_handles))
        outs = cache.allocate_device(out_pages) if fresh is not None else None
        if fresh is None or outs is None:
            if fresh is not None:
                cache.free_device(fresh)
            cache.unlock(m.last_node)
            return False, 0, (0.0, 0.0)
        result = cache.insert(tokens, m.device_handles + fresh)
        cache.free_device(result.duplicates)
        cache.unlock(m.last_node)
        cache.lock(result.last_node)
        flight.anchor = result.last_node
        flight.output_pages = outs
        flight.context = len(tokens)
        flight.remaining = max(0, flight.req.output_length - 1)
        return True, len(tokens) - m.device_tokens, load_s

    def _evictable_device_pages(self) -> int:
        return self.cache.tree.evictable_pages(DEVICE)

    def _finish(self, flight: _Flight) -> None:
        self.cache.free_device(flight.output_pages)
        self.cache.unlock(flight.anchor)  # type: ignore[arg-type]
        # what the call ended in (a tool call, an answer) is what the server sees in its output
        self.controller.finished(flight.anchor.path_from_root(), flight.req.ends_in)  # type: ignore[union-attr]
        for hint, tokens in flight.finish_hints:  # run from the next loop turn, as the server's at its release
            self._queue_hint(hint, tokens, self.now)
        hd, hh, hk = flight.hits
        prompt = len(flight.req.input_ids)
        self.records.add(
            flight.arrival,
            (flight.first_token or 0) - flight.arrival,
            self.now,
            prompt,
            flight.req.output_length,
            hd,
            hh,
            hk,
            flight.req.preceded_by,
        )
        self._prompt_tokens += prompt
        self._hit_tokens += hd + hh + hk
        done = len(self.records)
        if self.progress:
            self.progress(done, self.total, self.hit_rate)
        if self.checkpoint is not None and self.checkpoint_every and done % self.checkpoint_every == 0:
            self.checkpoint(self)

    # ---- the loop --------------------------------------------------------------------------
    def run(self, requests: Iterable[Request], total: int | None = None) -> RecordColumns:
        """Replay `requests`: a sequence (sorted by arrival here) or, streaming, an iterator already
        in arrival order, read one request ahead of its arrival, so that only the requests in
        flight hold token ids. `total` (the count, when the iterator knows it) feeds the progress."""
        self.begin(requests, total)
        while self.step():
            pass
        return self.end()

    def begin(self, requests: Iterable[Request], total: int | None = None) -> None:
        """Queue a replay's requests (as `run`); then `step()` until it returns False, then `end()`.
        (`run` does all three; a fleet of engines steps several on one virtual timeline, `engine/fleet.py`.)"""
        if isinstance(requests, Sequence) or self.config.policy == "oracle":
            # the oracle knows the future: it needs the whole trace (a stream is read into memory)
            ordered = sorted(requests, key=lambda r: r.arrival_s)
            self.total = len(ordered)
            self._pending = _Pending(iter(ordered))
            if self.config.policy == "oracle":
                self._install_oracle(ordered)
        else:
            self.total = total
            self._pending = _Pending(iter(requests))
        self._waiting: deque[_Flight] = deque()
        self._prefilling: list[_Flight] = []  # admitted, prompt not fully computed yet (chunked prefill)
        self._running: list[_Flight] = []  # decoding
        if self.config.rewarm and self.config.disk_dir is not None and self.config.byte_mode == "real":
            self.controller.rewarm = start_rewarm(self.cache, self.executor)

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._waiting or self._prefilling or self._running)

    def end(self) -> RecordColumns:
        self.controller.shutdown()
        if self.config.rewarm and self.config.disk_dir is not None and self.config.byte_mode == "real":
            save_rewarm(self.cache)  # a clean stop: what the next engine on this directory re-warms
        return self.records

    def step(self) -> bool:
        """One scheduler iteration (a forward step, or a jump of the clock to the next event).
        Returns False when the replay is over."""
        cfg = self.config
        pending, waiting, prefilling = self._pending, self._waiting, self._prefilling
        running = self._running
        closed_loop = cfg.concurrency is not None
        if not self.busy:
            return False
        # arrivals
        if closed_loop:
            while pending and len(waiting) + len(prefilling) + len(running) < cfg.concurrency:  # type: ignore[operator]
                self._arrive(pending.popleft(), self.now, waiting)
        else:
            while pending and pending.head().arrival_s * cfg.time_scale <= self.now:
                req = pending.popleft()
                self._arrive(req, req.arrival_s * cfg.time_scale, waiting)
        self._apply_hints()
        if cfg.policy in ("prefetch", "predict"):
            self._issue_prefetches(waiting)
        self.controller.advance_predictions()
        self.controller.pump_writeback()
        # the step's prefill budget goes to prompts already being prefilled first, then to new ones
        budget = cfg.max_batch_tokens
        chunks: list[tuple[_Flight, int]] = []
        for flight in prefilling:
            if budget <= 0:
                break
            n = min(flight.prefill_left, budget)
            chunks.append((flight, n))
            budget -= n
        blocking_s = overlapped_s = 0.0
        self._inline_tokens("device->host")  # what came before this step was charged already
        for flight in list(waiting):
            if len(running) + len(prefilling) >= cfg.max_running or budget <= 0:
                break
            ok, new_tokens, load = self._try_admit(flight)
            if not ok:
                # demand preempts prefetch: the queued requests' prefetch jobs lock their paths' device
                # pages, which would otherwise stall the head of the queue until they are admitted; only
                # the jobs holding the pages it lacks end (the controller decides which)
                others = [f.ticket for f in waiting if f is not flight and f.ticket.job is not None]
                if others and self.controller.yield_to_demand(others, flight.short_pages):
                    ok, new_tokens, load = self._try_admit(flight)
            if ok:
                waiting.remove(flight)
                prefilling.append(flight)
                flight.prefill_left = new_tokens
                n = min(new_tokens, budget)
                chunks.append((flight, n))
                budget -= n
                blocking_s = max(blocking_s, load[0])
                overlapped_s += load[1]
            else:
                break  # FIFO: a request that does not fit blocks the ones behind it
        if not chunks and not running:
            nxt = self._next_event_time(pending)
            if nxt is None and waiting and self._drop_prefetch_locks(waiting):
                return True  # prefetched paths held the pages the head of the queue needs
            if nxt is None:
                if waiting:
                    raise RuntimeError(
                        f"{len(waiting)} requests cannot be admitted: the device tier ({cfg.device_tokens} tokens) is too small for them"
                    )
                return False
            self.now = max(self.now, nxt)
            return True
        compute = cost.batch_prefill_seconds(
            cfg.model, cfg.hardware, [(n, f.context - f.prefill_left) for f, n in chunks]
        )
        compute += cost.decode_step_seconds(cfg.model, cfg.hardware, sum(map(_context, running)), len(running))
        # evictions that made room for this step and copied device -> host inline (pages the
        # background write-back had not cleaned yet) delay the forward pass
        demoted_tokens = self._inline_tokens("device->host")
        demote_s = self.links.seconds("device->host", demoted_tokens) if demoted_tokens else 0.0
        self.demote_seconds += demote_s
        step = demote_s + blocking_s + max(compute, overlapped_s) + overlapped_s / cfg.model.num_layers
        self._charge_disk_writes()
        self.now += step
        self.steps += 1
        still: list[_Flight] = []
        for flight in running:
            flight.remaining -= 1
            flight.context += 1
            if flight.remaining <= 0:
                self._finish(flight)
            else:
                still.append(flight)
        for flight, n in chunks:
            flight.prefill_left -= n
            if flight.prefill_left > 0:
                continue
            prefilling.remove(flight)
            flight.first_token = self.now
            # write-through at commit, as the server's checkpoint does once a prompt's KV is
            # computed: its host copies start now (`RequestController.commit`, the one commit path)
            self.controller.commit(flight.anchor.path_from_root())  # type: ignore[union-attr]
            if flight.remaining <= 0:
                self._finish(flight)
            else:
                still.append(flight)
        self._running = still
        return True

    def _drop_prefetch_locks(self, waiting: deque) -> bool:
        """Finish and release the prefetch jobs of waiting requests (their pages stay cached,
        unlocked). Returns whether there was any to release."""
        released = False
        for flight in waiting:
            job = flight.ticket.job
            if job is not None:
                self.executor.finish_all(job.ops())
                self.controller.poll(flight.ticket)
                self.controller.release(flight.ticket)
                released = True
        return released

    def _next_event_time(self, pending: _Pending) -> float | None:
        times = [self._hints[0][0]] if self._hints else []
        if pending and self.config.concurrency is None:
            times.append(pending.head().arrival_s * self.config.time_scale)
        nxt = self.executor.next_event()
        if nxt is not None:
            times.append(max(nxt, self.now))
        return min(times) if times else None


class _Pending:
    """The requests not yet arrived: an iterator read one ahead (the next arrival must be known).
    An iterator out of arrival order is refused: a replay's clock only goes forward."""

    def __init__(self, it: Iterator[Request]) -> None:
        self._it = it
        self._head: Request | None = next(it, None)
        self._last = -math.inf

    def __bool__(self) -> bool:
        return self._head is not None

    def head(self) -> Request:
        assert self._head is not None
        return self._head

    def popleft(self) -> Request:
        req = self._head
        assert req is not None
        if req.arrival_s < self._last:
            raise ValueError(
                f"request {req.request_id} arrives at {req.arrival_s} s, before the one read before it "
                f"({self._last} s): a streamed trace must be in arrival order"
            )
        self._last = req.arrival_s
        self._head = next(self._it, None)
        return req
