"""Start, wait for and stop a real SGLang server in its own process group.

SGLang's launcher forks a scheduler and a detokenizer; stopping only the parent can orphan them. So
the server is started as the leader of a new session (``start_new_session=True``) and stopped by
signalling the whole process group: SIGTERM, then SIGKILL after a grace period.

This module imports no sglang: it runs ``python -m sglang.launch_server`` in a subprocess, so it can be
used from tests and the CLI with any interpreter that has SGLang installed (e.g. ``.venv-sglang``).

    with SGLangServer.start(model_path, port=30001, extra_args=[...], log_path=...) as srv:
        srv.generate(input_ids=[...], max_new_tokens=8)
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PortInUseError",
    "ServerStartError",
    "SGLangServer",
    "cpu_server_args",
    "free_port",
    "group_shm_files",
    "orphan_shm_files",
    "has_cuda",
]


class ServerStartError(RuntimeError):
    """The server died or did not become healthy in time; the message ends with the log tail."""


class PortInUseError(ServerStartError):
    """The HTTP port was taken between choosing it and the server's bind (uvicorn then hangs)."""


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# Below Linux's default ephemeral range (32768-60999): a port the kernel hands out for outgoing
# connections can be taken by any client between our probe and the server's bind (seen in CI).
_PORT_RANGE = (20000, 32000)
_BIND_FAILURE = "address already in use"
_PORT_ATTEMPTS = 4


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, outside the ephemeral range (the usual race applies)."""
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_server_args(max_total_tokens: int = 16384, page_size: int | None = None) -> list[str]:
    """SGLang flags a CPU-only machine needs (torch_native attention, no CUDA graphs, a bounded pool,
    an idle scheduler that sleeps).

    Always bound ``--max-total-tokens`` on CPU: without it SGLang sizes the KV pool from host memory
    (32.5 M tokens / ~19 GB RSS was seen for the tiny model). ``--sleep-on-idle``: an idle scheduler
    otherwise polls its sockets in a busy loop, a whole core per server, which on a small CPU starves
    the server's own tokenizer, other servers and their clients; with it, it waits on the sockets
    (a request wakes it at once) and does its idle housekeeping about once a second.
    """
    args = [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-cuda-graph",
        "--sleep-on-idle",
        "--max-total-tokens",
        str(max_total_tokens),
    ]
    if page_size is not None:
        args += ["--page-size", str(page_size)]
    return args


def _tail(path: Path | None, n_lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 64 * 1024))
        data = f.read().decode("utf-8", "replace")
    return "\n".join(data.splitlines()[-n_lines:])


@dataclass
class SGLangServer:
    """A running ``sglang.launch_server`` process group. Create with :meth:`start`."""

    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path | None
    argv: list[str]
    started_at: float
    ready_after_s: float | None = None
    started_wall: float = field(default_factory=time.time)  # /dev/shm files newer than this may be its
    _log_file: Any = field(default=None, repr=False)
    _shm: set = field(default_factory=set, repr=False)  # /dev/shm files the group held (removed at stop)

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def start(
        cls,
        model_path: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        log_path: str | os.PathLike | None = None,
        cpu: bool | None = None,
        load_format: str | None = "dummy",
        skip_tokenizer_init: bool = True,
        wait: bool = True,
        timeout_s: float = 300.0,
    ) -> SGLangServer:
        """Launch the server in a new process group; by default wait until /health answers 200.

        ``cpu=None`` means "CPU if torch has no CUDA"; on CPU ``SGLANG_USE_CPU_ENGINE=1`` is set and
        :func:`cpu_server_args` are added unless ``extra_args`` already carries ``--device``.
        ``python`` defaults to this interpreter. Output goes to ``log_path`` (a temp file if None).
        If waiting fails the process group is stopped before :class:`ServerStartError` is raised.
        ``port=None`` chooses a free port and, if the bind still loses a race, starts again on another
        (up to 4 tries); an explicit ``port`` is tried once.
        """
        opts: dict[str, Any] = dict(
            host=host,
            extra_args=extra_args,
            env=env,
            python=python,
            log_path=log_path,
            cpu=cpu,
            load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init,
            wait=wait,
            timeout_s=timeout_s,
        )
        if port is not None:
            return cls._start_once(model_path, port=port, **opts)
        # A port we chose ourselves can be lost to a race; choose again rather than fail the caller.
        for attempt in range(_PORT_ATTEMPTS):
            try:
                return cls._start_once(model_path, port=free_port(host), **opts)
            except PortInUseError:
                if attempt == _PORT_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(
        cls,
        model_path: str | os.PathLike,
        *,
        host: str,
        port: int,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None,
        python: str | None,
        log_path: str | os.PathLike | None,
        cpu: bool | None,
        load_format: str | None,
        skip_tokenizer_init: bool,
        wait: bool,
        timeout_s: float,
    ) -> SGLangServer:
        if cpu is None:
            cpu = not has_cuda()
        argv = [
            python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(port),
        ]
        if load_format:
            argv += ["--load-format", load_format]
        if skip_tokenizer_init:
            argv += ["--skip-tokenizer-init"]
        extra = list(extra_args)
        if cpu and "--device" not in extra:
            cpu_args = cpu_server_args()
            if "--max-total-tokens" in extra:
                i = cpu_args.index("--max-total-tokens")
                del cpu_args[i : i + 2]
            argv += cpu_args
        argv += extra

        full_env = dict(os.environ)
        if cpu:
            full_env["SGLANG_USE_CPU_ENGINE"] = "1"
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)

        if log_path is None:
            import tempfile

            fd, name = tempfile.mkstemp(prefix=f"sglang-{port}-", suffix=".log")
            os.close(fd)
            log_path = name
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "wb")  # noqa: SIM115 (the server writes it; closed when it stops)
        started_wall = time.time()
        proc = subprocess.Popen(
            argv,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        server = cls(
            proc=proc,
            host=host,
            port=port,
            log_path=log_path,
            argv=argv,
            started_at=time.monotonic(),
            started_wall=started_wall,
            _log_file=log_file,
        )
        if wait:
            try:
                server.wait_healthy(timeout_s)
            except BaseException:
                server.stop()
                raise
        return server

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until GET /health returns 200; return seconds since start.

        Fails fast with :class:`ServerStartError` (log tail included) if the process exits, and
        with :class:`PortInUseError` if the log says the HTTP bind failed (the process lingers then).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"SGLang server exited with code {rc} before becoming healthy "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            tail = _tail(self.log_path, 5)
            if _BIND_FAILURE in tail.lower() and str(self.port) in tail:
                raise PortInUseError(
                    f"SGLang server could not bind {self.host}:{self.port} "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            if self._health_ok():
                self.ready_after_s = time.monotonic() - self.started_at
                self._shm |= group_shm_files(self.proc.pid)  # some are closed again before stop
                return self.ready_after_s
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"SGLang server not healthy after {timeout_s:.0f}s (log {self.log_path}):\n{_tail(self.log_path)}"
                )
            time.sleep(poll_s)

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop the server: SIGINT to its leader (the HTTP process, which shuts the scheduler and
        detokenizer down with it); SIGTERM to the whole group if it has not exited after ``grace_s``,
        SIGKILL after as long again. Returns the leader's exit code. Removes the /dev/shm files the
        group held that outlive it (SGLang leaves some), and SGLang's kinds made since it started that
        no live process holds (`orphan_shm_files`).

        Why SIGINT to the leader: SIGTERM makes SGLang's HTTP process notice the exit within its
        5-second watchdog poll, and SIGTERM to the whole group makes it treat the children's deaths
        as a crash (a 5-second sleep before crash diagnostics); SIGINT stops it within a second.

        Safe to call twice and on a server that already died.
        """
        pgid = self.proc.pid  # the leader of a new session: its pid is the group id
        self._shm |= group_shm_files(pgid)
        try:
            if self.proc.poll() is None:
                try:
                    os.kill(pgid, signal.SIGINT)
                    self.proc.wait(timeout=grace_s)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    _signal_group(pgid, signal.SIGTERM)
                    try:
                        self.proc.wait(timeout=grace_s)
                    except subprocess.TimeoutExpired:
                        _signal_group(pgid, signal.SIGKILL)
                        self.proc.wait(timeout=10)
            # Children (scheduler, detokenizer) may outlive the leader: reap the group in any case.
            if _group_alive(pgid):
                _signal_group(pgid, signal.SIGTERM)
                end = time.monotonic() + grace_s
                while _group_alive(pgid) and time.monotonic() < end:
                    time.sleep(0.2)
                if _group_alive(pgid):
                    _signal_group(pgid, signal.SIGKILL)
        finally:
            if self._log_file is not None and not self._log_file.closed:
                self._log_file.close()
            if not _group_alive(pgid):
                for f in self._shm | orphan_shm_files(self.started_wall - 1.0):
                    f.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- requests
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n_lines: int = 40) -> str:
        return _tail(self.log_path, n_lines)

    def post(self, path: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> Any:
        data = json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def get(self, path: str, timeout_s: float = 30.0) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout_s) as r:
            return r.read().decode()

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8, **sampling: Any) -> dict:
        """POST /generate with token ids, greedy by default; returns SGLang's JSON reply."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        return self.post("/generate", {"input_ids": list(input_ids), "sampling_params": params})


# the /dev/shm names SGLang 0.5.23's processes create: its load snapshots, its message queues, and
# multiprocessing's named semaphores (left behind when their resource tracker is stopped with them)
_SHM_PREFIXES = ("sglang_loads_", "sgl_shm_mq_", "sem.mp-")


def _held_shm_files(pgid: int | None = None) -> set[Path]:
    """The /dev/shm files that live processes (of group `pgid`, or any) have open or mapped now."""
    found: set[Path] = set()
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not proc.name.isdigit():
            continue
        try:
            if pgid is not None and os.getpgid(int(proc.name)) != pgid:
                continue
            paths = [
                line.split(None, 5)[-1] for line in (proc / "maps").read_text().splitlines() if "/dev/shm/" in line
            ]
            fds = list((proc / "fd").iterdir())
        except (OSError, ProcessLookupError):
            continue
        for fd in fds:
            try:
                paths.append(os.readlink(fd))
            except OSError:  # closed meanwhile (the listing's own descriptor, in this process)
                continue
        found |= {Path(x) for x in paths if x.startswith("/dev/shm/") and not x.endswith("(deleted)")}
    return found


def group_shm_files(pgid: int) -> set[Path]:
    """The /dev/shm files (SGLang's ``sglang_loads_*`` / ``sgl_shm_mq_*``, multiprocessing semaphores)
    that the processes of group `pgid` have open or mapped now. SGLang 0.5.23 leaves some of them
    behind when it is stopped; a caller collects them before stopping and removes them after."""
    return _held_shm_files(pgid)


def orphan_shm_files(since: float) -> set[Path]:
    """SGLang's kinds of /dev/shm files (`_SHM_PREFIXES`) made at or after `since` (wall clock) that no
    live process holds: what a stopped server left whose names it never held when `group_shm_files`
    looked (a semaphore made during shutdown, or closed between looks)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    fresh = set()
    for f in shm.iterdir():
        try:
            if f.name.startswith(_SHM_PREFIXES) and f.stat().st_ctime >= since:
                fresh.add(f)
        except OSError:  # removed meanwhile
            continue
    return fresh - _held_shm_files() if fresh else set()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
