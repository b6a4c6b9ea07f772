"""What the SGLang backend remembers of each request between scheduling rounds.

SGLang calls `match_prefix` for a waiting request every round, and tells the cache once it is done
(`on_release`) or aborted (`release_aborted_request`). In between, the backend keeps the controller's
ticket (made at the request's first match: it carries the prefetch job) and the last match SGLang
was given, by request id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..cache import PrefixMatch
from ..control.lifecycle import RequestController, Ticket
from .parallel.rank_consensus import RankConsensus

MAX_REQ_STATES = 65536


@dataclass(eq=False)
class ReqState:
    """One request's memory: when it was first seen, the controller's ticket (made at the first
    match) and the last match SGLang was given."""

    created: float
    ticket: Ticket | None = None
    last_match: PrefixMatch | None = None


class RequestStates:
    """The requests SGLang is scheduling, by rid, from the first match to `forget`. Forgetting one
    drops its prefetch job (and, at TP >= 2, the ranks' record of it). At most `MAX_REQ_STATES`:
    beyond, the oldest (a request SGLang never released) is forgotten."""

    def __init__(self, controller: RequestController, consensus: RankConsensus | None) -> None:
        self.controller = controller
        self.consensus = consensus
        self._states: OrderedDict[str, ReqState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def get(self, rid: str | None) -> ReqState | None:
        return self._states.get(rid) if rid is not None else None

    def track(self, req: Any) -> ReqState | None:
        """`req`'s state, made at its first sight (None without a request)."""
        if req is None:
            return None
        st = self._states.get(req.rid)
        if st is None:
            st = ReqState(created=time.monotonic())
            self._states[req.rid] = st
            if len(self._states) > MAX_REQ_STATES:
                _, old = self._states.popitem(last=False)
                self._drop_job(old)
        return st

    def forget(self, rid: str) -> ReqState | None:
        """Forget `rid` (its prefetch job dropped); its state, or None if it was not tracked."""
        st = self._states.pop(rid, None)
        if st is not None:
            self._drop_job(st)
        return st

    def forget_all(self) -> None:
        for st in list(self._states.values()):
            self._drop_job(st)
        self._states.clear()

    def prefetching(self) -> list[ReqState]:
        """The states whose prefetch job is in flight, oldest first."""
        return [st for st in self._states.values() if st.ticket is not None and st.ticket.job is not None]

    def _drop_job(self, st: ReqState) -> None:
        if st.ticket is not None:
            self.controller.drop(st.ticket)  # cancels what has not arrived; waits for running copies
            if self.consensus is not None:
                self.consensus.forget(st.ticket)


__all__ = ["MAX_REQ_STATES", "ReqState", "RequestStates"]
