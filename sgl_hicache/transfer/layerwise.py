"""Layer-by-layer moves between the device pool and the host buffer, so that a model's layer i can run
as soon as layer i's KV has arrived while layer i+1's is still on the link.

Contract (checked on CPU by `tests/unit/transfer/test_layerwise.py`, on CUDA by `benchmarks/io/gpu_check.py`):

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

Three ways to move the layers (`method`), all bit-exact (the bytes move as integers of the element's
size, `as_bits`):

- `per_page`: one contiguous copy per page, layer and K/V, the host's `(page, layer, K/V)` run to the
  device's `(layer, K/V, page)` run, with no temporary and no kernel. On CUDA each is one
  `cudaMemcpyAsync` that the host queues: the first GPU check (H200, 64-token pages of 128 KiB a layer
  and K/V) measured the queueing at about 5.5 us a copy, so a 1 GiB load (8,192 copies) ran at
  0.24-0.43x a plain copy's bandwidth, bound by the host, not by the link.
- `gather`: per layer and K/V, one indexed copy of all the pages, the kernel reading (device->host:
  writing) the pinned host buffer in place through the CUDA view that unified addressing gives
  (`pinned_cuda_view`), as SGLang's and LMCache's transfer kernels do. Few launches, but the copy runs
  on the SMs, so it competes with the model's kernels rather than running beside them.
- `staged` (the default on CUDA with a pinned host buffer): the layers move in groups of `group`
  layers. Host side, one copy engine copy per page of the group's layers, contiguous in the page-first
  host buffer, to a device staging buffer of the group; device side, one indexed copy per layer and
  K/V between the staging buffer and the pool (device memory only: short kernels). A 32-layer load in 8
  groups is 8 copies a page instead of 64, and layer 0 arrives after 1/8 of the bytes.

On a CPU (no streams) the default is `per_page`: each copy is a plain memcpy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future

import torch

from ..tiers.base import Handle
from .torch_threads import single_threaded_torch

_BIT_DTYPES = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element's size (no copy): copies of it are bit-exact for any dtype."""
    return t.view(_BIT_DTYPES[t.element_size()][0])


class _CudaArray:
    """A `__cuda_array_interface__` over a pinned host tensor's memory (the tensor must outlive it)."""

    def __init__(self, t: torch.Tensor) -> None:
        bits = as_bits(t)
        size = bits.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(bits.shape),
            "strides": tuple(st * size for st in bits.stride()),
            "typestr": _BIT_DTYPES[size][1],
            "data": (bits.data_ptr(), False),
            "version": 2,
        }


