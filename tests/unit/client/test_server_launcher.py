"""The SGLang server launcher's start/retry logic, against a stand-in process (no sglang needed).

The stand-in is an executable passed as ``python=``: it reads ``--port`` from the argv the launcher
builds and either prints uvicorn's bind error and hangs (as SGLang 0.5.23 does, seen in CI) or serves
``/health``. What is under test is the launcher: it must notice the bind failure in the log without
waiting for the health timeout, and choose another port.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from sgl_hicache.client.server import PortInUseError, ServerStartError, SGLangServer, free_port, orphan_shm_files

STAND_IN = """#!{python}
import http.server, sys, time
from pathlib import Path
port = int(sys.argv[sys.argv.index("--port") + 1])
counter = Path({counter!r})
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
if n < {fail_first}:
    print("ERROR:    [Errno 98] error while attempting to bind on address "
          f"('127.0.0.1', {{port}}): address already in use", flush=True)
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _stand_in(tmp_path: Path, fail_first: int) -> tuple[Path, Path]:
    counter = tmp_path / "starts"
    exe = tmp_path / "fake-python"
    exe.write_text(STAND_IN.format(python=sys.executable, counter=str(counter), fail_first=fail_first))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe, counter


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    import socket

    port = free_port()
    assert 20000 <= port < 32000
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_lost_port_race_is_retried_on_a_new_port(tmp_path, monkeypatch):
    exe, counter = _stand_in(tmp_path, fail_first=2)
    # record how each start attempt ended: a lost bind must be noticed from the log (PortInUseError),
    # never by running into the health timeout (ServerStartError "not healthy after ..."), whatever
    # the machine's speed; the timeout is generous and only bounds a hang
    outcomes = []
    real_wait = SGLangServer.wait_healthy

    def wait_healthy(self, timeout_s=300.0, poll_s=0.5):
        try:
            ready = real_wait(self, timeout_s, poll_s)
        except BaseException as exc:
            outcomes.append(type(exc).__name__)
            raise
        outcomes.append("healthy")
        return ready

    monkeypatch.setattr(SGLangServer, "wait_healthy", wait_healthy)
    srv = SGLangServer.start("unused-model", python=str(exe), cpu=False, log_path=tmp_path / "s.log", timeout_s=300)
    try:
        assert srv.alive()
        assert srv.get("/health") == "ok"
        assert int(counter.read_text()) == 3  # two lost binds, then a healthy start
    finally:
        srv.stop()
    assert not srv.alive()
    assert outcomes == ["PortInUseError", "PortInUseError", "healthy"], outcomes


def test_explicit_port_bind_failure_raises_with_the_port_named(tmp_path):
    exe, _ = _stand_in(tmp_path, fail_first=1)
    port = free_port()
    with pytest.raises(PortInUseError, match=f"could not bind 127.0.0.1:{port}") as info:
        SGLangServer.start(
            "unused-model", port=port, python=str(exe), cpu=False, log_path=tmp_path / "s.log", timeout_s=60
        )
    assert isinstance(info.value, ServerStartError)
    assert "address already in use" in str(info.value)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_orphan_shm_files_are_sglangs_kinds_made_since_and_held_by_no_live_process():
    import os
    import time

    since = time.time() - 1.0
    tag = f"{os.getpid()}_{time.monotonic_ns()}"
    orphan = Path(f"/dev/shm/sem.mp-test{tag}")
    held = Path(f"/dev/shm/sglang_loads_test{tag}.shm")
    other_kind = Path(f"/dev/shm/someone_else_{tag}")
    made = [orphan, held, other_kind]
    try:
        for f in made:
            f.write_bytes(b"x")
        with open(held, "rb"):  # this live process holds it
            found = orphan_shm_files(since)
            assert orphan in found
            assert held not in found and other_kind not in found
        assert held in orphan_shm_files(since)  # no longer held
        assert not {orphan, held} & orphan_shm_files(time.time() + 60)  # made before `since`
    finally:
        for f in made:
            f.unlink(missing_ok=True)
