"""Promotion jobs: a matched path brought up (disk -> host -> device) as staged transfers.

A job is planned under the cache lock (every destination page allocated, the path locked), its
copies run anywhere (inline, worker threads, virtual time), and `advance` applies the stages whose
bytes have arrived, in path order. A job that fails or is cancelled stops at the first stage not
applied; what landed before stays cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ..tiers.base import DEVICE, HOST
from ..transfer.ops import NodeStage, PromotionJob, TransferOp
from ..tree.node import TreeNode
from .copies import Copies
from .protocols import CopyState
from .results import PrefixMatch

WAIT_S = 60.0  # how long a cancel waits for a copy a worker is still running


def wait_executed(op: TransferOp) -> None:
    """Block until a running copy ends: its destination pages cannot be reused before."""
    if not op.executed.wait(timeout=WAIT_S):
        raise RuntimeError(f"transfer {op.link} did not finish within {WAIT_S:.0f} s; cannot free its pages")


class PromotionJobs:
    """Plans, advances, cancels and releases the promotion jobs of one `TieredCache`, whose stages
    are reserved through `copies`.

    Contract: `plan` returns a job whose path is locked (the caller must `release` it) or None;
    `advance` never waits and returns True once the job is finished; `cancel` waits only for copies
    already running; `reap_orphans` never waits. The caller holds the cache's lock.
    """

    def __init__(self, state: CopyState, copies: Copies) -> None:
        self.state = state
        self.copies = copies
        # cancelled copies of failed promotions still running on a worker (`_fail`, `reap_orphans`)
        self.orphans: list[TransferOp] = []

    def plan(self, match: PrefixMatch | Sequence[TreeNode], kind: str, target: str, evict: bool) -> PromotionJob | None:
        c = self.state
        path = list(match.path if isinstance(match, PrefixMatch) else match)
        todo = [
            n for n in path if not n.in_tier(target) and n.parent is not None and (target == DEVICE or n.device is None)
        ]
        if not todo:
            return None
        anchor = path[-1]
        c.tree.lock(anchor)
        stages: list[NodeStage] = []
        staged_host: set[TreeNode] = set()
        for node in todo:
            pending = node.incoming.get(target)
            if pending is not None:
                stages.append(NodeStage(node, [], waits_for=cast(TransferOp, pending)))
                staged_host.add(node)
                continue
            ops: list[TransferOp] = []
            if node.host is None:
                parent = node.parent
                if not (parent.is_root or parent.host is not None or parent in staged_host):  # type: ignore[union-attr]
                    if not self.copies.copy_now(parent, HOST, kind, evict):  # type: ignore[arg-type]
                        break
                up = self.copies.reserve(node, HOST, kind, evict)
                if up is None:
                    break
                ops.append(up)
            if target == DEVICE:
                if ops:
                    down = self.copies.reserve(node, DEVICE, kind, evict, src=HOST, src_handles=ops[0].dst_handles)
                else:
                    down = self.copies.reserve(node, DEVICE, kind, evict)
                if down is None:
                    for op in ops:
                        op.cancelled = True
                        op.executed.set()
                        c.complete(op)
                    break
                ops.append(down)
            stages.append(NodeStage(node, ops))
            staged_host.add(node)
        if not stages:
            c.tree.unlock(anchor)
            c.prune(anchor)
            return None
        return PromotionJob(kind, anchor, stages, c.page_size, target)

    def advance(self, job: PromotionJob) -> bool:
        c = self.state
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
                if not c.complete(op):
                    self._fail(job, wait=False)
                    return True
            job.applied += 1
        return True

    def cancel(self, job: PromotionJob) -> None:
        self.advance(job)
        if not job.finished:
            self._fail(job, wait=True)
        for op in job.ops():  # a stage that failed inside `advance` may have orphaned the rest
            if op in self.orphans:
                wait_executed(op)
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
                if not op.stopped and (not wait or op.shared_dst):  # (agreement is never waited for)
                    self.orphans.append(op)
                    continue
                wait_executed(op)
                self.state.complete(op)

    def reap_orphans(self) -> None:
        if self.orphans:
            ended: list[TransferOp] = []
            running: list[TransferOp] = []
            for op in self.orphans:  # one read per op: a copy ending between two reads is lost to both lists
                (ended if op.stopped else running).append(op)
            self.orphans = running
            for op in ended:
                self.state.complete(op)

    def release(self, job: PromotionJob) -> None:
        if job.released:
            return
        if not job.finished:
            self.cancel(job)
        job.released = True
        self.state.tree.unlock(job.anchor)
        self.state.prune(job.anchor)