def pinned_cuda_view(t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the same memory as pinned host tensor `t`, as integers of its element's size
    (`as_bits`): kernels on `device` read and write the host's bytes in place over the link (unified
    addressing maps pinned memory into the device's address space at the same address). None when `t`
    is not pinned or the runtime refuses the pointer. The caller keeps `t` alive while the view is used."""
    if torch.device(device).type != "cuda" or not t.is_pinned():
        return None
    try:
        return torch.as_tensor(_CudaArray(t), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None


_LINK_STREAMS: dict[tuple[torch.device, bool], torch.cuda.Stream] = {}


def link_stream(device: torch.device, to_device: bool) -> torch.cuda.Stream:
    """The stream of one link (host->device or device->host) of a CUDA device, created once."""
    key = (torch.device(device), to_device)
    if key not in _LINK_STREAMS:
        _LINK_STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _LINK_STREAMS[key]


LOAD_METHODS = ("per_page", "gather", "staged")
STAGED_GROUPS = 8  # `staged` moves a load in this many layer groups: few copies, and layer 0 early


class LayerwiseLoader:
    """Moves pages between a `DeviceKVPool` and a `HostKVBuffer` layer by layer (module docstring).
    `method` is one of `LOAD_METHODS` or None (the default for the stores: `staged` on CUDA with a
    pinned host buffer, else `per_page`); `stage_layers` sets `staged`'s group size (default: the
    layers split in `STAGED_GROUPS`)."""

    def __init__(
        self,
        device,
        host,
        device_handles: Sequence[Handle],
        host_handles: Sequence[Handle],
        *,
        to_device: bool = True,
        stream: torch.cuda.Stream | None = None,
        ahead: int | None = None,
        runner: Executor | None = None,
        method: str | None = None,
        stage_layers: int | None = None,
    ) -> None:
        if len(device_handles) != len(host_handles):
            raise ValueError(
                f"LayerwiseLoader: {len(device_handles)} device handles for {len(host_handles)} host handles"
            )
        if ahead is not None and ahead < 1:
            raise ValueError(f"LayerwiseLoader: ahead must be >= 1 or None, got {ahead}")
        if method is not None and method not in LOAD_METHODS:
            raise ValueError(f"LayerwiseLoader: method must be one of {LOAD_METHODS}, got {method!r}")
        if stage_layers is not None and stage_layers < 1:
            raise ValueError(f"LayerwiseLoader: stage_layers must be >= 1, got {stage_layers}")
        self.layers = device.layout.num_layers
        self.planes = device.layout.kv_planes
        self.to_device = to_device
        self.ahead = self.layers if ahead is None else ahead
        self.device = device.device
        self.cuda = self.device.type == "cuda"
        self._dev_pages = device.layer_pages  # (layer, K/V) -> (pages, page tokens, heads, dim), no copy
        self._host = host.buffer  # (pages, layers, K/V, page tokens, heads, dim)
        dev_h, host_h = [int(h) for h in device_handles], [int(h) for h in host_handles]
        # the pages the tensors hold (SGLang's pool has more page slots than the cache may own)
        for name, handles, pages in (
            ("device", dev_h, int(device.layer_pages(0, 0).shape[0])),
            ("host", host_h, int(host.buffer.shape[0])),
        ):
            bad = [h for h in handles if not 0 <= h < pages]
            if bad:
                raise ValueError(f"LayerwiseLoader: {name} handle {bad[0]} not in [0, {pages})")
        pinned = self.cuda and host.buffer.is_pinned()
        if method is None:
            method = "staged" if pinned else "per_page"
        if self.cuda and method != "per_page" and not pinned:
            raise ValueError(f"LayerwiseLoader: method {method!r} on CUDA needs a pinned host buffer")
        self._host_bits: torch.Tensor | None = None  # the host buffer as `gather`'s kernels see it
        if method == "gather":
            self._host_bits = pinned_cuda_view(host.buffer, self.device) if self.cuda else as_bits(host.buffer)
            if self._host_bits is None:
                raise ValueError(
                    "LayerwiseLoader: method 'gather': the CUDA runtime gave no device view of the pinned host buffer"
                )
        self.method = method
        self.group = 1 if method != "staged" else (stage_layers or -(-self.layers // STAGED_GROUPS))
        # per layer, views over the handles' spans only (one unbind call each, not one getitem per page)
        self._d0, self._h0 = min(dev_h, default=0), min(host_h, default=0)
        self._d1, self._h1 = max(dev_h, default=-1) + 1, max(host_h, default=-1) + 1
        self._pairs = [(d - self._d0, h - self._h0) for d, h in zip(dev_h, host_h)]
        self._dev_h, self._host_h = dev_h, host_h
        # each layer's index space on the device (`LayeredPages.layer_space`: a hybrid sliding-window
        # pool's window layers sit in a sub-pool of their own); per space its handles' span and pairs
        space_of = getattr(device, "layer_space", lambda layer: 0)
        self._space = [space_of(layer) for layer in range(self.layers)]
        self._space_pages = getattr(device, "space_pages", lambda space, pages: pages)
        self._views: dict[int, tuple[int, int, list[tuple[int, int]]]] = {0: (self._d0, self._d1, self._pairs)}
        self._dev_idx: dict[int, torch.Tensor] | None = None
        self._host_idx: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._started = False
        self._issued = 0
        self._events: list[torch.cuda.Event] = []
        self.stream = (stream or link_stream(self.device, to_device)) if self.cuda else None
        self._done = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._runner = runner
        self._future: Future | None = None

    # ---- the three ways to move layers [l0, l1) (module docstring); `arrived(layer)` after each ----
    def _copy_group(self, l0: int, l1: int, arrived) -> None:
        if not self._pairs:
            for layer in range(l0, l1):
                arrived(layer)
            return
        if self.method == "staged":
            self._staged_group(l0, l1, arrived)
            return
        for layer in range(l0, l1):
            if self.method == "gather":
                self._gather_layer(layer)
            else:
                self._per_page_layer(layer)
            arrived(layer)

    def _per_page_layer(self, layer: int) -> None:
        for kv in range(self.planes):
            d0, d1, pairs = self._view(self._space[layer])
            dev = self._dev_pages(layer, kv)[d0:d1].unbind(0)
            host = self._host[self._h0 : self._h1, layer, kv].unbind(0)
            for d, h in pairs:
                if self.to_device:
                    dev[d].copy_(host[h], non_blocking=True)
                else:
                    host[h].copy_(dev[d], non_blocking=True)

    def _view(self, space: int) -> tuple[int, int, list[tuple[int, int]]]:
        """The device handles' span and (device, host) pairs in `space` (computed on first use)."""
        if space not in self._views:
            dev = self._space_pages(space, torch.tensor(self._dev_h, dtype=torch.int64, device=self.device)).tolist()
            d0, d1 = min(dev, default=0), max(dev, default=-1) + 1
            self._views[space] = (d0, d1, [(d - d0, h - self._h0) for d, h in zip(dev, self._host_h)])
        return self._views[space]

    def _ensure_indices(self) -> None:
        if self._dev_idx is None:  # first use, on the link's stream (CUDA) or the worker (CPU)
            base, self._host_idx = (self._indices(h) for h in (self._dev_h, self._host_h))
            self._dev_idx = {space: self._space_pages(space, base) for space in set(self._space)}

    def _gather_layer(self, layer: int) -> None:
        self._ensure_indices()
        assert self._host_bits is not None and self._host_idx is not None and self._dev_idx is not None
        for kv in range(self.planes):
            dev = as_bits(self._dev_pages(layer, kv))
            host = self._host_bits[:, layer, kv]
            if self.to_device:
                dev.index_copy_(0, self._dev_idx[self._space[layer]], host.index_select(0, self._host_idx))
            else:
                host.index_copy_(0, self._host_idx, dev.index_select(0, self._dev_idx[self._space[layer]]))

    def _staged_group(self, l0: int, l1: int, arrived) -> None:
        # host side: one copy per page of the group's layers (contiguous in the page-first buffer);
        # device side: one indexed copy per layer and K/V between the staging buffer and the pool
        self._ensure_indices()
        assert self._dev_idx is not None
        if self._staging is None:
            shape = (len(self._pairs), self.group, *self._host.shape[2:])
            self._staging = torch.empty(shape, dtype=as_bits(self._host).dtype, device=self.device)
        stage, host = self._staging[:, : l1 - l0], as_bits(self._host)
        if self.to_device:
            for j, h in enumerate(self._host_h):
                stage[j].copy_(host[h, l0:l1], non_blocking=True)
        for layer in range(l0, l1):
            for kv in range(self.planes):
                dev = as_bits(self._dev_pages(layer, kv))
                if self.to_device:
                    dev.index_copy_(0, self._dev_idx[self._space[layer]], stage[:, layer - l0, kv])
                else:
                    stage[:, layer - l0, kv].copy_(dev.index_select(0, self._dev_idx[self._space[layer]]))
            if self.to_device:
                arrived(layer)
        if not self.to_device:
            for j, h in enumerate(self._host_h):
                host[h, l0:l1].copy_(stage[j], non_blocking=True)
            for layer in range(l0, l1):
                arrived(layer)

    def _indices(self, handles: list[int]) -> torch.Tensor:
        idx = torch.tensor(handles, dtype=torch.int64)
        if not self.cuda:
            return idx
        # through pinned memory, queued on the link's stream: a pageable copy would block the host
        # until the caller's queued work is done
        return idx.pin_memory().to(self.device, non_blocking=True)

    # ---- CUDA: the link's stream and one event per layer ----------------------------------------
    def _issue_upto(self, n: int) -> None:
        n = min(n, self.layers)
        if self._issued >= n:
            return

        def arrived(layer: int) -> None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self._events.append(event)

        with torch.cuda.stream(self.stream):
            while self._issued < n:  # whole groups: a group's layers move together
                l0 = self._issued
                l1 = min(self.layers, l0 + self.group)
                self._copy_group(l0, l1, arrived)
                self._issued = l1

    # ---- CPU: one worker thread and a counter -----------------------------------------------------
    def _run(self) -> None:
        if self._thread is not None:  # a thread of its own (a runner's thread is capped at its start)
            single_threaded_torch()
        try:

            def arrived(layer: int) -> None:
                with self._cv:
                    self._done = layer + 1
                    self._cv.notify_all()

            for l0 in range(0, self.layers, self.group):
                self._copy_group(l0, min(self.layers, l0 + self.group), arrived)
        except BaseException as exc:  # handed to the waiter, which raises it
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _check_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- public ----------------------------------------------------------------------------------
    def start(self) -> LayerwiseLoader:
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


__all__ = ["LOAD_METHODS", "LayerwiseLoader", "STAGED_GROUPS", "as_bits", "link_stream", "pinned_cuda_view"]
