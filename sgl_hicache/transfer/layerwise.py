"""Layer-by-layer moves between the device pool and the host buffer, so that a model's layer i can run
as soon as layer i's KV has arrived while layer i+1's is still on the link.

Contract (checked on CPU by `tests/test_layerwise.py`, on CUDA by `benchmarks/gpu_check.py`):

- `LayerwiseLoader(device, host, device_handles, host_handles, to_device=True)` plans the move of
  page `host_handles[j]` of a `HostKVBuffer` to page `device_handles[j]` of a device pool with
  per-layer page views, `layer_pages(layer, kv)` (`DeviceKVPool`, or SGLang's pool through
  `sglang.device_pool.SGLangDevicePool`), the reverse with `to_device=False`, one layer at a time. Nothing moves before `start()`; a loader is
  started once. The bytes to move must be in place when `start()` is called.
- CUDA: `start()` orders the copies after all work already queued on the caller's current stream,
  then queues the first `ahead` layers (all when `ahead` is None) on the link's stream (one stream
  per device and direction, `link_stream`), recording one event per layer.
  `wait_layer(i)` queues the layers up to `i + ahead` not queued yet and makes the caller's current
  stream wait for layer i's event only; it does not block the host. Work queued on that stream
  afterwards sees layer i at its destination; later layers may still be moving.
- CPU (a pool on the CPU: no streams, no events): `start()` starts one worker thread (or submits the
  work to `runner`, a `concurrent.futures.Executor`) that copies the layers in order and counts them; `wait_layer(i)` blocks until layer i is copied. `ahead` is ignored.
- `done()` says, without blocking, whether every layer has arrived.
- `synchronize()` queues what is left and blocks the host until every copy is done (device->host
  bytes are readable after it). A copy that failed on the CPU worker is raised by `wait_layer` and
  `synchronize`.
- Layers are copied in order 0..L-1 on one stream (one thread), so layer i done implies 0..i-1 done.

Each layer is one contiguous copy per page and K/V: the host's `(page, layer, K/V)` run to the device's
`(layer, K/V, page)` run, page-first to layer-first with no temporary and no kernel, hence bit-exact.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future

import torch

from ..tiers.base import Handle
from .torch_threads import single_threaded_torch

_LINK_STREAMS: dict[tuple[torch.device, bool], "torch.cuda.Stream"] = {}


def link_stream(device: torch.device, to_device: bool) -> "torch.cuda.Stream":
    """The stream of one link (host->device or device->host) of a CUDA device, created once."""
    key = (torch.device(device), to_device)
    if key not in _LINK_STREAMS:
        _LINK_STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _LINK_STREAMS[key]


class LayerwiseLoader:
    """Moves pages between a `DeviceKVPool` and a `HostKVBuffer` layer by layer (module docstring)."""

    def __init__(self, device, host, device_handles: Sequence[Handle], host_handles: Sequence[Handle], *,
                 to_device: bool = True, stream: "torch.cuda.Stream | None" = None, ahead: int | None = None,
                 runner: "Executor | None" = None) -> None:
        if len(device_handles) != len(host_handles):
            raise ValueError(f"LayerwiseLoader: {len(device_handles)} device handles for {len(host_handles)} host handles")
        if ahead is not None and ahead < 1:
            raise ValueError(f"LayerwiseLoader: ahead must be >= 1 or None, got {ahead}")
        self.layers = device.layout.num_layers
        self.planes = device.layout.kv_planes
        self.to_device = to_device
        self.ahead = self.layers if ahead is None else ahead
        self.device = device.device
        self.cuda = self.device.type == "cuda"
        self._dev_pages = device.layer_pages  # (layer, K/V) -> (pages, page tokens, heads, dim), no copy
        self._host = host.buffer  # (pages, layers, K/V, page tokens, heads, dim)
        dev_h, host_h = [int(h) for h in device_handles], [int(h) for h in host_handles]  # type: ignore[call-overload]
        # the pages the tensors hold (SGLang's pool has more page slots than the cache may own)
        for name, handles, pages in (("device", dev_h, int(device.layer_pages(0, 0).shape[0])), ("host", host_h, int(host.buffer.shape[0]))):
            bad = [h for h in handles if not 0 <= h < pages]
            if bad:
                raise ValueError(f"LayerwiseLoader: {name} handle {bad[0]} not in [0, {pages})")
        # per layer, views over the handles' spans only (one unbind call each, not one getitem per page)
        self._d0, self._h0 = min(dev_h, default=0), min(host_h, default=0)
        self._d1, self._h1 = max(dev_h, default=-1) + 1, max(host_h, default=-1) + 1
        self._pairs = [(d - self._d0, h - self._h0) for d, h in zip(dev_h, host_h)]
        self._started = False
        self._issued = 0
        self._events: list[torch.cuda.Event] = []
        self.stream = (stream or link_stream(self.device, to_device)) if self.cuda else None
        self._done = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._runner = runner
        self._future: "Future | None" = None

    def _copy_layer(self, layer: int) -> None:
        for kv in range(self.planes):
            dev = self._dev_pages(layer, kv)[self._d0:self._d1].unbind(0)
            host = self._host[self._h0:self._h1, layer, kv].unbind(0)
            for d, h in self._pairs:
                if self.to_device:
                    dev[d].copy_(host[h], non_blocking=True)
                else:
                    host[h].copy_(dev[d], non_blocking=True)

    # ---- CUDA: the link's stream and one event per layer ----------------------------------------
    def _issue_upto(self, n: int) -> None:
        n = min(n, self.layers)
        if self._issued >= n:
            return
        with torch.cuda.stream(self.stream):
            while self._issued < n:
                self._copy_layer(self._issued)
                event = torch.cuda.Event()
                event.record(self.stream)
                self._events.append(event)
                self._issued += 1

    # ---- CPU: one worker thread and a counter -----------------------------------------------------
    def _run(self) -> None:
        if self._thread is not None:  # a thread of its own (a runner's thread is capped at its start)
            single_threaded_torch()
        try:
            for layer in range(self.layers):
                self._copy_layer(layer)
                with self._cv:
                    self._done = layer + 1
                    self._cv.notify_all()
        except BaseException as exc:  # handed to the waiter, which raises it
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _check_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- public ----------------------------------------------------------------------------------
    def start(self) -> "LayerwiseLoader":
        if self._started:
            raise RuntimeError("LayerwiseLoader.start: already started")
        self._started = True
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # type: ignore[union-attr]
            self._issue_upto(self.ahead)
        elif self._runner is not None:  # a long-lived worker: no thread start (and its wait) per load
            self._future = self._runner.submit(self._run)
        else:
            self._thread = threading.Thread(target=self._run, name="sgl-hicache-layerwise", daemon=True)
            self._thread.start()
        return self

    def wait_layer(self, layer: int) -> None:
        if not self._started:
            raise RuntimeError("LayerwiseLoader.wait_layer: not started")
        if not 0 <= layer < self.layers:
            raise IndexError(f"LayerwiseLoader.wait_layer: layer {layer} not in [0, {self.layers})")
        if self.cuda:
            self._issue_upto(layer + 1 + self.ahead)
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])
            return
        with self._cv:
            self._cv.wait_for(lambda: self._done > layer or self._error is not None)
        self._check_error()

    def done(self) -> bool:
        """Every layer has arrived (never blocks; False before `start`). A copy that failed counts as
        done: `synchronize` raises it."""
        if not self._started:
            return False
        if self.cuda:
            return self._issued == self.layers and (not self._events or self._events[-1].query())
        return self._done == self.layers or self._error is not None

    def synchronize(self) -> None:
        if not self._started:
            raise RuntimeError("LayerwiseLoader.synchronize: not started")
        if self.cuda:
            self._issue_upto(self.layers)
            if self._events:
                self._events[-1].synchronize()
            return
        if self._future is not None:
            self._future.result()
        else:
            assert self._thread is not None
            self._thread.join()
        self._check_error()


__all__ = ["LayerwiseLoader", "link_stream"]
