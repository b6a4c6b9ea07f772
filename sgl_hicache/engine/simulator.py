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

import math
import os
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import MatchResult, PromotionJob, TieredCache
from ..config import CacheConfig, KVLayout
from ..policy.predictor import make_predictor
from ..replay.trace import Request
from ..tiers.base import DEVICE, DISK, HOST
from . import cost
from .report import RequestRecord
from .presets import HardwarePreset, ModelPreset

POLICIES = ("recompute", "demote", "prefetch", "predict")
_LINK_TIERS = {"disk->host": (DISK, HOST), "host->device": (HOST, DEVICE), "device->host": (DEVICE, HOST), "host->disk": (HOST, DISK)}


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
    eviction_policy: str = "lru"
    write_policy: str = "write_back"
    predictor_budget_tokens: int = 8192
    prefetch_window: int = 16
    storage_layout: KVLayout = field(default_factory=lambda: KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16"))

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.max_batch_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")

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
            predictor="tree_walk" if self.policy == "predict" else "none",
        )


@dataclass(eq=False)
class _Flight:
    req: Request
    arrival: float
    enqueue_lower_tokens: int = 0
    job: PromotionJob | None = None
    stage_finish: list[float] = field(default_factory=list)
    first_token: float | None = None
    remaining: int = 0
    context: int = 0
    anchor: object = None
    output_pages: list = field(default_factory=list)
    prefill_left: int = 0
    prefetch_tried: bool = False
    hits: tuple[int, int, int] = (0, 0, 0)


