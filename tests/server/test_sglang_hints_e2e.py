"""The hint API end to end: a real SGLang 0.5.23 server on CPU (`--radix-cache-backend sgl_hicache`,
`SGLHICACHE_HINT_PORT=0`), hints sent over HTTP, their effect read from the server's stats.

One server (device pool 1,024 tokens, page 16, host 2,048, disk on, predictor off, prefetch on), the
tiny Llama with realistic random weights (`test_sglang_e2e.make_model`, so that wrong KV changes the
output):
- bad hints are refused at the door with 400 and the field named (an id outside the vocabulary, a
  prefix shorter than a page, a pin larger than 50 % of the host tier, a pin past 600 s, a session);
- `prefetch` of a prefix demoted to disk brings it to host before it is asked for: the request then
  hits host, not disk (a control prompt without the hint hits disk), the promoted tokens count as
  used, and its greedy output equals the one computed from scratch;
- `pin` keeps a prefix off disk through a flood (retained, never locked), and once the prefix comes
  back its retention ends: nothing is retained and no device page is protected;
- after a flush (device and host empty, disk files kept), a `prefetch` brings the prefix up from disk
  and carries it on to the device's free pages: the request then hits device for the whole prefix,
  with the output computed from scratch before;
- the HTTP replayer (`replay_http`, and `sgl-hicache replay --url`) sends a trace's hints at their
  time, counts a refused one with its reason, and the outputs equal those of the same trace without
  hints; a dead hint API fails the command before anything is sent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from servers import CHECKED, BackendServers, flush_cache
from test_sglang_e2e import HIT, PAGE, VOCAB, _flood, _gen, _prompt, _settled_pool, _wait_for, make_model

REPO = Path(__file__).resolve().parents[2]
DEVICE_TOKENS = 1024
HOST_TOKENS = 2048  # pins may hold 50 %: 1024 tokens
FLOOD = 14  # x 300 tokens: more than device + host, so the oldest prompts end on disk only


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("hints_e2e")
    env = {**CHECKED, "SGLHICACHE_HINT_PORT": "0", "SGLHICACHE_PREDICTOR": "none"}
    servers = BackendServers(
        make_model(work / "model"), work, page=PAGE, host_tokens=HOST_TOKENS, device_tokens=DEVICE_TOKENS, env=env
    )
    try:
        yield servers.start("server", work / "disk")
    finally:
        servers.close()
        shutil.rmtree(work, ignore_errors=True)


def _stats(srv) -> dict:
    from sgl_hicache.client.stats_client import fetch_stats

    return fetch_stats(srv.url)


def _hint_url(srv) -> str:
    from sgl_hicache.replay.hint_client import hint_api_url

    url = hint_api_url(srv.url, _stats(srv))
    assert url is not None, "the server's stats name no hint API"
    return url


def _post(srv, *hints: dict) -> tuple[int, dict]:
    from sgl_hicache.replay.hint_client import post_hints

    return post_hints(_hint_url(srv), list(hints))


def _predicted(st: dict) -> dict:
    return st["prefetch"]["predict"]


def test_bad_hints_are_refused_with_the_field_named(server):
    before = _stats(server)["hints"]
    ok = _prompt(10, 64)
    cases = [
        (
            {"action": "prefetch", "input_ids": ok[:20] + [VOCAB + 5]},
            f"hint 0: 'input_ids' holds token id {VOCAB + 5}, outside the vocabulary",
        ),
        (
            {"action": "prefetch", "input_ids": ok[: PAGE - 1]},
            "hint 0: 'input_ids': a hint's prefix must hold at least one whole page (16 tokens)",
        ),
        (
            {"action": "pin", "input_ids": _prompt(11, 1200), "ttl_s": 5},
            "hint 0: pin of 1200 tokens is over 50% of the 2048-token host tier (1024 tokens)",
        ),
        (
            {"action": "pin", "input_ids": ok, "ttl_s": 3600},
            "hint 0: 'ttl_s' of 3600 s exceeds the longest allowed, 600 s",
        ),
        ({"action": "retain", "session": "s1"}, "hint 0: the hint API names prefixes by 'input_ids'"),
        ({"action": "evict", "input_ids": ok}, "hint 0: 'action' must be one of prefetch, pin, retain, demote"),
    ]
    for hint, words in cases:
        code, answer = _post(server, hint)
        assert code == 400 and words in answer["error"], (hint.get("action"), code, answer)
    code, answer = _post(server, {"action": "retain", "input_ids": ok}, {"action": "pin", "input_ids": ok, "ttl_s": 0})
    assert code == 400 and answer["error"].startswith("hint 1: 'ttl_s' must be > 0"), answer  # the whole batch refused
    after = _stats(server)["hints"]
    assert (
        after["applied"] == before["applied"] and after["rejected"] == before["rejected"]
    )  # none reached the scheduler


def test_prefetch_hint_brings_a_demoted_prefix_to_host_before_it_is_asked_for(server):
    hinted, control = _prompt(20, 320), _prompt(21, 320)
    ref_hinted, _ = _gen(server, hinted)
    ref_control, _ = _gen(server, control)
    _flood(server, 22, FLOOD)
    _settled_pool(server)  # write-through to disk landed: both prompts are disk-only now
    before = _stats(server)
    assert _post(server, {"action": "prefetch", "input_ids": hinted}) == (202, {"queued": 1})

    def landed():
        st = _stats(server)
        return (
            st
            if (
                st["hints"]["applied"]["prefetch"] > before["hints"]["applied"]["prefetch"]
                and _predicted(st)["promoted_tokens"] > _predicted(before)["promoted_tokens"]
            )
            else None
        )

    mid = _wait_for(landed, "the prefetch hint's promotion to land")
    promoted = _predicted(mid)["promoted_tokens"] - _predicted(before)["promoted_tokens"]
    assert promoted == HIT + PAGE, (promoted, mid["hints"])  # the whole cached prefix (20 pages) came up disk -> host
    assert mid["promoted_tokens"]["host"] - before["promoted_tokens"]["host"] >= promoted

    out, hits = _gen(server, hinted)
    assert out == ref_hinted
    assert hits["storage"] == 0 and hits["host"] + hits["device"] == HIT, hits  # served from the promotion
    after = _stats(server)
    assert _predicted(after)["used_tokens"] - _predicted(before)["used_tokens"] >= HIT  # counted as used hits
    out, hits = _gen(server, control)  # the same history, no hint: its pages come from disk
    assert out == ref_control
    assert hits["storage"] > 0, hits


def _no_retention_left(server) -> None:
    """Wait until no retention is held (an earlier test's prefetch is retained for its hold, 10 s here,
    and ends on time when its request used only part of the prefix); the scheduler is kept stepping."""
    probe = _prompt(34, 16)

    def none_left():
        _gen(server, probe, 1)
        return _stats(server)["hints"]["pins"] == 0

    _wait_for(none_left, "earlier tests' retentions to end")


def test_a_pin_holds_its_prefix_until_it_comes_back(server):
    _no_retention_left(server)
    pinned = _prompt(30, 320)
    ref, _ = _gen(server, pinned)
    ttl = 300.0  # longer than any flood here: the retention ends when its prefix comes back
    assert _post(server, {"action": "pin", "input_ids": pinned, "ttl_s": ttl}) == (202, {"queued": 1})
    st = _wait_for(lambda: (s := _stats(server))["hints"]["pins"] == 1 and s, "the pin to be applied")
    assert st["hints"]["pinned_tokens"] == HIT + PAGE  # prompt + output pages the first request inserted
    _flood(server, 31, FLOOD)
    assert _stats(server)["hints"]["pins"] == 1
    out, hits = _gen(server, pinned)
    assert out == ref
    # retained, not locked: served whole from the tiers (retention refreshes its recency each step, so on a
    # loaded machine a flood can still push it below host: where it lands is not asserted here)
    assert hits["device"] + hits["host"] + hits["storage"] == HIT, hits
    # the conversation comes back (its prompt, the answer, a new question): the retention ends at the
    # next refresh (a scheduler step)
    _, hits = _gen(server, pinned + ref + _prompt(33, 32))
    assert hits["device"] + hits["host"] + hits["storage"] == HIT + PAGE, hits
    probe = _prompt(32, 16)

    def ended():
        _gen(server, probe, 1)
        s = _stats(server)
        return s if s["hints"]["pins"] == 0 else None

    st = _wait_for(ended, "the retention to end once its prefix came back")
    assert st["hints"]["pinned_tokens"] == 0
    pool = _settled_pool(server)["pool"]
    assert pool["protected_tokens"] == 0 and pool["check"] == "ok", pool


def _trace(hints: bool) -> list:
    """Two sessions; the second's first request carries hints: a prefetch of session a (its latest
    prompt), a pin of its own head 3 s later, and a pin too long to be allowed."""
    from sgl_hicache.policy.hint_rules import Hint
    from sgl_hicache.replay.trace import Request

    a1, b1 = _prompt(40, 320), _prompt(41, 320)
    a2 = a1 + _prompt(42, 48)
    hs = (
        (
            Hint("prefetch", session="a"),
            Hint("pin", input_ids=tuple(b1[:64]), ttl_s=2.0, after_s=3.0),
            Hint("pin", input_ids=tuple(b1[:64]), ttl_s=9000.0),
        )
        if hints
        else ()
    )
    # b/1 (and with it the prefetch of session a) comes once a/1 has had time to finish even on a loaded
    # 2-core machine: a prefetch of a prefix not yet in the tree has nothing to act on
    rows = [("a/1", "a", 0.0, a1, ()), ("b/1", "b", 3.0, b1, hs), ("a/2", "a", 4.0, a2, ())]
    return [Request(rid, s, t, array("q", ids), 4, i + 1, hints=h) for i, (rid, s, t, ids, h) in enumerate(rows)]


def test_the_http_replayer_sends_a_traces_hints_and_outputs_equal_without(server, tmp_path):
    from sgl_hicache.replay.http import replay_http

    _no_retention_left(server)
    with_hints = replay_http(_trace(True), server.url, concurrency=2, trace_clock=True, keep_outputs=True)
    h = with_hints["hints"]
    assert (h["sent"], h["accepted"], h["refused"], h["unresolved"], h["unsent"]) == (3, 2, 1, 0, 0), h
    assert (
        "request b/1: pin of 64 tokens: HTTP 400: hint 0: 'ttl_s' of 9000 s exceeds the longest allowed"
        in h["first_error"]
    ), h
    assert h["endpoint_error"] is None and h["url"] == _hint_url(server) + "/hints"
    assert (
        h["server"]["applied"]["prefetch"] == 1 and h["server"]["applied"]["pin"] == 1 and h["server"]["rejected"] == 0
    ), h["server"]
    without = replay_http(_trace(False), server.url, concurrency=2, trace_clock=True, keep_outputs=True)
    assert "hints" not in without
    outputs = {r["request_id"]: r["output_ids"] for r in with_hints["records"]}
    assert outputs == {r["request_id"]: r["output_ids"] for r in without["records"]} and all(outputs.values())
    probe = _prompt(43, 16)

    def expired():  # retentions expire on the scheduler's steps: keep it stepping
        _gen(server, probe, 1)
        return _stats(server)["hints"]["pins"] == 0

    _wait_for(expired, "the replay's 2 s pin to expire")

    # the command line: a table line on the hints; a dead hint API fails before anything is sent
    from sgl_hicache.replay.shapes import write_plain

    trace = tmp_path / "hinted.jsonl"
    with trace.open("w") as f:
        write_plain(_trace(True), f)
    cli = [
        sys.executable,
        "-m",
        "sgl_hicache.cli",
        "replay",
        str(trace),
        "--url",
        server.url,
        "--quiet",
        "--trace-clock",
    ]
    run = subprocess.run(cli + ["--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "server: hints to http://127.0.0.1:" in run.stdout and "sent 3, accepted 2, refused 1" in run.stdout, (
        run.stdout
    )
    assert json.loads((tmp_path / "r.json").read_text())["policies"]["server"]["hints"]["refused"] == 1
    from sgl_hicache.client.server import free_port

    dead = subprocess.run(
        cli + ["--hint-url", f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=300
    )
    assert dead.returncode == 2 and "does not answer" in dead.stderr and "hints cannot be sent" in dead.stderr, (
        dead.stderr
    )


def test_a_prefetched_prefix_goes_on_to_free_device_pages_and_is_served_from_there(server):
    # after a flush the device is empty: a prefetch from disk lands on host and is carried on to the
    # device (free pages nobody needs), so the request that follows finds it whole as a device hit
    _no_retention_left(server)
    prompt = _prompt(50, 320)
    ref, _ = _gen(server, prompt)
    _flood(server, 51, FLOOD)
    _settled_pool(server)  # write-through to disk landed
    flush_cache(server)
    before = _stats(server)["speculation"]
    assert _post(server, {"action": "prefetch", "input_ids": prompt}) == (202, {"queued": 1})

    def carried():
        st = _stats(server)["speculation"]
        return st if st["carried_tokens"] > before["carried_tokens"] else None

    st = _wait_for(carried, "the prefetched prefix to be carried to the device")
    assert st["carried_tokens"] - before["carried_tokens"] == HIT + PAGE, st  # the whole cached prefix
    _settled_pool(server)  # the carry's copy landed
    out, hits = _gen(server, prompt)
    assert out == ref
    assert hits == {"device": HIT, "host": 0, "storage": 0}, hits
    pool = _settled_pool(server)["pool"]
    assert pool["check"] == "ok", pool
