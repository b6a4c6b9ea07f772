"""Layer-wise host -> device loads for the SGLang backend: `init_load_back` only queues the copies, and
the forward of layer i waits for layer i alone.

`LayerLoads` is two things at once:
- the sink of the `ThreadExecutor`'s demand loads (`queue(ops)`, on the scheduler thread): one
  `transfer.layerwise.LayerwiseLoader` per call moves all the ops' pages layer by layer (a worker
  thread on a CPU; the host -> device stream with one event per layer on a GPU, ordered after the
  work already queued on the forward stream). The ops are marked executed at once, so the tree
  records the device copies now (SGLang needs the device indices at admission); their nodes stay
  locked (no eviction frees the destination or reuses the source pages; a lock, unlike a pin, lets
  a later match split the node) until `reap` sees the loader done;
- SGLang's layer transfer counter (the object SGLang's KV pool calls before reading a layer:
  `wait_until(layer)`, `consumer_index`, `num_layers`, `set_consumer(i)`; registered with
  `kvcache.register_layer_transfer_counter` and `tp_worker.register_hicache_layer_transfer_counter`).
  `batch_index()` names the batch whose admissions queued loads (what the scheduler stores in
  `batch.hicache_consumer_index`, -1 when none); `wait_until(layer)` waits for layer `layer` of every
  load queued up to the consumer's batch (every pending load with consumer -1: a decode batch never
  reads a slot before it has arrived, whatever the order the scheduler ran batches in). With nothing
  pending it returns at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..tiers.base import DEVICE, HOST
from ..transfer.layerwise import LayerwiseLoader
from ..transfer.torch_threads import single_threaded_torch

if TYPE_CHECKING:
    from ..cache import TieredCache
    from ..transfer.ops import TransferOp
    from ..tree.node import TreeNode


@dataclass(eq=False)
class _Group:
    batch: int
    loader: LayerwiseLoader
    nodes: list[TreeNode]


class LayerLoads:
    """Queued layer-wise loads and SGLang's layer transfer counter over them (module docstring).
    `queue`, `batch_index`, `reap` and `finish_all` run on the scheduler thread; `wait_until` on the
    thread that runs the forward."""

    def __init__(self, cache: TieredCache, forward_stream: Any = None, agreed: bool = False) -> None:
        self.cache = cache
        # TP >= 2: a load finishes at a thread-timed moment on each rank, so its nodes unlock only
        # when every rank reports it done (`done_prefix` into the step's all-reduce, then `reap_agreed`):
        # the ranks' evictable sets stay equal
        self.agreed = agreed
        self.forward_stream = forward_stream  # CUDA: the copies start after the work queued on it
        self.device = cache.stores[DEVICE]
        self.host = cache.stores[HOST]
        self.num_layers = self.device.layout.num_layers
        self.consumer_index = -1
        self._pending: list[_Group] = []  # replaced, never mutated: the forward thread reads it unlocked
        self._batch = 0
        self._queued = False  # loads queued since the last batch_index()
        self._lock = threading.Lock()
        # CPU: one long-lived worker runs the loads in queue order (starting a thread per load would
        # make the scheduler wait for its start); CUDA loads go on the link's stream instead
        self._runner = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sgl-hicache-layers", initializer=single_threaded_torch
        )
        self.loads = 0
        self.pages = 0

    # ---- producer side (scheduler thread) ---------------------------------------------------
    def queue(self, ops: Sequence[TransferOp]) -> None:
        """Start moving the host -> device ops' pages layer by layer and mark them executed."""
        ops = [op for op in ops if not op.executed.is_set()]
        if not ops:
            return
        for op in ops:
            if (op.src, op.dst) != (HOST, DEVICE):
                raise ValueError(f"LayerLoads.queue: only host->device ops, got {op.src}->{op.dst}")
        dev = [h for op in ops for h in op.dst_handles]
        host = [h for op in ops for h in op.src_handles]
        loader = LayerwiseLoader(self.device, self.host, dev, host, to_device=True, runner=self._runner)
        if loader.cuda and self.forward_stream is not None:
            # the destination slots may have been freed by a forward still running on SGLang's
            # forward stream: the H2D stream waits for it (start() waits for the current stream)
            with torch.cuda.stream(self.forward_stream):
                loader.start()
        else:
            loader.start()
        nodes = [op.node for op in ops]
        for node in nodes:  # released by reap() once every layer has arrived
            self.cache.tree.lock(node)
        for op in ops:
            op.executed.set()  # the bytes are ordered before every read by wait_until
        with self._lock:
            self._pending = self._pending + [_Group(self._batch, loader, nodes)]
        self._queued = True
        self.loads += 1
        self.pages += len(dev)

    def batch_index(self) -> int:
        """The index of the batch being formed if its admissions queued loads, else -1; the next
        batch gets a new index."""
        if not self._queued:
            return -1
        self._queued = False
        index = self._batch
        self._batch += 1
        return index

    def reap(self) -> bool:
        """Unlock the nodes of finished loads (never blocks). True while loads remain in flight.
        With `agreed`, nothing: only `reap_agreed` unlocks."""
        pending = self._pending
        if not pending:
            return False
        if self.agreed:
            return True
        self._unlock([g for g in pending if g.loader.done()])
        return bool(self._pending)

    def done_prefix(self) -> int:
        """How many of the loads, in queue order, have finished here (the fact the ranks agree on)."""
        n = 0
        for g in self._pending:
            if not g.loader.done():
                break
            n += 1
        return n

    def reap_agreed(self, count: int) -> None:
        """Unlock the first `count` loads: every rank reported them done (`count` <= `done_prefix()`)."""
        pending = self._pending
        if count > len(pending) or not all(g.loader.done() for g in pending[:count]):
            raise RuntimeError(
                f"reap_agreed({count}): only {self.done_prefix()} of {len(pending)} loads are done on this rank"
            )
        self._unlock(pending[:count])

    def _unlock(self, groups: list[_Group]) -> None:
        if not groups:
            return
        with self._lock:
            self._pending = [g for g in self._pending if g not in groups]
        for g in groups:
            for node in g.nodes:
                self.cache.tree.unlock(node)

    def synchronize(self) -> None:
        """Wait until every queued load's bytes have arrived (unlocking is `reap`'s)."""
        for g in self._pending:
            g.loader.synchronize()

    def finish_all(self) -> None:
        """Wait for every queued load and unlock it (flush, shutdown: points every rank reaches alike;
        not the serving path)."""
        self.synchronize()
        self._unlock(list(self._pending))

    @property
    def inflight(self) -> bool:
        return bool(self._pending)

    @property
    def queued(self) -> int:
        """Loads whose nodes are still locked (running, or finished and not reaped)."""
        return len(self._pending)

    # ---- SGLang's layer transfer counter (forward thread) --------------------------------------
    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        pending = self._pending
        if not pending:
            return
        limit = self.consumer_index
        for g in pending:
            if limit < 0 or g.batch <= limit:
                g.loader.wait_layer(layer)

    def reset(self) -> None:
        self.consumer_index = -1

    def snapshot(self) -> dict[str, Any]:
        return {"loads": self.loads, "pages": self.pages, "in_flight": len(self._pending)}


class MappedLayerCounter:
    """SGLang's layer transfer counter for a KV pool whose layers are not the tiered page's layers
    one for one (a draft model's pool, a hybrid model's attention layers): `page_layer(layer)` maps
    the pool's layer id onto the page's layer, None for a layer that reads no tiered page (it waits
    for nothing); everything else is the one `LayerLoads` counter's."""

    def __init__(self, loads: LayerLoads) -> None:
        self.loads = loads

    def page_layer(self, layer: int) -> int | None:
        raise NotImplementedError

    @property
    def consumer_index(self) -> int:
        return self.loads.consumer_index

    def set_consumer(self, index: int) -> None:
        self.loads.set_consumer(index)

    def wait_until(self, layer: int) -> None:
        index = self.page_layer(layer)
        if index is not None:
            self.loads.wait_until(index)

    def reset(self) -> None:
        pass


__all__ = ["LayerLoads", "MappedLayerCounter"]
