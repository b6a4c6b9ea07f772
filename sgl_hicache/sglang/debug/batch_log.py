"""A per-step log of SGLang's scheduler, for any radix cache (ours, SGLang's HiCache, its default):
which requests wait in the queue at each scheduling pass, which are admitted with how many tokens
to compute, and how long each forward batch ran. A diagnostic for comparing two servers' batch
composition: it writes a JSON line from the scheduler thread per pass, so it is off
unless `SGLH_BATCH_LOG_DIR` names a directory (one file per scheduler process, `batches-<pid>.jsonl`).

Records:
- `{"ev": "pass", "t", "queue": [rid, ...], "admitted": [[rid, extend, cached, host_hit], ...]}`:
  after `get_new_batch_prefill`, when the queue or the admissions are not empty. `queue` is the
  waiting queue before the pass; `extend` the tokens this prefill runs (SGLang's `extend_len`),
  `cached` its device prefix, `host_hit` the part loaded from host or storage.
- `{"ev": "batch", "t0", "t1", "mode", "n", "tokens"}`: after `process_batch_result`, from the
  batch's launch to the end of its result processing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

from ..scheduler_hooks import GET_NEW_BATCH_PREFILL, PROCESS_BATCH_RESULT

ENV = "SGLH_BATCH_LOG_DIR"

_out: TextIO | None = None
_queue_before: list[str] = []


def _write(rec: dict[str, Any]) -> None:
    global _out
    if _out is None:
        _out = open(Path(os.environ[ENV]) / f"batches-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    _out.write(json.dumps(rec) + "\n")


def note_queue(scheduler, *args, **kwargs):
    """BEFORE `get_new_batch_prefill`: the waiting queue as this pass finds it."""
    global _queue_before
    _queue_before = [r.rid for r in getattr(scheduler, "waiting_queue", ())]
    return None


def note_admitted(result, scheduler, *args, **kwargs):
    """AFTER `get_new_batch_prefill`: the requests this pass admitted."""
    batch = getattr(result, "batch_to_run", result)
    reqs = getattr(batch, "reqs", None) or ()
    admitted = [
        [
            r.rid,
            int(getattr(r, "extend_len", 0) or 0),
            int(getattr(r, "prefix_len", 0) or 0),
            int(getattr(r, "host_hit_length", 0) or 0),
        ]
        for r in reqs
    ]
    if _queue_before or admitted:
        _write({"ev": "pass", "t": time.monotonic(), "queue": _queue_before, "admitted": admitted})
    return result


def note_batch(result, scheduler, batch=None, *args, **kwargs):
    """AFTER `process_batch_result`: one forward batch, launch to processed."""
    mode = getattr(batch, "forward_mode", None)
    if mode is not None:
        _write(
            {
                "ev": "batch",
                "t0": getattr(batch, "launch_ts", None),
                "t1": time.monotonic(),
                "mode": getattr(mode, "name", str(mode)),
                "n": len(getattr(batch, "reqs", ()) or ()),
                "tokens": int(getattr(batch, "extend_num_tokens", 0) or 0),
            }
        )
    return result


def register_if_enabled() -> bool:
    """Register the three hooks when `SGLH_BATCH_LOG_DIR` is set; True if registered."""
    if not os.environ.get(ENV):
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GET_NEW_BATCH_PREFILL, note_queue, HookType.BEFORE)
    HookRegistry.register(GET_NEW_BATCH_PREFILL, note_admitted, HookType.AFTER)
    HookRegistry.register(PROCESS_BATCH_RESULT, note_batch, HookType.AFTER)
    return True
