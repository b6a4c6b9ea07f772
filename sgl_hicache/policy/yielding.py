"""Demand preempts prefetch, as little as it must: which queued requests' prefetch jobs to end so
that a request being scheduled fits on the device. A pure decision over the jobs' paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from ..tree.node import TreeNode


class PathJob(Protocol):
    """What the plan reads of a prefetch job (`transfer.ops.PromotionJob`): the node its locked path
    ends at, and whether it was released (its path unlocked)."""

    @property
    def anchor(self) -> TreeNode: ...

    @property
    def released(self) -> bool: ...


class HasJob(Protocol):
    """A queued request's ticket: its prefetch job, or None when it has none."""

    @property
    def job(self) -> PathJob | None: ...


T = TypeVar("T", bound=HasJob)


def yield_plan(tickets: Sequence[T], short_pages: int) -> list[T]:
    """Which prefetch jobs `yield_to_demand` ends (pure decision, nothing changes). A device node
    is freeable when only the jobs of `tickets` hold it (its lock count equals the number of
    those jobs whose path crosses it, and no transfer pins it); it becomes evictable once all of
    them end (queued requests sharing a prefix lock it together). From the back of the queue
    forward (those requests are served last), the jobs crossing a freeable node are chosen until
    the nodes all of whose holders are chosen cover `short_pages`; jobs crossing none are kept.
    Empty when `short_pages` <= 0 or when ending every job would free fewer than `short_pages`."""
    if short_pages <= 0:
        return []
    paths: list[tuple[T, list[TreeNode]]] = []
    holders: dict[int, int] = {}  # device node id -> jobs of `tickets` crossing it
    for ticket in tickets:
        job = ticket.job
        if job is None or job.released:
            continue
        path = [n for n in job.anchor.path_from_root() if not n.is_root and n.device is not None]
        for n in path:
            holders[n.id] = holders.get(n.id, 0) + 1
        paths.append((ticket, path))
    freeable = {n.id: n.num_pages for _, path in paths for n in path if n.pins == 0 and n.lock_ref == holders[n.id]}
    if sum(freeable.values()) < short_pages:
        return []
    left = {k: holders[k] for k in freeable}  # holders not chosen yet
    chosen: list[T] = []
    freed = 0
    for ticket, path in reversed(paths):
        mine = [n.id for n in path if n.id in left]
        if not mine:
            continue
        chosen.append(ticket)
        for k in mine:
            left[k] -= 1
            if left[k] == 0:
                freed += freeable[k]
        if freed >= short_pages:
            return chosen
    return chosen
