"""Byte movers, one per (source medium, destination medium) pair.

A handler copies pages `[start, stop)` of a prepared `TransferOp`. It touches only the op's own
(pinned, allocated) handles, so handlers for distinct ops, or distinct page ranges of one op, run
concurrently without a lock. Raising is the only way to report a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from ..tiers.base import DEVICE, DISK, HOST, LayeredPages, PageViews, ReadsInto, TierIOError, TierStore, WritesFrom
from ..tiers.memory import HostKVBuffer
from .bandwidth import BandwidthMeter
from .ops import Cancelled, TransferOp

Handler = Callable[["TransferOp", int, int], None]
Handlers = dict[tuple[str, str], Handler]


class CopyLinks(Protocol):
    """What a byte mover needs of its owner: a handler per (source, destination) and the meter that
    learns each link's bandwidth (a `TieredCache` is one)."""

    handlers: Handlers
    meter: BandwidthMeter


def execute(op: TransferOp, handlers: Handlers) -> None:
    """Run a prepared op inline with its link's handler: the error is recorded on the op, never
    raised; `op.executed` is set either way (the cache completes it)."""
    start = time.perf_counter()
    if op.cancelled:
        op.error = Cancelled()
    else:
        try:
            handlers[(op.src, op.dst)](op, 0, len(op.dst_handles))
        except (TierIOError, OSError, KeyError, ValueError, RuntimeError) as exc:
            op.record_error(exc)
    op.seconds = time.perf_counter() - start
    op.executed.set()


def copy_via_tensor(stores: dict[str, TierStore]) -> Handler:
    """Generic: read the source pages into one tensor, write them to the destination."""

    def handler(op: TransferOp, start: int, stop: int) -> None:
        data = stores[op.src].read(op.src_handles[start:stop])
        stores[op.dst].write(op.dst_handles[start:stop], data)

    return handler


def disk_into_host(stores: dict[str, TierStore]) -> Handler:
    """Disk -> host without an intermediate copy: each page file is read straight into its host page."""
    disk, host = stores[DISK], stores[HOST]
    if not isinstance(disk, ReadsInto) or not isinstance(host, PageViews):
        return copy_via_tensor(stores)

    def handler(op: TransferOp, start: int, stop: int) -> None:
        for key, slot in zip(op.src_handles[start:stop], op.dst_handles[start:stop]):
            disk.read_into(key, host.page_view(slot))

    return handler


def host_into_disk(stores: dict[str, TierStore]) -> Handler:
    """Host -> disk without an intermediate copy: each page file is written straight from its host page."""
    host, disk = stores[HOST], stores[DISK]
    if not isinstance(disk, WritesFrom) or not isinstance(host, PageViews):
        return copy_via_tensor(stores)

    def handler(op: TransferOp, start: int, stop: int) -> None:
        disk.write_from(op.dst_handles[start:stop], [host.page_view(slot) for slot in op.src_handles[start:stop]])

    return handler


