"""Shadow bets: the predictions a trigger would make, judged without moving a byte.

A trigger with no record (a kind of prediction the tree walk has not made yet) would otherwise bet
real copies on the traffic of one earlier request, and those first bets were the ones that missed:
an agentic replay's first prediction brought a 14.6k-token branch that no request used. Instead its
picks are written down here; a request that arrives through a pick within the horizon uses it, and
at the horizon the rest of the bet is wasted. The guard lets the trigger make real copies once its
shadow record is as good as it asks of real ones (`PromotionGuard.proven`).

Pure bookkeeping: it reads node ids and token counts; it never moves bytes or changes the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..tree.node import TreeNode


@dataclass
class _Bet:
    trigger: str
    expires_s: float
    open: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # node id -> (tokens, ready, gone)
    hit: bool = False  # a request used one of its picks


class ShadowBets:
    """Per trigger, the tokens of shadow picks that a request used, or that went unused.

    Contract:
    - `bet(trigger, picks, now, horizon_s)`: writes down `(node, tokens, ready_s, gone_s)` picks,
      open until `now + horizon_s`; its copy would have landed at `ready_s` and been evicted again
      by `gone_s`. A node already open in an earlier bet is not bet on again.
    - `observe(path, now)`: a request was admitted through `path` (its match, root first); every
      open pick on it counts `used` for its trigger if its copy would have been there at `now`
      (`ready_s <= now <= gone_s`), and `wasted` if not (a copy still on its way saves the request
      little: the demand load reads it, or the request recomputes it; one already evicted, nothing).
      Bets past their horizon count their unused tokens `wasted` first (so a late request never
      saves an expired bet).
    - `judged[trigger]`: its bets with an outcome: one of their picks used, or none by the horizon
      (a bet of four siblings is judged by the first request through one of them in time).
    - A pick is known by its node's id: a node split after the bet keeps the id in its lower part,
      so a request that stops in the upper part does not use it (the record errs on the side of
      silence).
    - `live`: the triggers the guard has let go real (`speculation.predict` adds them); no longer
      shadowed.
    """

    def __init__(self) -> None:
        self.used: Counter[str] = Counter()
        self.wasted: Counter[str] = Counter()
        self.judged: Counter[str] = Counter()  # bets with an outcome: a pick used, or none by the horizon
        self.live: set[str] = set()
        self._open: dict[int, _Bet] = {}
        self._heap: list[tuple[float, int, _Bet]] = []
        self._seq = itertools.count()

    def bet(
        self, trigger: str, picks: Iterable[tuple[TreeNode, int, float, float]], now: float, horizon_s: float
    ) -> int:
        """Returns the tokens written down."""
        self.expire(now)
        bet = _Bet(trigger, now + horizon_s)
        for node, tokens, ready_s, gone_s in picks:
            if node.id not in self._open and tokens > 0:
                bet.open[node.id] = (tokens, ready_s, gone_s)
                self._open[node.id] = bet
        if bet.open:
            heapq.heappush(self._heap, (bet.expires_s, next(self._seq), bet))
        return sum(t for t, _, _ in bet.open.values())

    def observe(self, path: Iterable[TreeNode], now: float) -> None:
        self.expire(now)
        if not self._open:
            return
        for node in path:
            bet = self._open.pop(node.id, None)
            if bet is not None:
                tokens, ready_s, gone_s = bet.open.pop(node.id)
                if not ready_s <= now <= gone_s:  # not there yet, or not any more
                    self.wasted[bet.trigger] += tokens
                    continue
                self.used[bet.trigger] += tokens
                if not bet.hit:
                    bet.hit = True
                    self.judged[bet.trigger] += 1

    def expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, bet = heapq.heappop(self._heap)
            if not bet.hit:
                self.judged[bet.trigger] += 1
            for node_id, (tokens, _, _) in bet.open.items():
                self.wasted[bet.trigger] += tokens
                del self._open[node_id]
            bet.open.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        """Per trigger: shadow tokens used and wasted so far, and whether it went live."""
        return {
            t: {
                "used_tokens": self.used[t],
                "wasted_tokens": self.wasted[t],
                "bets_judged": self.judged[t],
                "live": t in self.live,
            }
            for t in sorted(set(self.used) | set(self.wasted) | self.live)
        }
