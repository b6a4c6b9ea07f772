"""Hints that travel with the request (`policy/agent_hints.py`), applied in the scheduler.

A request's ``sampling_params.custom_params["agent_hints"]`` reaches the scheduler's `Req` on every
TP rank at the same step, so every rank applies it at the same point of its (agreed) timeline:

- at arrival (BEFORE SGLang's `Scheduler._add_request_to_queue`, `on_arrival`): a malformed field
  finishes the request with a 400 naming the field (`Req.set_finish_with_abort`); a ``prefetch``
  naming a handle brings that conversation up from disk (`HintDesk`, trigger ``hint``);
- when the request ends (`TieredRadixCache.on_release`, `on_finish`): its conversation (prompt and
  answer, as far as the tree holds it) is retained for the asked time, or demoted (``end``), and
  recorded under its handles: its request id and, with ``workflow_id`` and ``agent_id``, the session
  key ``<workflow_id>/<agent_id>``.

The same holds for the versioned ``kv_hints`` envelope (`policy/kv_hints.py`): its actions become
the same `AgentHints`, applied here by the same code.

Handles are kept in a bounded book (`MAX_HANDLES`, oldest first out), each within its sender's
namespace (`namespace`: the request's ``cache_salt`` and ``extra_key``, a LoRA adapter's id
included): a handle is recorded and looked up only there, so a prefetch naming another namespace's
handle is refused as unknown and moves none of its pages. Requests with a salt or an extra key are
served without the cache (`SGLangTieredBackend`: never matched, never stored), so they record no
handle and their retention or end acts on nothing: the tree holds only the empty namespace's
conversations, and another namespace's hint must not touch them. An unknown handle is refused
(counted under ``unknown``, the reason kept as the last error) and the request runs as it would
without the hint.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from ...cache import TieredCache
from ...control.hint_desk import HintDesk
from ...policy.agent_hints import AgentHints
from ...policy.hint_rules import Hint, HintError
from ...policy.kv_hints import parse_hints
from ...tree.node import TreeNode

logger = logging.getLogger(__name__)

MAX_HANDLES = 65536
_ATTR = "_sgl_hicache_agent_hints"
Namespace = tuple[str, str]  # (cache_salt, extra_key); ("", "") for a request with neither


def namespace(req: Any) -> Namespace:
    """The namespace `req`'s handles live in: its ``cache_salt`` and ``extra_key`` (empty when absent)."""
    return (str(getattr(req, "cache_salt", None) or ""), str(getattr(req, "extra_key", None) or ""))


class RequestHints:
    """Applies the hints requests carry (module docstring) through one `HintDesk`.

    Contract: `on_arrival(req)` and `on_finish(req)` run on the scheduler thread, plan only (never
    wait), and never raise for a client's error: a malformed hint aborts its request with the
    reason; any other refusal is counted by the desk. `status()` gives the counters the stats show.
    """

    def __init__(self, cache: TieredCache, desk: HintDesk) -> None:
        self.cache = cache
        self.desk = desk
        self.handles: OrderedDict[tuple[Namespace, str], TreeNode] = OrderedDict()
        self.requests_with_hints = 0
        self.with_kv_hints = 0
        self.shares = 0  # kv_hints Share actions: accepted, nothing done
        self.uncached = 0  # hinted requests outside the empty namespace: their retention acts on nothing
        self.aborted = 0
        self.last_error: str | None = None

    def _refuse(self, error: HintError) -> None:
        self.desk.refuse(error)
        self.last_error = str(error)

    def on_arrival(self, req: Any) -> None:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        try:
            hints = parse_hints(params)
        except HintError as e:
            self._refuse(e)
            self.aborted += 1
            req.set_finish_with_abort(f"sgl_hicache: {e}")
            return
        if hints is None:
            return
        self.requests_with_hints += 1
        if hints.envelope:
            self.with_kv_hints += 1
            self.shares += hints.shares
        setattr(req, _ATTR, hints)
        if hints.prefetch is not None:
            self._prefetch(
                (namespace(req), hints.prefetch), "kv_hints Prefetch" if hints.envelope else "agent_hints.prefetch"
            )

    def _prefetch(self, key: tuple[Namespace, str], field: str) -> None:
        node = self.handles.get(key)
        if node is None or node.parent is None:  # never given out here, or its conversation left the tree
            self.handles.pop(key, None)
            error = HintError(f"{field}: unknown handle {key[1][:80]!r}", reason="unknown")
            self._refuse(error)
            return
        self.handles.move_to_end(key)
        tokens = [t for n in node.path_from_root() for t in n.tokens]
        self._apply(Hint("prefetch", input_ids=tuple(tokens)), tokens)

    def _apply(self, hint: Hint, tokens: list[int]) -> None:
        try:
            self.desk.apply(hint, tokens)
        except HintError as e:  # counted by the desk
            self.last_error = f"{hint.action}: {e}"

    def on_finish(self, req: Any) -> None:
        hints: AgentHints | None = getattr(req, _ATTR, None)
        if hints is None or not getattr(req, "finished", lambda: True)():
            return
        space = namespace(req)
        if space != ("", ""):  # served without the cache: nothing of its own in the tree
            self.uncached += 1
            return
        tokens = list(req.origin_input_ids) + list(getattr(req, "output_ids", None) or ())
        aligned = self.cache.tree.page_aligned(tokens)
        if aligned == 0:
            return
        m = self.cache.match(tokens[:aligned], touch=False, count=False)
        if not m.path:
            return
        node = m.path[-1]
        for handle in (str(req.rid), hints.session):
            if handle is not None:
                self.handles[(space, handle)] = node
                self.handles.move_to_end((space, handle))
        while len(self.handles) > MAX_HANDLES:
            self.handles.popitem(last=False)
        held = tokens[: m.tokens]
        if hints.end:
            self._apply(Hint("demote", input_ids=tuple(held)), held)
        elif hints.retain_s is not None:
            self._apply(Hint("retain", input_ids=tuple(held), ttl_s=hints.retain_s), held)

    def status(self) -> dict[str, Any]:
        """The counters the stats show (`hints.requests`)."""
        return {
            "with_hints": self.requests_with_hints,
            "with_kv_hints": self.with_kv_hints,
            "shares_ignored": self.shares,
            "uncached_namespace": self.uncached,
            "aborted_malformed": self.aborted,
            "handles": len(self.handles),
            "last_error": self.last_error,
        }


def on_add_request(scheduler: Any, req: Any = None, is_retracted: bool = False, *args: Any, **kwargs: Any) -> None:
    """BEFORE SGLang's `Scheduler._add_request_to_queue` (registered by `scheduler_hooks`): a new
    request's hints (`RequestHints.on_arrival`)."""
    cache = getattr(scheduler, "tree_cache", None)
    hints = getattr(cache, "request_hints", None)
    if hints is None or req is None or is_retracted or getattr(req, "finished", lambda: False)():
        return
    hints.on_arrival(req)
    return
