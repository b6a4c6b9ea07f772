"""The per-step scheduler log (`sgl_hicache.sglang.debug.batch_log`, a diagnostic of batch composition): off
unless `SGLH_BATCH_LOG_DIR` is set; then one JSON line per scheduling pass with a queue or an
admission, and one per forward batch."""

from __future__ import annotations

import json
from types import SimpleNamespace

from sgl_hicache.sglang.debug import batch_log


def test_off_unless_the_directory_is_named(monkeypatch):
    monkeypatch.delenv(batch_log.ENV, raising=False)
    assert batch_log.register_if_enabled() is False


def test_passes_and_batches_are_logged_as_json_lines(monkeypatch, tmp_path):
    monkeypatch.setenv(batch_log.ENV, str(tmp_path))
    monkeypatch.setattr(batch_log, "_out", None)
    queued = [SimpleNamespace(rid="a"), SimpleNamespace(rid="b")]
    scheduler = SimpleNamespace(waiting_queue=queued)
    admitted = SimpleNamespace(rid="a", extend_len=96, prefix_len=32, host_hit_length=16)
    plan = SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[admitted]))
    batch_log.note_queue(scheduler)
    assert batch_log.note_admitted(plan, scheduler) is plan
    batch_log.note_queue(SimpleNamespace(waiting_queue=[]))
    batch_log.note_admitted(SimpleNamespace(batch_to_run=None), scheduler)  # an empty pass: not logged
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(name="EXTEND"), launch_ts=5.0, reqs=[admitted], extend_num_tokens=96
    )
    assert batch_log.note_batch("r", scheduler, batch) == "r"
    batch_log._out.close()
    lines = [json.loads(x) for x in next(tmp_path.glob("batches-*.jsonl")).read_text().splitlines()]
    assert [x["ev"] for x in lines] == ["pass", "batch"]
    assert lines[0]["queue"] == ["a", "b"] and lines[0]["admitted"] == [["a", 96, 32, 16]]
    assert (
        lines[1]["mode"] == "EXTEND"
        and lines[1]["n"] == 1
        and lines[1]["tokens"] == 96
        and lines[1]["t1"] >= lines[1]["t0"]
    )
