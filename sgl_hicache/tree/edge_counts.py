"""Per-child float counts of one tree node, rebased (multiplied by a decay factor) at C speed."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

try:  # optional: rebasing a node with thousands of children multiplies them at C speed
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with torch
    _np = None  # type: ignore[assignment]  # (then the pure-Python path)

# below this many slots a rebase multiplies in a Python loop (a numpy view, ~1.7 µs, costs more)
_VECTOR_MIN = 16


class EdgeCounts:
    """`TreeNode.child_traffic`: a float per child key, read like a dict (`[]`, `get`, `in`, `len`,
    `items`, `pop`, iteration in insertion order, as a dict's), stored as a float64 `array` behind a
    key -> slot dict, so that `scale` (the rebase of every count by one decay factor) is one
    vectorised multiply: the very floats of ``for k in d: d[k] *= f`` (IEEE products, element by
    element), at C speed. A node with thousands of children (the shared system prompt's) is rebased
    about once a virtual second; a Python loop over its children was the replay's top cost.

    Freed slots (`pop`) are reused; their stale values are scaled along and overwritten on reuse.
    """

    __slots__ = ("_slot", "_vals", "_free")

    def __init__(self, items: dict[bytes, float] | None = None) -> None:
        self._slot: dict[bytes, int] = {}
        self._vals = array("d")
        self._free: list[int] = []
        for k, v in (items or {}).items():
            self[k] = v

    def __len__(self) -> int:
        return len(self._slot)

    def __bool__(self) -> bool:
        return bool(self._slot)

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._slot)

    def __getitem__(self, key: bytes) -> float:
        return self._vals[self._slot[key]]

    def get(self, key: bytes, default: float | None = None) -> float | None:
        i = self._slot.get(key)
        return default if i is None else self._vals[i]

    def __setitem__(self, key: bytes, value: float) -> None:
        i = self._slot.get(key)
        if i is None:
            if self._free:
                i = self._free.pop()
            else:
                i = len(self._vals)
                self._vals.append(0.0)
            self._slot[key] = i
        self._vals[i] = value

    def add(self, key: bytes, amount: float) -> None:
        """``self[key] = self.get(key, 0.0) + amount`` in one call (it runs per edge of every request)."""
        i = self._slot.get(key)
        if i is None:
            self[key] = amount
        else:
            self._vals[i] += amount

    def pop(self, key: bytes, default: float | None = None) -> float | None:
        i = self._slot.pop(key, None)
        if i is None:
            return default
        self._free.append(i)
        return self._vals[i]

    def items(self) -> list[tuple[bytes, float]]:
        vals = self._vals
        return [(k, vals[i]) for k, i in self._slot.items()]

    def values(self) -> list[float]:
        vals = self._vals
        return [vals[i] for i in self._slot.values()]

    def scale(self, factor: float) -> None:
        """Multiply every count by `factor` (exactly as one float multiply each)."""
        vals = self._vals
        n = len(vals)
        if _np is not None and n >= _VECTOR_MIN:
            view = _np.frombuffer(vals, dtype=_np.float64)
            view *= factor
            del view  # the array may grow again only once no view exports its buffer
        else:
            for i in range(n):
                vals[i] *= factor
