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


class SpeculativePacer:
    """Token bucket per link: speculative copies may use at most `share` of the link's measured
    bandwidth (bytes refill at `share * meter.estimate(link)` per second, up to `burst_s` seconds'
    worth). A chunk larger than the bucket passes when the bucket is full, so nothing starves.

    This is what keeps prediction from turning a latency problem into a throughput problem: demand
    copies are never paced, speculative ones never take more than their share of the link.
    """

    def __init__(self, meter: BandwidthMeter, share: float = 0.5, burst_s: float = 0.25, clock=None) -> None:
        if not 0 < share <= 1 or burst_s <= 0:
            raise ValueError(f"SpeculativePacer needs 0 < share <= 1 and burst_s > 0, got {share}, {burst_s}")
        import time

        self.meter = meter
        self.share = share
        self.burst_s = burst_s
        self.clock = clock or time.monotonic
        self._tokens: dict[str, float] = {}
        self._stamp: dict[str, float] = {}

    def try_take(self, link: str, nbytes: int) -> bool:
        rate = self.share * self.meter.estimate(link)
        cap = rate * self.burst_s
        now = self.clock()
        tokens = min(cap, self._tokens.get(link, cap) + rate * (now - self._stamp.get(link, now)))
        self._stamp[link] = now
        if tokens >= nbytes or tokens >= cap:
            self._tokens[link] = tokens - nbytes
            return True
        self._tokens[link] = tokens
        return False
