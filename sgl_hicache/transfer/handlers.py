"""Byte movers, one per (source medium, destination medium) pair.

A handler copies pages `[start, stop)` of a prepared `TransferOp`. It touches only the op's own
(pinned, allocated) handles, so handlers for distinct ops, or distinct page ranges of one op, run
concurrently without a lock. Raising is the only way to report a failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..tiers.base import DEVICE, DISK, HOST, TierStore

if TYPE_CHECKING:
    from ..cache import TransferOp

Handler = Callable[["TransferOp", int, int], None]


def copy_via_tensor(stores: dict[str, TierStore]) -> Handler:
    """Generic: read the source pages into one tensor, write them to the destination."""

    def handler(op: "TransferOp", start: int, stop: int) -> None:
        data = stores[op.src].read(op.src_handles[start:stop])
        stores[op.dst].write(op.dst_handles[start:stop], data)

    return handler


def disk_into_host(stores: dict[str, TierStore]) -> Handler:
    """Disk -> host without an intermediate copy: each page file is read straight into its host page."""
    disk, host = stores[DISK], stores[HOST]
    if not hasattr(disk, "read_into") or not hasattr(host, "page_view"):
        return copy_via_tensor(stores)

    def handler(op: "TransferOp", start: int, stop: int) -> None:
        for key, slot in zip(op.src_handles[start:stop], op.dst_handles[start:stop]):
            disk.read_into(key, host.page_view(slot))  # type: ignore[attr-defined]

    return handler


def page_to_page(stores: dict[str, TierStore], src: str, dst: str) -> Handler:
    """Device <-> host page by page, view to view: one (strided) copy per page, no intermediate
    tensor. On CUDA the copies are asynchronous on the current stream and synchronised at the end."""
    a, b = stores[src], stores[dst]
    if not hasattr(a, "page_view") or not hasattr(b, "page_view"):
        return copy_via_tensor(stores)

    def handler(op: "TransferOp", start: int, stop: int) -> None:
        for s_h, d_h in zip(op.src_handles[start:stop], op.dst_handles[start:stop]):
            b.page_view(d_h).copy_(a.page_view(s_h), non_blocking=True)  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    return handler


def default_handlers(stores: dict[str, TierStore]) -> dict[tuple[str, str], Handler]:
    handlers: dict[tuple[str, str], Handler] = {}
    generic = copy_via_tensor(stores)
    for src, dst in ((DEVICE, HOST), (HOST, DEVICE), (HOST, DISK), (DISK, HOST), (DEVICE, DISK)):
        if src in stores and dst in stores:
            handlers[(src, dst)] = generic
    if DISK in stores and HOST in stores:
        handlers[(DISK, HOST)] = disk_into_host(stores)
    if DEVICE in stores and HOST in stores:
        handlers[(DEVICE, HOST)] = page_to_page(stores, DEVICE, HOST)
        handlers[(HOST, DEVICE)] = page_to_page(stores, HOST, DEVICE)
    return handlers
