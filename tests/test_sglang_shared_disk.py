"""Two real SGLang 0.5.23 servers (CPU, the repo's tiny model) sharing one `--disk-dir`.

One test, three server launches (kept lean for CI):
1. servers A and B start on one empty directory (write-through down to disk, so pages reach it at
   once). A computes a prompt P; B, which never saw P, serves it from A's page files (a `storage`
   hit) with A's greedy output;
2. A and B replay different halves (by session) of the shipped trace slice at the same time, then
   swap halves: each gets disk hits on the other's sessions;
3. A is SIGKILLed in the middle of its replay (it writes every page through to disk) while B keeps
   replaying; B loses no request. A restarts on the directory while B still serves: the restart
   removes only dead owners' temp files, so B never sees a failed write; the new A serves P from
   disk with the same output.
Throughout: 0 corrupt pages, 0 failed disk writes, the directory within its capacity.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import NEEDS_SGLANG
from test_sglang_e2e import HOST_TOKENS, PAGE, _gen, _pool, _prompt, _trace_slice, _wait_for, make_model

pytestmark = NEEDS_SGLANG

DEVICE_TOKENS = 1024
DISK_TOKENS = 16384  # the directory's capacity, shared by both servers
HIT = 304  # P's whole pages below its last token


@pytest.fixture
def servers(tmp_path):
    from sgl_hicache.sglang.server import SGLangServer

    model = make_model(tmp_path / "model")
    started: list[SGLangServer] = []

    def start(name: str, disk: Path) -> SGLangServer:
        env = {
            "SGLHICACHE_HOST_TOKENS": str(HOST_TOKENS),
            "SGLHICACHE_DISK_DIR": str(disk),
            "SGLHICACHE_DISK_TOKENS": str(DISK_TOKENS),
            "SGLHICACHE_WRITE_POLICY": "write_through",
            "SGLHICACHE_DISK_WRITE_POLICY": "write_through",
            "SGLHICACHE_CHECK_INVARIANTS": "1",
        }
        srv = SGLangServer.start(
            model, load_format=None, log_path=tmp_path / f"{name}.log", env=env, timeout_s=300,
            extra_args=["--max-total-tokens", str(DEVICE_TOKENS), "--page-size", str(PAGE),
                        "--radix-cache-backend", "sgl_hicache", "--log-level", "warning"],
        )
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
        assert not srv.alive()


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


def test_two_servers_share_one_disk_directory(servers, tmp_path):
    from sgl_hicache.replay.http import replay_http

    disk = tmp_path / "disk"
    a = servers("a", disk)
    b = servers("b", disk)

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
    t = threading.Thread(target=lambda: got.update(b=replay_http(s2 + s1, b.url, concurrency=2, max_new_tokens=4)))
    t.start()
    killer = threading.Timer(3.0, lambda: os.killpg(a.proc.pid, signal.SIGKILL))
    killer.start()
    replay_http(s1 + s2, a.url, concurrency=2, max_new_tokens=4)  # its failures after the kill are expected
    killer.join()
    _wait_for(lambda: not a.alive(), "A to die")
    a2 = servers("a2", disk)  # restarts while B is still replaying
    out_a2, d = _gen(a2, P)
    t.join(timeout=600)
    assert got["b"]["requests_failed"] == 0, got["b"]["errors"]
    print(f"after the kill: B {got['b']['hit_tokens']}, restarted A on P {d}")
    assert out_a2 == out_a, (out_a, out_a2)
    assert d["storage"] > 0, d
    for srv in (a2, b):
        errs = _errors(srv)
        assert not any("corrupt" in k or "host->disk" in k for k in errs), errs
    assert _page_files(disk) <= DISK_TOKENS // PAGE
