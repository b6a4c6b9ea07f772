"""When a conversation comes back, learned from its own past pauses: the server's view of a tool call.

A client that sends no hint still shows its rhythm. An agent's conversation comes back seconds after
each call that ended in a tool call, and minutes after one that waits for a person; a conversation
whose last pauses were short is likely to pause briefly again. `ReturnGaps` keeps, per conversation,
the time its previous request was committed and its last few pauses (commit to the next arrival),
and expects the next pause to be the median of them.

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
MIN_PAUSES = 2  # pauses seen before a conversation's next one is predicted
CONVERSATIONS_KEPT = 8192  # conversations remembered at once (the least recently active forgotten)
SEARCH_DEPTH = 64  # nodes above a request's end searched for its conversation's previous end


@dataclass
class Conversation:
    """One conversation: when its last request was committed, whether its next one came since,
    and its latest pauses (commit -> next arrival, seconds)."""

    committed_at: float
    waiting: bool = True
    pauses: deque[float] = field(default_factory=lambda: deque(maxlen=PAUSES_KEPT))


class ReturnGaps:
    """Per-conversation pause history (module docstring).

    Contract:
    - `arrived(keys, now)`: a request matched the path whose nodes' first page keys are `keys`
      (root first); the deepest key that names a waiting conversation records its pause. Returns
      that pause (None: no conversation of this path was waiting).
    - `committed(keys, now)`: the request's path was committed; its conversation (the deepest known
      key on the path, moved to the path's last key) waits from `now`. Returns the expected pause
      (None until `MIN_PAUSES` were seen in this conversation).
    - Memory is bounded by `CONVERSATIONS_KEPT`; each call is O(`SEARCH_DEPTH`).
    """

    def __init__(self) -> None:
        self._by_key: OrderedDict[object, Conversation] = OrderedDict()
        self.pauses_seen = 0

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
        conv.waiting = False
        self.pauses_seen += 1
        return pause

    def committed(self, keys: Sequence[object], now: float) -> float | None:
        if not keys:
            return None
        found = self._find(keys)
        if found is not None:
            old_key, conv = found
            del self._by_key[old_key]
        else:
            conv = Conversation(now)
        conv.committed_at, conv.waiting = now, True
        self._by_key[keys[-1]] = conv
        self._by_key.move_to_end(keys[-1])
        while len(self._by_key) > CONVERSATIONS_KEPT:
            self._by_key.popitem(last=False)
        return median(conv.pauses) if len(conv.pauses) >= MIN_PAUSES else None

    def __len__(self) -> int:
        return len(self._by_key)


__all__ = ["MIN_PAUSES", "Conversation", "ReturnGaps"]
