"""Client hints run through the request controller: the one implementation for the server's hint
API, the hints a request carries, and the embedded engine's replay of trace hints
(`policy/hints.py` says what a hint is).

- ``prefetch``: the prefix's disk-only part comes up to host as a speculative job of the
  controller (paced: `max_predicted_jobs`, sized by `prediction_budget`; guarded: trigger ``hint``;
  charged like a prediction, behind demand and ahead of write-back), and from host on to the device
  where the device has free pages nobody needs (`Speculation.carry`); the prefix is wanted soon, so
  it is retained for `prefetch_hold_s` (`HintLimits.prefetch_retain_s`, or longer where the clients'
  prefetches are measured to come that much before their use);
- ``pin``: the same, then the prefix is retained for `ttl_s`;
- ``retain``: the prefix's recency is refreshed, as a request using it would; with `ttl_s`, it is
  retained for that long;
- ``demote``: the prefix is the first to go when room is needed (its recency set to the oldest),
  and its retention ends; a part of it that other prefixes share (a common system prompt) keeps
  its recency (`own_tail`).

Retention is advice, never a lock, and it is charged against what it displaces: as time passes a
retained prefix's recency is raised to that of the unhinted page worth as much (`refresh`): the
client's measured precision over the seconds until it wants the prefix back, against what the cache
has learned of its other pages (`ReuseModel.return_curve`: the share of pages that come back, over
the median wait for them, by idle time). Where the other pages are conversations that come back
within seconds, a prefix wanted in a minute ranks behind them; where they never come back, it
ranks ahead of every unhinted page. A request that needs the room still takes it. Each tier
holds at most its share of retained tokens (`HintLimits`; the retentions that end soonest first,
each ranked as more recent than those ending later, and the overdue ones, held longer than most
retentions took to come back, last), and each retention lasts in a tier only as long as the cost
test allows (`retention_s`): where the device is contended (it evicts fast) a prefix ages out of it
and stays on host; where hinted prefixes do not come back, retention shrinks.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..cache import TieredCache
from ..policy.agent_hints import TTL_MARGIN
from ..policy.hint_rules import (
    Hint,
    HintError,
    HintLimits,
    RateGate,
    check_prefix,
    retention_s,
)
from ..policy.return_gaps import ReturnGaps
from ..policy.reuse import ReuseModel, equal_value_idle
from ..policy.writeback_choice import EvictionRate
from ..tiers.base import DEVICE, DISK, HOST, TIERS, Tier
from ..tree.node import TreeNode
from .speculative_prefetch import Speculation

HINT_TRIGGER = "hint"
REFRESH_S = 0.25  # how often retained prefixes are refreshed (their recency lags by at most this)
WATCHED = 1024  # prefetched prefixes watched for their return at once (the oldest dropped first)
RETURNS_KEPT = 256  # the latest return delays kept (prefetch -> use, retention start -> return)
MIN_RETURNS = 8  # returns seen before the prefetch hold and the overdue age follow them
RANK_STEP_S = 1e-6  # recency step between retentions' refreshes (1,024 of them span 1 ms)
MIN_GAPS = 32  # gaps between uses seen before retentions rank against the unhinted pages' value
LEARNED_LEAD_S = 2.0  # the server's own retentions come back up this long before they are due
RETURN_QUANTILE = 0.9  # held until this share of the measured returns came (prefetch hold, overdue age)


@dataclass(order=True)
class Retention:
    """One retained prefix: until `until` (clock seconds), its last node `node`, `tokens` long,
    registered at `start` when the node had `hits` matches and `parent` above it (a later match of
    the node, or of a part of it split off since, means it came back: `came_back`)."""

    until: float
    seq: int
    node: TreeNode = field(compare=False)
    tokens: int = field(compare=False)
    start: float = field(compare=False)
    hits: int = field(compare=False)
    parent: TreeNode | None = field(compare=False, default=None)
    learned: bool = field(compare=False, default=False)  # the server's own (`committed`), not a client's
    prefetch_at: float = field(compare=False, default=float("inf"))  # when it is brought back up, if it left


def late_return(delays: deque[float]) -> float | None:
    """The `RETURN_QUANTILE` of the measured return `delays` (None until `MIN_RETURNS` were seen)."""
    if len(delays) < MIN_RETURNS:
        return None
    xs = sorted(delays)
    return xs[min(len(xs) - 1, int(RETURN_QUANTILE * len(xs)))]


def came_back(node: TreeNode, hits: int, parent: TreeNode | None) -> bool:
    """Whether a request matched `node` since it had `hits` matches, counting the parts split off
    its head since then (they lie between it and its `parent` of that time, and start from its
    count): the next turn of a conversation often diverges inside its last page (a re-rendered
    answer), which splits the node and matches only its upper part."""
    n: TreeNode | None = node
    while n is not None and n is not parent:
        if n.hit_count > hits:
            return True
        n = n.parent
    return False


def own_tail(path: list[TreeNode]) -> list[TreeNode]:
    """The part of `path` (root first) that no other prefix in the tree shares: the nodes below
    the deepest one with more than one child (a shared system prompt, a task other sessions
    branched from). Ending a conversation ends only that part."""
    start = 0
    for i, n in enumerate(path[:-1]):
        if len(n.children) > 1:
            start = i + 1
    return path[start:]


class HintDesk:
    """Applies hints for one `RequestController` (its owner calls `expire` as time passes), on its
    `cache`, submitting prefetches through its `speculation` (same guard, same job limit), with its
    `clock`, reading the tiers' measured eviction rates (`eviction_rates`) for the cost test.

    Contract: `apply(hint, tokens)` runs `hint` on the prefix `tokens` (the caller resolved a
    session to its tokens) and returns the tokens it acted on (0: nothing cached matched, the guard
    refused, or no room); a hint that cannot run raises `HintError` (an over-long or oversized
    retention, a flood). Never waits on I/O, never locks a page. Every retention ends: at its
    expiry (`expire`), at a ``demote`` of its prefix, or at `shutdown`. `counts` tallies applied
    hints per action, `rejected` the refused ones (`refused` by reason); `retained_used` /
    `retained_wasted` count the retentions whose prefix came back / did not before they ended.
    """

    def __init__(
        self,
        cache: TieredCache,
        speculation: Speculation,
        clock: Callable[[], float],
        eviction_rates: dict[Tier, EvictionRate] | None = None,
        limits: HintLimits | None = None,
        learn_returns: bool = False,
    ) -> None:
        self.cache = cache
        self.speculation = speculation
        self.clock = clock
        self.eviction_rates = eviction_rates or {}
        self.limits = limits or HintLimits()
        self._retained: list[Retention] = []  # a heap, soonest end first
        self._seq = itertools.count()
        self._gate: RateGate | None = None
        self._refreshed_at = -float("inf")
        self._watched_at = -float("inf")
        self.pinned_tokens = 0
        self.counts = dict.fromkeys(("prefetch", "pin", "retain", "demote"), 0)
        self.rejected = 0
        self.refused: dict[str, int] = {}
        self.retained_used = 0
        self.retained_wasted = 0
        self.refreshed_tokens = {DEVICE: 0, HOST: 0}  # tokens kept by the last refresh, per tier
        # prefetched prefixes (time, last node, its hits then) watched until a request uses them, and
        # the measured delays from prefetch to that use: how early the clients' prefetches come
        self._watched: deque[tuple[float, TreeNode, int, TreeNode | None]] = deque(maxlen=WATCHED)
        self.returns: deque[float] = deque(maxlen=RETURNS_KEPT)
        # how long after their start retentions came back: an active one held longer than most of
        # those took (`_late`) is `overdue`: it counts as wasted while it lasts, and it is kept after
        # the others. A client that retains what never comes back is measured in seconds, not when
        # its retentions end
        self.retention_returns: deque[float] = deque(maxlen=RETURNS_KEPT)
        self.overdue = 0
        self._late = float("inf")
        self._reuse: ReuseModel | None = None  # learns the unhinted pages' returns from the first hint on
        # the server's own retentions, from each conversation's past pauses (`committed`)
        self.pauses = ReturnGaps() if learn_returns else None
        self.learned = {"retained": 0, "used": 0, "wasted": 0, "skipped": 0, "prefetched": 0, "carried": 0}

    def apply(self, hint: Hint, tokens: Sequence[int]) -> int:
        try:
            return self._apply(hint, tokens)
        except HintError as e:
            self.refuse(e)
            raise

    def refuse(self, error: HintError) -> None:
        """Count a refused hint (every refusal, counted once, whoever refused it)."""
        self.rejected += 1
        self.refused[error.reason] = self.refused.get(error.reason, 0) + 1

    def _apply(self, hint: Hint, tokens: Sequence[int]) -> int:
        cache = self.cache
        now = self.clock()
        if self._gate is None or self._gate.rate != self.limits.max_hints_per_s:
            self._gate = RateGate(self.limits.max_hints_per_s, self.limits.burst)
        if not self._gate.take(now):
            raise HintError(f"more than {self.limits.max_hints_per_s:g} hints per second: refused", reason="flood")
        check_prefix(len(tokens), cache.page_size)
        if self._reuse is None:
            self._reuse = cache.learn_reuse()
        aligned = cache.tree.page_aligned(tokens)
        self.expire()
        ttl = hint.ttl_s if hint.action in ("pin", "retain") else None
        if hint.action == "prefetch" and self.limits.prefetch_retain_s > 0:
            ttl = self.prefetch_hold_s()  # it is wanted soon: kept until then, like a short retention
        if ttl is not None:
            self.limits.check_ttl(ttl)
        m = cache.match(tokens[:aligned], touch=False, count=False)
        if not m.path:
            return 0
        if hint.action == "prefetch":
            self._watched.append((now, m.last_node, m.last_node.hit_count, m.last_node.parent))
        if hint.action == "retain":
            cache.match(tokens[:aligned], touch=True, count=False)
        elif hint.action == "demote":
            self._end_under(m.path[-1])
            self._demote(own_tail(m.path))
        elif m.disk_tokens:
            self._prefetch(m.path[-1], now)  # and on to the device once it lands (`Speculation.advance`)
        if ttl is not None:
            try:
                self._retain(m.last_node, m.tokens, ttl, now)
            except HintError:
                if hint.action != "prefetch":
                    raise
        if hint.action in ("prefetch", "pin") and m.host_tokens and not m.disk_tokens:
            self.speculation.carry(m.path[-1])  # on host already: on to the device, where it has room
        self.counts[hint.action] += 1
        return m.tokens

    # ---- retention ----------------------------------------------------------------------------
    def _retain(self, node: TreeNode, tokens: int, ttl_s: float, now: float, learned: bool = False) -> Retention | None:
        cache = self.cache
        if not cache.has_tier(HOST) and not cache.has_tier(DEVICE):
            return None
        if len(self._retained) >= self.limits.max_retained // (2 if learned else 1):
            raise HintError(f"{self.limits.max_retained} prefixes are retained already: refused", reason="flood")
        if cache.has_tier(HOST):
            self.limits.check_share(tokens, 0, cache.stores[HOST].capacity_pages * cache.page_size)
        r = Retention(now + ttl_s, next(self._seq), node, tokens, now, node.hit_count, node.parent, learned)
        heapq.heappush(self._retained, r)
        self.pinned_tokens += tokens
        for n in node.path_from_root():  # the hint counts as a use now; the shares apply from the next refresh
            n.last_access = max(n.last_access, now)
        cache.tree.touched()
        return r

    def precision(self, learned: bool = False) -> float:
        """The share of the clients' retentions (`learned`: the server's own) whose prefix came back
        in time, over those ended and those `overdue` (1.0 until 4 count: a prior that trusts a new
        client, quickly corrected)."""
        if learned:
            used, done = self.learned["used"], self.learned["used"] + self.learned["wasted"]
        else:
            used, done = self.retained_used, self.retained_used + self.retained_wasted + self.overdue
        return (used + 3) / (done + 3) if done < 4 else used / done

    def _overdue(self, r: Retention, now: float) -> bool:
        return now - r.start > self._late

    def _count_overdue(self, now: float) -> None:
        """`overdue`: the active retentions held for longer than `RETURN_QUANTILE` of the retentions
        that came back took (once `MIN_RETURNS` came back)."""
        late = late_return(self.retention_returns)
        self._late = float("inf") if late is None else late
        self.overdue = sum(1 for r in self._retained if not r.learned and self._overdue(r, now))

    def _lasts(self, tier: Tier) -> float:
        """How long after its start a retention holds in `tier` (`retention_s`, with the tier's
        measured eviction rate)."""
        rate = self.eviction_rates.get(tier)
        stats = self.cache.stats
        below = (HOST, DISK) if tier == DEVICE else (DISK,)
        evicted = stats.evicted_tokens[tier]
        reloaded = sum(stats.hit_tokens[t] for t in below) / evicted if evicted else 0.0
        return retention_s(
            float("inf"),
            self.cache.stores[tier].capacity_pages,
            rate.rate if rate else 0.0,
            self.precision(),
            reloaded,
            self.limits.stay_factor,
        )

    def refresh(self, now: float) -> None:
        """Keep the retained prefixes among the most recently used pages: the retentions ending
        soonest first, each tier up to its share, each for as long as its tier's cost test allows.
        A prefix past its device share or time is left to age there, marked to be kept on host
        (`TreeNode.keep_until`: the eviction that moves it off the device makes it just used, so it
        lands on host ahead of the unhinted pages, not behind them, within one step's evictions);
        past its host share or time it ages like any other page."""
        cache, ps = self.cache, self.cache.page_size
        caps = {
            t: share * cache.stores[t].capacity_pages * ps
            for t, share in ((DEVICE, self.limits.device_share), (HOST, self.limits.max_pin_share))
            if cache.has_tier(t)
        }
        lasts = {t: self._lasts(t) for t in caps}
        used = dict.fromkeys(caps, 0)
        seen: set[int] = set()
        touched = False
        # the clients' retentions first: the server's own take only the shares they leave
        order = sorted(self._retained, key=lambda r: (r.learned, self._overdue(r, now), r.until, r.seq))
        curve = self._return_curve()
        precision = {False: self.precision(), True: self.precision(learned=True)}
        for rank, r in enumerate(order):
            age = now - r.start
            # ranked like the unhinted page worth as much: a prefix the client wants back in `wait`
            # seconds, with the client's measured precision, is kept ahead of the pages worth less
            # per second held, behind those worth more. Among retentions, the soonest to end ranks
            # as the most recent: when retained pages must go, the latest expected go first
            lag = (
                0.0 if curve is None else equal_value_idle(curve, precision[r.learned] / max(r.until - now, REFRESH_S))
            )
            if lag == float("inf"):
                continue  # every unhinted page is worth more: the hint changes nothing
            stamp = now - max(lag, rank * RANK_STEP_S)
            for n in r.node.path_from_root():
                if n.id in seen:
                    continue
                size = n.num_pages * ps
                if n.device is not None and self._fits(DEVICE, caps, lasts, used, age, size):
                    tier = DEVICE
                elif (n.device is not None or n.host is not None) and self._fits(HOST, caps, lasts, used, age, size):
                    tier = HOST
                else:
                    break  # prefix closure: nothing below a page left to age is kept either
                seen.add(n.id)
                used[tier] += size
                if n.device is not None and tier == HOST:  # ages out of the device, kept once on host
                    if lag <= REFRESH_S:
                        n.keep_until = max(n.keep_until, min(r.until, r.start + lasts[HOST]))
                    continue
                if n.last_access < stamp:
                    n.last_access = stamp
                    touched = True
        if touched:
            cache.tree.touched()
        self.refreshed_tokens = {t: used.get(t, 0) for t in (DEVICE, HOST)}

    def _return_curve(self) -> list[tuple[float, float]] | None:
        """The unhinted pages' value by idle time (`ReuseModel.return_curve`), once `MIN_GAPS` gaps
        were seen (None before: the retentions rank as just used)."""
        model = self._reuse
        return model.return_curve() if model is not None and model.gaps >= MIN_GAPS else None

    @staticmethod
    def _fits(tier: Tier, caps: dict, lasts: dict, used: dict, age: float, size: int) -> bool:
        """Whether `size` more retained tokens of a retention `age` seconds old stay in `tier`."""
        return tier in caps and age <= lasts[tier] and used[tier] + size <= caps[tier]

    def _end(self, r: Retention) -> None:
        self.pinned_tokens -= r.tokens
        if r.learned:
            self.learned["used" if came_back(r.node, r.hits, r.parent) else "wasted"] += 1
            return
        if came_back(r.node, r.hits, r.parent):
            self.retained_used += 1
            self.retention_returns.append(self.clock() - r.start)
        else:
            self.retained_wasted += 1

    def _end_under(self, node: TreeNode) -> None:
        """End the retentions of `node` and of the prefixes below it (the conversation ended)."""
        keep = []
        for r in self._retained:
            n: TreeNode | None = r.node
            while n is not None and n is not node:
                n = n.parent
            if n is node:
                self._end(r)
            else:
                keep.append(r)
        if len(keep) != len(self._retained):
            heapq.heapify(keep)
            self._retained = keep

    # ---- prefetch and demote ------------------------------------------------------------------
    def _prefetch(self, node: TreeNode, now: float) -> None:
        """`node`'s path disk -> host, node by node (root first, each over host pages ranked below
        it), as speculative jobs of the controller, under the guard, up to its budget."""
        spec = self.speculation
        left = spec.prediction_budget()
        if not any(n.host is None and n.device is None for n in node.path_from_root()):
            return
        if spec.admit(HINT_TRIGGER) is None:  # one decision per hint
            return
        for n in node.path_from_root():
            if n.host is not None or n.device is not None or n.parent is None:
                continue
            if len(spec.predicted) >= spec.settings.max_predicted_jobs:
                return
            tokens = n.num_pages * self.cache.page_size
            if left is not None and tokens > left:
                return  # it would not land in time: the demand load does the rest
            job = spec.promote_fresh(n, now, may_evict=True)
            if job is None:
                return
            spec.submit(job, HINT_TRIGGER)
            if left is not None:
                left -= tokens

    def _demote(self, path: list[TreeNode]) -> None:
        """The prefix goes first: its recency set to the oldest (each node re-queued as an eviction
        candidate where its tier keeps an incremental order, since its key went down)."""
        tree = self.cache.tree
        for n in path:
            n.last_access = 0.0
            n.keep_until = 0.0
        tree.touched()
        if getattr(tree, "leaves", None):
            for n in path:
                for tier in TIERS:
                    if n.in_tier(tier):
                        tree.leaf_queue(tier).push(n)

    # ---- the server's own retentions ------------------------------------------------------------
    def arrived(self, path: Sequence[TreeNode]) -> None:
        """A request matched `path` (root first): its conversation's pause ends (`ReturnGaps`)."""
        if self.pauses is not None and path:
            self.pauses.arrived([n.keys[0] for n in path], self.clock())

    def committed(self, path: Sequence[TreeNode], ending: str | None = None) -> None:
        """A request ended along `path` (root first), in `ending` (`records.ENDS_IN`; None: unknown):
        where its conversation's past pauses predict the next, retain it for that pause with the
        clients' margin, as a hint would,
        ranked by the same value test (`refresh`) with the server's own measured precision, within
        the share the clients' retentions leave and at most half of `max_retained` at once."""
        if self.pauses is None or not path:
            return
        if self._reuse is None:
            self._reuse = self.cache.learn_reuse()
        now = self.clock()
        pause = self.pauses.committed([n.keys[0] for n in path], now, ending)
        if pause is None:
            return
        ttl = min(self.limits.max_ttl_s, max(1.0, pause * TTL_MARGIN))
        tokens = sum(n.num_pages for n in path) * self.cache.page_size
        try:
            r = self._retain(path[-1], tokens, ttl, now, learned=True)
        except HintError:
            self.learned["skipped"] += 1
            return
        if r is not None:
            r.prefetch_at = now + pause - LEARNED_LEAD_S
            self.learned["retained"] += 1

    def _bring_back(self, now: float) -> None:
        """The server's retentions due back within `LEARNED_LEAD_S`: what of them left the device
        comes back up (disk -> host as a guarded speculative job, host -> device into free pages)."""
        for r in self._retained:
            if r.prefetch_at > now:
                continue
            r.prefetch_at = float("inf")
            path = r.node.path_from_root()
            if any(n.host is None and n.device is None for n in path):
                self._prefetch(r.node, now)
                self.learned["prefetched"] += 1
            elif any(n.device is None for n in path):
                self.speculation.carry(r.node)
                self.learned["carried"] += 1

    # ---- time ---------------------------------------------------------------------------------
    def expire(self) -> int:
        """End the retentions whose time is up, whose prefix left the tree, or whose conversation
        came back; refresh the rest at most every `REFRESH_S`. Returns how many ended."""
        now = self.clock()
        ended = 0
        while self._retained and self._retained[0].until <= now:
            self._end(heapq.heappop(self._retained))
            ended += 1
        if self._retained and now - self._refreshed_at >= REFRESH_S:
            # a prefix that left the tree, or whose conversation came back (a request used it since),
            # needs no more retention: its share goes to the others
            gone = [r for r in self._retained if r.node.parent is None or came_back(r.node, r.hits, r.parent)]
            if gone:
                for r in gone:
                    self._end(r)
                ended_ids = {id(r) for r in gone}
                self._retained = [r for r in self._retained if id(r) not in ended_ids]
                heapq.heapify(self._retained)
                ended += len(gone)
            self._refreshed_at = now
            self._count_overdue(now)
            self.refresh(now)
            self._bring_back(now)
        if self._watched and now - self._watched_at >= REFRESH_S:
            self._watched_at = now
            self._watch_returns(now)
        return ended

    def _watch_returns(self, now: float) -> None:
        """Record the delay from prefetch to use of the watched prefixes a request used since; stop
        watching those, and those gone from the tree or watched for longer than `max_ttl_s`."""
        keep: deque[tuple[float, TreeNode, int, TreeNode | None]] = deque(maxlen=WATCHED)
        for start, node, hits, parent in self._watched:
            if came_back(node, hits, parent):
                self.returns.append(now - start)
            elif node.parent is not None and now - start <= self.limits.max_ttl_s:
                keep.append((start, node, hits, parent))
        self._watched = keep

    def prefetch_hold_s(self) -> float:
        """How long a prefetched prefix is retained: `prefetch_retain_s`, or longer where the clients'
        prefetches are measured to come earlier than that: the `RETURN_QUANTILE` of the delays from
        prefetch to use (once `MIN_RETURNS` were seen), at most `max_ttl_s`. Still only advice within
        the tiers' shares and the cost test, like any retention."""
        base = self.limits.prefetch_retain_s
        late = late_return(self.returns)
        return base if late is None else min(self.limits.max_ttl_s, max(base, late))

    def shutdown(self) -> None:
        """End every retention now."""
        while self._retained:
            self._end(heapq.heappop(self._retained))

    @property
    def pins(self) -> int:
        """Retentions held now."""
        return len(self._retained)

    def summary(self) -> dict[str, object]:
        """What the server's stats (`hints`) and the benchmarks report."""
        return {
            "applied": dict(self.counts),
            "rejected": self.rejected,
            "refused": dict(self.refused),
            "retained": self.pins,
            "retained_tokens": self.pinned_tokens,
            "retained_used": self.retained_used,
            "retained_wasted": self.retained_wasted,
            "overdue": self.overdue,
            "precision": self.precision(),
            "kept_tokens": {str(getattr(t, "value", t)): n for t, n in self.refreshed_tokens.items()},
            "prefetch_hold_s": self.prefetch_hold_s(),
            "learned": {**self.learned, "precision": self.precision(learned=True)},
        }
