"""Replay progress for the command line: a `tqdm` bar on a terminal, plain lines in a log, or nothing.

`Progress(quiet=False)` is called as ``progress(label, done, total, hit_rate=None)`` (thread-safe: the
HTTP replayer calls it from its worker threads; `total` may be None when a streamed trace's length is
unknown; `hit_rate` is the hit rate of the requests finished so far, when the caller knows it). Where
it writes (stderr by default) decides the form:

- a terminal: one `tqdm` bar per label (requests done / total, requests/s, ETA, ``hit=29.4%``);
- anything else (a file, a pipe, CI): a plain line ``replay predict: 120/300 requests (40%), 12.3 s,
  9.8 req/s, ETA 18 s, hit 29.4%`` at most every `interval_s` seconds and once at the end; never a
  carriage return;
- ``quiet=True``: nothing.

Why tqdm (not rich): it is what SGLang's own `bench_serving` uses, so the SGLang environment already has
it; it is one small pure-Python package with no dependencies of its own, and a replay needs a bar, not
rich's layout engine.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any


class Progress:
    def __init__(
        self, quiet: bool = False, stream: IO[str] | None = None, interval_s: float = 10.0, terminal: bool | None = None
    ) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        if terminal is None:
            isatty = getattr(self.stream, "isatty", None)
            terminal = bool(isatty and isatty())
        self.terminal = terminal
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._bars: dict[str, Any] = {}
        self._started: dict[str, float] = {}
        self._last_line: dict[str, float] = {}

    def __call__(self, label: str, done: int, total: int | None, hit_rate: float | None = None) -> None:
        if self.quiet:
            return
        with self._lock:
            if self.terminal:
                self._bar(label, done, total, hit_rate)
            else:
                self._line(label, done, total, hit_rate)

    def callback(self, label: str):
        """``(done, total, hit_rate=None) -> None`` for one label (what the replay functions take)."""
        return lambda done, total, hit_rate=None: self(label, done, total, hit_rate)

    def _bar(self, label: str, done: int, total: int | None, hit_rate: float | None) -> None:
        from tqdm import tqdm

        bar = self._bars.get(label)
        if bar is None:
            bar = self._bars[label] = tqdm(
                total=total, desc=label, unit="req", file=self.stream, dynamic_ncols=True, leave=True
            )
        if hit_rate is not None and (done - bar.n >= 100 or (total is not None and done >= total) or bar.n == 0):
            bar.set_postfix_str(f"hit={100 * hit_rate:.1f}%", refresh=False)
        bar.update(done - bar.n)
        if total is not None and done >= total:
            bar.close()
            del self._bars[label]

    def _line(self, label: str, done: int, total: int | None, hit_rate: float | None) -> None:
        now = time.monotonic()
        start = self._started.setdefault(label, now)
        final = total is not None and done >= total
        if not final and now - self._last_line.get(label, start) < self.interval_s:
            return
        self._last_line[label] = now
        elapsed = now - start
        rate = f", {done / elapsed:.1f} req/s" if elapsed > 0 else ""
        if total is not None and elapsed > 0 and 0 < done < total:
            rate += f", ETA {(total - done) * elapsed / done:.0f} s"
        hit = f", hit {100 * hit_rate:.1f}%" if hit_rate is not None else ""
        of = f"/{total} requests ({100 * done / max(total, 1):.0f}%)" if total is not None else " requests"
        self.stream.write(f"replay {label}: {done}{of}, {elapsed:.1f} s{rate}{hit}\n")
        self.stream.flush()
        if final:
            self._started.pop(label, None)
            self._last_line.pop(label, None)

    def close(self) -> None:
        with self._lock:
            for bar in self._bars.values():
                bar.close()
            self._bars.clear()


__all__ = ["Progress"]
