"""Re-warm at start on the SGLang server (`control/rewarm.py` does the work, as in the embedded engine).

At start, a server on a disk directory that holds a re-warm record brings the prefixes it names disk
-> host in the background (`start_rewarm`, assigned to `controller.rewarm`: the controller counts its
copies as in flight and cancels them at shutdown). Every scheduler step steps it (plans and polls
only) and ticks the `RewarmRecorder`, which every `rewarm_interval_s` chooses the hottest paths on
the scheduler thread and hands them to a `RecordWriter`, whose own thread writes the file: SGLang
stops its scheduler with SIGKILL, so the periodic record is what the next server finds.

Tensor parallelism: only where the cache has no rank consensus (TP = 1, or each DP rank's tree of
one rank). At TP >= 2 the ranks' records may differ (each rank's process is killed at its own
moment, after its own last record), and a re-warm that adopts and promotes different pages on
different ranks would make their trees diverge; it is off there (`disabled` says why).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..cache.rewarm_record import RecordWriter
from ..control.rewarm import RewarmRecorder, rewarm_record_path, save_rewarm, start_rewarm

if TYPE_CHECKING:
    from ..cache import TieredCache
    from ..client.backend_settings import BackendSettings
    from ..control.lifecycle import RequestController


class ServerRewarm:
    """The backend's re-warm and record keeping (module docstring).

    Contract:
    - Built once with the backend; does nothing (`disabled` names why) when `settings.rewarm` is
      off, the cache is disabled or has no disk directory, or the TP ranks would have to agree on it
      (`ranks_agree`: the backend has a `RankConsensus`).
    - `step()` runs on the scheduler thread once per scheduling step: it steps the re-warm when the
      controller's `advance_predictions` (which steps it too) did not, and ticks the recorder; it
      never waits and never writes a file on that thread.
    - `stop()` (a clean shutdown, after the controller's) saves a last record and stops the writer.
    - `counters()` is read by the stats (any thread: plain figures).
    """

    def __init__(
        self,
        cache: TieredCache,
        controller: RequestController,
        settings: BackendSettings,
        *,
        ranks_agree: bool = False,
        cache_disabled: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.controller = controller
        self.disabled = ""
        if cache_disabled:
            self.disabled = "the cache is disabled"
        elif not settings.rewarm:
            self.disabled = "off (rewarm=false)"
        elif rewarm_record_path(cache) is None:
            self.disabled = "no disk directory"
        elif ranks_agree:
            self.disabled = "off at TP >= 2 (the ranks would have to agree on it)"
        self.writer: RecordWriter | None = None
        self.recorder: RewarmRecorder | None = None
        if self.disabled:
            return
        controller.rewarm = start_rewarm(cache, controller.executor)
        self.writer = RecordWriter()
        self.recorder = RewarmRecorder(cache, settings.rewarm_interval_s, clock, write=self.writer.submit)

    def step(self) -> None:
        if self.recorder is None:
            return
        rw = self.controller.rewarm
        if rw is not None and rw.active and not self.controller.predicted:
            rw.step()  # (with predictions in flight, `advance_predictions` steps it)
        self.recorder.tick()

    def stop(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        save_rewarm(self.cache)
        self.writer = None

    def counters(self) -> dict[str, Any]:
        """What the stats show: whether it runs, the re-warm's progress, the records kept."""
        rw = self.controller.rewarm
        out: dict[str, Any] = {"enabled": not self.disabled, "disabled": self.disabled}
        if rw is not None:
            out.update(rw.counters(), jobs_in_flight=len(rw.jobs))
        else:
            out.update(
                recorded_paths=0, paths_done=0, stopped="no record" if not self.disabled else "", jobs_in_flight=0
            )
        if self.recorder is not None and self.writer is not None:
            out.update(records_saved=self.recorder.saved, records_written=self.writer.written)
        return out


__all__ = ["ServerRewarm"]
