"""Two real SGLang 0.5.23 servers (CPU, the repo's tiny model) sharing one `--disk-dir`.

One test, two server launches at once (kept lean for CI: a launch is most of its time):
1. servers A and B start on one empty directory (write-through down to disk, so pages reach it at
   once). A computes a prompt P; B, which never saw P, serves it from A's page files (a `storage`
   hit) with A's greedy output;
2. A and B replay different halves (by session) of the shipped trace slice at the same time, then
   swap halves: each gets disk hits on the sessions the other wrote;
3. A is SIGKILLed in the middle of a replay (it writes every page through to disk) while B keeps
   replaying: B loses no request.
Throughout: 0 corrupt pages and 0 failed disk writes on the survivor, the directory within its
capacity. (A restart beside a live peer, and the cleanup of the dead one's temp files, are proven
with real processes in `tests/unit/tiers/test_disk_shared.py`.)
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from test_sglang_e2e import HIT, PAGE, _gen, _pool, _prompt, _trace_slice, _wait_for, model_dir, start_server, workdir  # noqa: F401 (fixtures)

DISK_TOKENS = 16384  # the directory's capacity, shared by both servers


# the e2e module's server fixture (every server it starts is stopped, its group's /dev/shm files removed)
ENV = {
    "SGLHICACHE_DISK_TOKENS": str(DISK_TOKENS),
    "SGLHICACHE_WRITE_POLICY": "write_through",
    "SGLHICACHE_DISK_WRITE_POLICY": "write_through",
}


def _halves():
    reqs = _trace_slice()
    sessions = sorted({r.session for r in reqs})
    first = set(sessions[::2])
    return [r for r in reqs if r.session in first], [r for r in reqs if r.session not in first]


def _errors(srv) -> dict:
    st = _pool(srv)
    return {k: v for k, v in st.get("errors", {}).items() if v}


def _page_files(disk: Path) -> int:
    return len(list(disk.glob("??/*.page")))


def test_two_servers_share_one_disk_directory(start_server, tmp_path):  # noqa: F811 (the imported fixture)
    from sgl_hicache.replay.http import replay_http

    disk = tmp_path / "disk"
    launched: dict = {}
    starter = threading.Thread(target=lambda: launched.update(b=start_server("shared-b", disk, **ENV)))
    starter.start()
    a = start_server("shared-a", disk, **ENV)
    starter.join(timeout=600)
    b = launched["b"]

    # 1. B serves A's pages, with A's output
    P = _prompt(7, 320)
    out_a, d = _gen(a, P)
    assert sum(d.values()) == 0, d
    _wait_for(lambda: _pool(a)["stored_tokens"]["disk"] >= HIT, "A's pages to reach the disk")
    out_b, d = _gen(b, P)
    assert d["storage"] == HIT and d["device"] == 0, d  # B never computed P: every hit is A's file
    assert out_b == out_a, (out_a, out_b)

    # 2. different slices at the same time, then swapped
    s1, s2 = _halves()
    assert len(s1) >= 10 and len(s2) >= 10

    def replay_pair(left, right) -> tuple[dict, dict]:
        got: dict[str, dict] = {}
        t = threading.Thread(target=lambda: got.update(b=replay_http(right, b.url, concurrency=2, max_new_tokens=4)))
        t.start()
        got["a"] = replay_http(left, a.url, concurrency=2, max_new_tokens=4)
        t.join(timeout=600)
        return got["a"], got["b"]

    ra, rb = replay_pair(s1, s2)
    assert ra["requests_failed"] == 0 and rb["requests_failed"] == 0, (ra["errors"], rb["errors"])
    ra2, rb2 = replay_pair(s2, s1)  # each replays the sessions the other wrote
    assert ra2["requests_failed"] == 0 and rb2["requests_failed"] == 0, (ra2["errors"], rb2["errors"])
    print(f"\nswapped halves, disk hit tokens: A {ra2['hit_tokens']}, B {rb2['hit_tokens']}")
    assert ra2["hit_tokens"]["disk"] > 0 and rb2["hit_tokens"]["disk"] > 0
    assert _page_files(disk) <= DISK_TOKENS // PAGE

    # 3. SIGKILL A mid-replay (it writes every page through to disk) while B keeps replaying
    got: dict[str, dict] = {}
    t = threading.Thread(target=lambda: got.update(b=replay_http(s2, b.url, concurrency=2, max_new_tokens=4)))
    t.start()
    killer = threading.Timer(3.0, lambda: os.killpg(a.proc.pid, signal.SIGKILL))
    killer.start()
    replay_http(s1, a.url, concurrency=2, max_new_tokens=4)  # its failures after the kill are expected
    killer.join()
    _wait_for(lambda: not a.alive(), "A to die")
    t.join(timeout=600)
    assert got["b"]["requests_failed"] == 0, got["b"]["errors"]
    out_b2, d = _gen(b, P)  # and B still serves P right
    assert out_b2 == out_a, (out_a, out_b2)
    errs = _errors(b)
    print(f"after the kill: B {got['b']['hit_tokens']}, B's errors {errs}")
    assert not any("corrupt" in k or "host->disk" in k for k in errs), errs
    assert _page_files(disk) <= DISK_TOKENS // PAGE
