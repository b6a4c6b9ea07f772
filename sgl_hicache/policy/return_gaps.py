"""When a conversation comes back, learned from its own past pauses: the server's view of a tool call.

A client that sends no hint still shows its rhythm. An agent's conversation comes back seconds after
each call that ended in a tool call, and minutes after one that waits for a person, and the server
sees which one a call ended in: in its own output (`Request.ends_in`; on SGLang, the tool-call
parser's start token in the output, `sglang/tool_endings.py`). `ReturnGaps` keeps, per
conversation, the time its previous request ended and its last few pauses (end to the next arrival)
by what that request ended in, and over every conversation the latest pauses of each ending.

After a call that ended in a tool call, the pause expected is one the conversation's own pauses
after tool calls (or, before it has two, every conversation's) exceeded only one time in ten: a
retention that ends before the conversation comes back keeps its room for nothing, and what it is
worth against the pages it displaces is priced where it is ranked (`control/hint_desk.py`). After an
answer to a person none is expected: a person's pause is minutes, past what a retention is worth.
Where the ending is unknown (no tool-call parser), the median of the conversation's last pauses.

A conversation is named by the tree, never by the client: by the first page key of the node its last
request ended in (`TreeNode.keys[0]`), the key the upper part keeps when a later request splits that
node (a next turn that diverges inside the last page). Its next request's match passes through that
node, or through its upper part.

Pure decision code: the controller reports arrivals and commits with the keys of the matched path;
the model answers with the expected pause.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median

PAUSES_KEPT = 4  # a conversation's latest pauses that predict its next one
MIN_PAUSES = 2  # pauses seen before a conversation's next one is predicted (ending unknown)
POPULATION_KEPT = 256  # every conversation's latest pauses after each ending
MIN_POPULATION = 8  # pauses after an ending seen before a conversation's first one is predicted by them
CONVERSATIONS_KEPT = 8192  # conversations remembered at once (the least recently active forgotten)
SEARCH_DEPTH = 64  # nodes above a request's end searched for its conversation's previous end
COVERED = 0.9  # the share of past pauses after a tool call the expected one covers


def _upper(pauses: deque[float]) -> float:
    """The pause `COVERED` of `pauses` did not exceed (nearest rank)."""
    xs = sorted(pauses)
    return xs[min(len(xs) - 1, int(COVERED * len(xs)))]


def _pauses() -> deque[float]:
    return deque(maxlen=PAUSES_KEPT)


@dataclass
class Conversation:
    """One conversation: when its last request was committed, what it ended in (None: unknown),
    whether its next one came since, and its latest pauses (commit -> next arrival, seconds), of any
    kind and by ending."""

    committed_at: float
    waiting: bool = True
    ending: str | None = None
    pauses: deque[float] = field(default_factory=_pauses)
    after: dict[str, deque[float]] = field(default_factory=dict)


class ReturnGaps:
    """Per-conversation pause history (module docstring).

    Contract:
    - `arrived(keys, now)`: a request matched the path whose nodes' first page keys are `keys`
      (root first); the deepest key that names a waiting conversation records its pause. Returns
      that pause (None: no conversation of this path was waiting).
    - `committed(keys, now, ending)`: the request's path was committed at its end, which was
      `ending` (`records.ENDS_IN`, None: unknown); its conversation (the deepest known key on the
      path, moved to the path's last key) waits from `now`. Returns the expected pause (module
      docstring), None while too few pauses were seen to say.
    - Memory is bounded by `CONVERSATIONS_KEPT`; each call is O(`SEARCH_DEPTH`).
    """

    def __init__(self) -> None:
        self._by_key: OrderedDict[object, Conversation] = OrderedDict()
        self.pauses_seen = 0
        self.population: dict[str, deque[float]] = {}  # every conversation's latest pauses, by ending

    def _find(self, keys: Sequence[object]) -> tuple[object, Conversation] | None:
        for key in reversed(keys[-SEARCH_DEPTH:]):
            conv = self._by_key.get(key)
            if conv is not None:
                return key, conv
        return None

    def arrived(self, keys: Sequence[object], now: float) -> float | None:
        found = self._find(keys)
        if found is None or not found[1].waiting:
            return None
        conv = found[1]
        pause = max(0.0, now - conv.committed_at)
        conv.pauses.append(pause)
        if conv.ending is not None:
            conv.after.setdefault(conv.ending, _pauses()).append(pause)
            self.population.setdefault(conv.ending, deque(maxlen=POPULATION_KEPT)).append(pause)
        conv.waiting = False
        self.pauses_seen += 1
        return pause

    def committed(self, keys: Sequence[object], now: float, ending: str | None = None) -> float | None:
        if not keys:
            return None
        found = self._find(keys)
        if found is not None:
            old_key, conv = found
            del self._by_key[old_key]
        else:
            conv = Conversation(now)
        conv.committed_at, conv.waiting, conv.ending = now, True, ending
        self._by_key[keys[-1]] = conv
        self._by_key.move_to_end(keys[-1])
        while len(self._by_key) > CONVERSATIONS_KEPT:
            self._by_key.popitem(last=False)
        if ending is None:
            return median(conv.pauses) if len(conv.pauses) >= MIN_PAUSES else None
        if ending != "tool":
            return None
        own = conv.after.get(ending)
        if own and len(own) >= MIN_PAUSES:
            return _upper(own)
        everyone = self.population.get(ending)
        return _upper(everyone) if everyone is not None and len(everyone) >= MIN_POPULATION else None

    def __len__(self) -> int:
        return len(self._by_key)


__all__ = ["MIN_PAUSES", "MIN_POPULATION", "Conversation", "ReturnGaps"]