def page_to_page(stores: dict[str, TierStore], src: str, dst: str) -> Handler:
    """Device <-> host page by page, view to view: one (strided) copy per page, no intermediate
    tensor. On CUDA the copies are asynchronous on the current stream and synchronised at the end."""
    a, b = stores[src], stores[dst]
    if not isinstance(a, PageViews) or not isinstance(b, PageViews):
        return copy_via_tensor(stores)

    def handler(op: TransferOp, start: int, stop: int) -> None:
        for s_h, d_h in zip(op.src_handles[start:stop], op.dst_handles[start:stop]):
            b.page_view(d_h).copy_(a.page_view(s_h), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    return handler


_LAYERED_MIN_BYTES = 3 << 20  # measured crossover with copy_via_tensor (see layered_device_host)


def layered_device_host(stores: dict[str, TierStore], src: str, dst: str) -> Handler:
    """Device <-> host for a device tier kept as separate per-layer buffers (SGLang's pool), where
    no single view spans a page's layers: per layer and K/V one gather of the op's pages and one
    scatter into their slots on the other side. Temporaries hold one layer of the op's pages, not the
    whole op. Below `_LAYERED_MIN_BYTES` a range goes through `copy_via_tensor` instead: its fewer,
    larger calls win there (`benchmarks/io/host.py`, `sglang_layout_*` rows: layered 4.4x the
    generic path at 64 MiB, 0.75x at 1 MiB, even near 3 MiB on this CPU)."""
    device, host = stores[DEVICE], stores[HOST]
    generic = copy_via_tensor(stores)
    if not isinstance(device, LayeredPages) or not device.views_every_layer or not isinstance(host, HostKVBuffer):
        return generic
    layers, planes = device.layout.num_layers, device.layout.kv_planes
    min_pages = max(1, -(-_LAYERED_MIN_BYTES // device.page_bytes))
    buffer: torch.Tensor = host.buffer
    on_cuda = buffer.device.type != device.device.type

    def index(handles, where) -> torch.Tensor:
        return torch.as_tensor(list(handles), dtype=torch.int64, device=where)

    spaces = [device.layer_space(layer) for layer in range(layers)]  # where each layer's pages are indexed

    def in_spaces(d_idx: torch.Tensor) -> dict[int, torch.Tensor]:
        return {space: device.space_pages(space, d_idx) for space in set(spaces)}

    def to_host(op: TransferOp, start: int, stop: int) -> None:
        if stop - start < min_pages:
            return generic(op, start, stop)
        d_idx = in_spaces(index(op.src_handles[start:stop], device.device))
        h_idx = index(op.dst_handles[start:stop], buffer.device)
        for layer in range(layers):
            for kv in range(planes):
                pages = device.layer_pages(layer, kv).index_select(0, d_idx[spaces[layer]])
                buffer[:, layer, kv].index_copy_(0, h_idx, pages.to(buffer.device))

    def to_device(op: TransferOp, start: int, stop: int) -> None:
        if stop - start < min_pages:
            return generic(op, start, stop)
        h_idx = index(op.src_handles[start:stop], buffer.device)
        d_idx = in_spaces(index(op.dst_handles[start:stop], device.device))
        for layer in range(layers):
            for kv in range(planes):
                pages = buffer[:, layer, kv].index_select(0, h_idx)
                target = device.layer_pages(layer, kv)
                target.index_copy_(0, d_idx[spaces[layer]], pages.to(target.device, non_blocking=True))
        if on_cuda:
            torch.cuda.current_stream().synchronize()

    return to_host if src == DEVICE else to_device


def default_handlers(stores: dict[str, TierStore]) -> dict[tuple[str, str], Handler]:
    handlers: dict[tuple[str, str], Handler] = {}
    generic = copy_via_tensor(stores)
    for src, dst in ((DEVICE, HOST), (HOST, DEVICE), (HOST, DISK), (DISK, HOST), (DEVICE, DISK)):
        if src in stores and dst in stores:
            handlers[(src, dst)] = generic
    if DISK in stores and HOST in stores:
        handlers[(DISK, HOST)] = disk_into_host(stores)
        handlers[(HOST, DISK)] = host_into_disk(stores)
    if DEVICE in stores and HOST in stores:
        # one strided copy per page where the device has page views (the embedded pool); else per layer
        pick = page_to_page if isinstance(stores[DEVICE], PageViews) else layered_device_host
        handlers[(DEVICE, HOST)] = pick(stores, DEVICE, HOST)
        handlers[(HOST, DEVICE)] = pick(stores, HOST, DEVICE)
    return handlers


def follower_handlers(handlers: Handlers, stores: dict[str, TierStore], skipped: dict[str, int]) -> Handlers:
    """The byte movers of a *follower* rank of a TP group whose ranks hold the same KV and share one
    host buffer and one disk directory (`tiers/replicated.py`): the leader moves every byte into host
    and disk, the follower reads host -> device itself.

    - A gated copy (a background one, recorded only once every rank has executed it:
      `sglang/rank_consensus.py`) into host or disk moves nothing here; the agreement waits for the
      leader's copy, which lands the same bytes in the same shared slot or file. The follower's disk
      index (a `MirrorDiskStore`) still records the page. `skipped[link]` counts the pages.
    - An inline copy (on the scheduler thread, not agreed) device -> host is made here too: the same
      bytes into the same slot, so that this rank never reads a slot before it is written.
    - An inline disk -> host copy cannot be made here (the follower has no files) and fails with a
      TierIOError; the server's request path makes none (docs/coverage.md, "MLA").
    Host -> device (and device -> host inline) keep `handlers`' movers."""
    out = dict(handlers)
    lower = stores.get(DISK)

    def into_host(inner: Handler, link: str) -> Handler:
        def handler(op: TransferOp, start: int, stop: int) -> None:
            if op.gated:
                skipped[link] = skipped.get(link, 0) + stop - start
                return
            if op.src == DISK:
                raise TierIOError("disk -> host inline on a follower rank: only the leader reads the disk tier")
            inner(op, start, stop)

        return handler

    def into_disk(op: TransferOp, start: int, stop: int) -> None:
        lower.write(op.dst_handles[start:stop], torch.empty(0))  # type: ignore[union-attr]  # (set only with a lower tier; the index only)
        if op.gated:
            skipped["host->disk"] = skipped.get("host->disk", 0) + stop - start

    for src, dst in list(out):
        if dst == HOST:
            out[(src, dst)] = into_host(out[(src, dst)], f"{src}->{dst}")
        elif dst == DISK:
            out[(src, dst)] = into_disk
    return out