def _scratch_dir() -> str | None:
    """Where a replay's throw-away disk tier goes: RAM-backed /dev/shm when there is one, so that a
    replay measures the cache rather than this machine's file-creation rate (its time is virtual
    anyway); `EngineConfig.disk_dir` puts the tier on a real disk instead."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class VirtualLinks:
    """Each tier link is a FIFO pipe at the hardware preset's bandwidth, in virtual time; disk reads
    (disk->host) and writes (host->disk) share one pipe, the disk."""

    _PIPES = {"disk->host": "disk", "host->disk": "disk"}

    def __init__(self, model: ModelPreset, hw: HardwarePreset) -> None:
        self.model = model
        self.hw = hw
        self.busy_until: dict[str, float] = {}

    def seconds(self, link: str, tokens: int) -> float:
        src, dst = _LINK_TIERS[link]
        return cost.kv_transfer_seconds(self.model, self.hw, tokens, src, dst)

    def schedule(self, link: str, tokens: int, earliest: float) -> float:
        pipe = self._PIPES.get(link, link)
        start = max(earliest, self.busy_until.get(pipe, 0.0))
        finish = start + self.seconds(link, tokens)
        self.busy_until[pipe] = finish
        return finish


class EmbeddedEngine:
    """Replays requests through a `TieredCache` on a virtual clock; see the module docstring.

    `run(requests)` returns the per-request records; `cache` holds the tier statistics. The same
    inputs give the same records and statistics (nothing depends on wall time).
    """

    def __init__(self, config: EngineConfig, progress: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        self._tmp = None
        disk_dir = config.disk_dir
        if disk_dir is None and config.disk_tokens > 0 and config.policy != "recompute":
            self._tmp = tempfile.TemporaryDirectory(prefix="sgl-hicache-replay-", dir=_scratch_dir())
            disk_dir = Path(self._tmp.name)
        self.now = 0.0
        self.cache = TieredCache(config.cache_config(disk_dir), clock=lambda: self.now)
        self.links = VirtualLinks(config.model, config.hardware)
        self.predictor = make_predictor(self.cache.config.predictor, config.page_size, config.predictor_budget_tokens)
        self.predicted_jobs: list[tuple[PromotionJob, list[float]]] = []
        self.progress = progress
        self.records: list[RequestRecord] = []
        self.demote_seconds = 0.0  # virtual seconds steps spent copying evicted pages device -> host
        self.disk_write_seconds = 0.0  # virtual seconds the disk spent on host -> disk writes
        self._disk_bytes_charged = 0
        self.steps = 0

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ---- transfers on the virtual clock ----------------------------------------------------
    def _schedule_job(self, job: PromotionJob, start: float) -> list[float]:
        """Virtual finish time of each stage: its ops go through their links in order."""
        finishes: list[float] = []
        for st in job.stages:
            t = start
            for op in st.ops:
                t = self.links.schedule(op.link, op.node.num_pages * self.config.page_size, t)
            if st.waits_for is not None:
                t = start
            finishes.append(max(t, finishes[-1] if finishes else t))
        return finishes

    def _run_due(self, job: PromotionJob, finishes: Sequence[float], upto: float) -> None:
        """Really copy the bytes of every stage due by `upto`, then let the cache apply them."""
        for st, fin in zip(job.stages, finishes):
            if fin > upto:
                break
            for op in st.ops:
                if not op.executed.is_set():
                    self.cache.execute(op)
        self.cache.advance(job)

    def _charge_disk_writes(self) -> None:
        """Put the host -> disk writes made since the last call on the disk pipe, from now."""
        written = self.cache.stats.bytes_moved["host->disk"] - self._disk_bytes_charged
        if written <= 0:
            return
        self._disk_bytes_charged += written
        tokens = written // self.config.storage_layout.bytes_per_token
        self.links.schedule("host->disk", tokens, self.now)
        self.disk_write_seconds += self.links.seconds("host->disk", tokens)

    # ---- request lifecycle -----------------------------------------------------------------
    def _arrive(self, flight: _Flight, waiting: deque) -> None:
        m = self.cache.match(flight.req.input_ids)
        flight.enqueue_lower_tokens = m.lower_tier_tokens
        if self.config.policy == "predict":
            self._predict(m)
        waiting.append(flight)

    def _issue_prefetches(self, waiting: deque) -> None:
        """Start the disk -> host prefetch of the first `prefetch_window` waiting requests. Host ->
        device waits until the request is scheduled: device pages are the scarcest, and a queue of
        prefetched paths would crowd running requests out. The window paces prefetch under
        overload: pages fetched for a request far back in the queue would only push out pages
        needed sooner (and hold their locks for as long as it waits)."""
        for i, flight in enumerate(waiting):
            if i >= self.config.prefetch_window:
                break
            if flight.prefetch_tried:
                continue
            flight.prefetch_tried = True
            m = self.cache.match(flight.req.input_ids, touch=False)
            if not m.disk_tokens:
                continue
            job = self.cache.plan_promotion(m, "prefetch", target=HOST)
            if job is not None:
                flight.job = job
                flight.stage_finish = self._schedule_job(job, self.now)

    def _predict(self, m: MatchResult) -> None:
        for pred in self.predictor.predict(m.last_node, self.now):
            node = pred.node
            if node.parent is None:
                continue
            target = DEVICE if self.cache.stores[DEVICE].free_pages >= node.num_pages else HOST
            if target == HOST and (node.host is not None or not self.cache.has_tier(HOST)):
                continue
            job = self.cache.plan_promotion(node.path_from_root(), kind="predict", target=target, evict=False)
            if job is not None:
                # speculative copies use the links' idle time only: they do not delay demand transfers
                saved = dict(self.links.busy_until)
                finishes = self._schedule_job(job, self.now)
                self.links.busy_until = saved
                self.predicted_jobs.append((job, finishes))

    def _advance_predictions(self) -> None:
        keep = []
        for job, finishes in self.predicted_jobs:
            self._run_due(job, finishes, self.now)
            if job.finished:
                self.cache.release(job)
            else:
                keep.append((job, finishes))
        self.predicted_jobs = keep

    def _try_admit(self, flight: _Flight) -> tuple[bool, int, tuple[float, float]]:
        """Admit `flight` into this step if it fits. Returns (admitted, new tokens, load seconds as
        (blocking, overlapped))."""
        cfg = self.config
        cache = self.cache
        ps = cfg.page_size
        tokens = flight.req.input_ids
        job = flight.job
        prefetched = {HOST: 0, DISK: 0}
        waited_s = 0.0
        if job is not None:
            self._run_due(job, flight.stage_finish, self.now)
            if not job.finished:
                # the part still in flight: wait for it inside this step, or recompute it, whichever
                # the estimate says is faster
                pending = [(st, fin) for st, fin in zip(job.stages[job.applied :], flight.stage_finish[job.applied :])]
                wait_s = max(fin for _, fin in pending) - self.now
                pending_tokens = sum(st.node.num_pages for st, _ in pending) * ps
                recompute_s = cost.prefill_seconds(cfg.model, cfg.hardware, pending_tokens, len(tokens) - pending_tokens)
                if wait_s <= recompute_s:
                    self._run_due(job, flight.stage_finish, math.inf)
                    waited_s = wait_s
                    cache.stats.add("loads_waited")
                    cache.stats.add("load_wait_seconds", wait_s)
                else:
                    cache.cancel(job)
                    cache.stats.add("loads_recomputed")
            for st in job.stages[: job.applied]:
                if st.ops and st.ops[0].src == DISK and st.node.device is None:
                    prefetched[DISK] += st.node.num_pages * ps
        m = cache.match(tokens)
        out_pages = math.ceil((flight.req.output_length + len(tokens) % ps) / ps)
        need_pages = len(tokens) // ps - m.device_tokens // ps
        if need_pages + out_pages > cache.stores[DEVICE].free_pages + self._evictable_device_pages(m):
            return False, 0, (0.0, 0.0)
        # count the hits, attributing what this request's own prefetch brought up to where it came from
        from_prefetch = min(prefetched[DISK], m.host_tokens)
        counted = MatchResult(m.path, m.device_tokens, m.host_tokens - from_prefetch, m.disk_tokens + from_prefetch,
                              m.device_handles, m.last_node, m.last_device_node)
        cache.record_request(len(tokens), counted, covered_by_prefetch=from_prefetch)
        if job is not None:
            cache.release(job)
            flight.job = None
        load_s = (waited_s, 0.0)
        if m.lower_tier_tokens:
            load_job = cache.plan_promotion(m, "demand")
            if load_job is not None:
                load_s = self._load_seconds(load_job)
                load_s = (max(load_s[0], waited_s), load_s[1])
                for st in load_job.stages:
                    for op in st.ops:
                        cache.execute(op)
                cache.advance(load_job)
                cache.release(load_job)
            m = cache.match(tokens)
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
        flight.hits = (counted.device_tokens, counted.host_tokens, counted.disk_tokens)
        return True, len(tokens) - m.device_tokens, load_s

    def _load_seconds(self, job: PromotionJob) -> tuple[float, float]:
        """(blocking, overlapped) seconds of a load at schedule time: disk reads must land in host
        before the forward pass can use them (they block the step); host->device copies overlap
        the forward pass layer by layer."""
        blocking = 0.0
        overlapped = 0.0
        for st in job.stages:
            for op in st.ops:
                tokens = op.node.num_pages * self.config.page_size
                if op.src == DISK:
                    blocking = max(blocking, self.links.schedule(op.link, tokens, self.now) - self.now)
                else:
                    overlapped += self.links.seconds(op.link, tokens)
        return blocking, overlapped

    def _evictable_device_pages(self, m: MatchResult) -> int:
        tree = self.cache.tree
        return sum(n.num_pages for n in tree.resident[DEVICE] if n.lock_ref == 0 and n.pins == 0)

    def _finish(self, flight: _Flight) -> None:
        self.cache.free_device(flight.output_pages)
        self.cache.unlock(flight.anchor)  # type: ignore[arg-type]
        hd, hh, hk = flight.hits
        self.records.append(RequestRecord(flight.req.request_id, flight.arrival, (flight.first_token or 0) - flight.arrival, self.now,
                                          len(flight.req.input_ids), flight.req.output_length, hd, hh, hk))
        if self.progress:
            self.progress(len(self.records), self._total)

    # ---- the loop --------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[RequestRecord]:
        cfg = self.config
        self._total = len(requests)
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        waiting: deque[_Flight] = deque()
        prefilling: list[_Flight] = []  # admitted, prompt not fully computed yet (chunked prefill)
        running: list[_Flight] = []  # decoding
        closed_loop = cfg.concurrency is not None
        while pending or waiting or prefilling or running:
            # arrivals
            if closed_loop:
                while pending and len(waiting) + len(prefilling) + len(running) < cfg.concurrency:  # type: ignore[operator]
                    self._arrive(_Flight(pending.popleft(), self.now), waiting)
            else:
                while pending and pending[0].arrival_s * cfg.time_scale <= self.now:
                    req = pending.popleft()
                    self._arrive(_Flight(req, req.arrival_s * cfg.time_scale), waiting)
            if cfg.policy in ("prefetch", "predict"):
                self._issue_prefetches(waiting)
            self._advance_predictions()
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
            demoted_before = self.cache.stats.bytes_moved["device->host"]
            for flight in list(waiting):
                if len(running) + len(prefilling) >= cfg.max_running or budget <= 0:
                    break
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
                nxt = self._next_event_time(pending, waiting)
                if nxt is None and waiting and self._drop_prefetch_locks(waiting):
                    continue  # prefetched paths held the pages the head of the queue needs
                if nxt is None:
                    if waiting:
                        raise RuntimeError(f"{len(waiting)} requests cannot be admitted: the device tier ({cfg.device_tokens} tokens) is too small for them")
                    break
                self.now = max(self.now, nxt)
                continue
            compute = cost.batch_prefill_seconds(cfg.model, cfg.hardware, [(n, f.context - f.prefill_left) for f, n in chunks])
            compute += cost.decode_step_seconds(cfg.model, cfg.hardware, sum(f.context for f in running), len(running))
            # demotions made room for this step: their device -> host copies run in the scheduler
            # before the forward pass can use the freed pages (host -> disk write-back is background)
            demoted_tokens = (self.cache.stats.bytes_moved["device->host"] - demoted_before) // cfg.storage_layout.bytes_per_token
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
                if flight.remaining <= 0:
                    self._finish(flight)
                else:
                    still.append(flight)
            running = still
        for job, _ in self.predicted_jobs:
            self.cache.release(job)
        self.predicted_jobs = []
        return self.records

    def _drop_prefetch_locks(self, waiting: deque) -> bool:
        """Release the prefetch jobs of waiting requests (their pages stay cached, unlocked).
        Returns whether there was any to release."""
        released = False
        for flight in waiting:
            if flight.job is not None:
                self._run_due(flight.job, flight.stage_finish, math.inf)
                self.cache.release(flight.job)
                flight.job = None
                released = True
        return released

    def _next_event_time(self, pending: deque, waiting: deque) -> float | None:
        times = []
        if pending and self.config.concurrency is None:
            times.append(pending[0].arrival_s * self.config.time_scale)
        for flight in waiting:
            if flight.job is not None and not flight.job.finished:
                times.extend(t for t in flight.stage_finish if t > self.now)
        for _, finishes in self.predicted_jobs:
            times.extend(t for t in finishes if t > self.now)
        return min(times) if times else None
