"""Achieved bandwidth per link, measured from completed copies (exponentially weighted)."""

from __future__ import annotations

import threading


class BandwidthMeter:
    """Bytes per second achieved on each link, as an EWMA over completed transfers.

    `estimate(link)` returns the measured figure, or the `prior` given for the link until the
    first measurement; `seconds_for(link, nbytes)` is what a scheduler uses to decide between
    waiting for a transfer and recomputing.
    """

    def __init__(self, priors: dict[str, float] | None = None, alpha: float = 0.3) -> None:
        self._priors = dict(priors or {})
        self._alpha = alpha
        self._ewma: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, link: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._ewma.get(link)
            self._ewma[link] = rate if old is None else (1 - self._alpha) * old + self._alpha * rate

    def estimate(self, link: str, default: float = 1e9) -> float:
        return self._ewma.get(link) or self._priors.get(link, default)

    def seconds_for(self, link: str, nbytes: int) -> float:
        return nbytes / self.estimate(link)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._ewma)
