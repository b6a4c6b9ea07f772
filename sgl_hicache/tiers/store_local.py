"""Start a local shared store for trying the store tier on one machine (and for the tests).

`python -m sgl_hicache.tiers.store_local mooncake` starts a Mooncake master (with its HTTP metadata
server) plus one holder process that owns the memory, all on 127.0.0.1, prints the `--store` URL
and waits; Ctrl-C stops them (holder first, then master). `... redis` starts a `redis-server`.

Contract: `start_mooncake` / `start_redis` return a `LocalStore` whose processes run in their own
process group; `LocalStore.stop()` stops exactly those processes (by PID), never anything by name.
Data lives in the holder: killing it loses the objects; killing the master loses them too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s")


def mooncake_bin_dir() -> Path:
    """Where the `mooncake-transfer-engine` wheel keeps `mooncake_master` and `mooncake_client`."""
    try:
        import mooncake  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise RuntimeError(
            "the mooncake store needs `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` "
            "(and `apt-get install -y libibverbs1`)"
        ) from exc
    return Path(mooncake.__file__).parent


@dataclass
class LocalStore:
    """Processes of one local store; `url` is what `--store` takes."""

    url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    workdir: Path | None = None
    ports: dict[str, int] = field(default_factory=dict)
    _args: dict[str, list[str]] = field(default_factory=dict)
    _logs: dict[str, Path] = field(default_factory=dict)
    _env: dict[str, str] = field(default_factory=dict)

    def master_metrics(self, timeout: float = 5.0) -> dict[str, float]:
        """The Mooncake master's Prometheus counters and gauges (`master_key_count`,
        `master_batch_put_start_items_total`, `master_evicted_key_count`, ...), by metric name as
        printed (labels included). The store's own view, independent of any client's counters."""
        if "metrics" not in self.ports:
            raise ValueError(f"{self.url}: only a local Mooncake store publishes master metrics")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=timeout) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name and not line.startswith("#"):
                try:
                    out[name] = float(value)
                except ValueError:
                    continue  # not a sample line
        return out

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one of the processes (fault tests): `name` is "master", "holder" or "redis"."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def restart(self, name: str, timeout: float = 20.0) -> None:
        """Start a killed process again with its original command line."""
        self.kill(name)
        self.procs[name] = _spawn(self._args[name], self._logs[name], self._env)
        if name in ("master", "redis"):
            _wait_port(self.ports[name], self.procs[name], timeout, name)
        if name == "holder":
            time.sleep(0.5)  # the old holder's segment may still count until its lease ends: give the new one time
            self.wait_mounted(timeout)

    def wait_mounted(self, timeout: float = 20.0) -> None:
        """Wait until the master reports memory mounted by a holder (`master_total_capacity_bytes`
        > 0): a holder takes 0.1 s to seconds on a loaded machine, and puts fail until then.
        RuntimeError, with the holder's log, if it exits (e.g. a segment below 16 MB) or times out."""
        deadline = time.monotonic() + timeout
        while True:
            holder = self.procs["holder"]
            if holder.poll() is not None:
                raise RuntimeError(
                    f"mooncake_client exited with code {holder.returncode}: "
                    f"{self._logs['holder'].read_text(errors='replace')[-2000:]}"
                )
            try:
                if self.master_metrics(timeout=2.0).get("master_total_capacity_bytes", 0.0) > 0:
                    return
            except OSError:
                pass  # the metrics endpoint is not up yet
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mooncake_client mounted no memory within {timeout:g} s: "
                    f"{self._logs['holder'].read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every process (holder before master), then remove the work directory."""
        for name in ("holder", "master", "redis"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(args: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", **(extra_env or {}))
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_mooncake(segment_mb: int = 256, snapshot: bool = False, timeout: float = 20.0) -> LocalStore:
    """A Mooncake master (HTTP metadata server on) plus one holder owning `segment_mb` MiB, on free
    ports of 127.0.0.1. With `snapshot`, the master snapshots objects every 3 s and restores them
    after a restart (Mooncake's experimental snapshot mode)."""
    bin_dir = mooncake_bin_dir()
    work = Path(tempfile.mkdtemp(prefix="sglh-mooncake-"))
    rpc, http, metrics, holder = free_port(), free_port(), free_port(), free_port()
    master = [
        str(bin_dir / "mooncake_master"),
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
        "--rpc_thread_num=2",
        "--logtostderr",
    ]
    if snapshot:
        (work / "snap").mkdir()
        master += [
            "--enable_snapshot=true",
            "--snapshot_interval_seconds=3",
            "--snapshot_object_store_type=local",
            "--enable_snapshot_restore=true",
        ]
    client = [
        str(bin_dir / "mooncake_client"),
        "-host=127.0.0.1",
        f"-port={holder}",
        f"-global_segment_size={segment_mb} MB",
        f"-master_server_address=127.0.0.1:{rpc}",
        f"-metadata_server=http://127.0.0.1:{http}/metadata",
        "-protocol=tcp",
        "--logtostderr",
    ]
    store = LocalStore(
        url=f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata",
        workdir=work,
        ports={"master": rpc, "http": http, "holder": holder, "metrics": metrics},
    )
    store._args = {"master": master, "holder": client}
    store._logs = {"master": work / "master.log", "holder": work / "holder.log"}
    if snapshot:
        store._env = {"MOONCAKE_SNAPSHOT_LOCAL_PATH": str(work / "snap")}
    try:
        store.procs["master"] = _spawn(master, store._logs["master"], store._env)
        _wait_port(rpc, store.procs["master"], timeout, "mooncake_master")
        _wait_port(http, store.procs["master"], timeout, "mooncake_master's metadata server")
        store.procs["holder"] = _spawn(client, store._logs["holder"])
        store.wait_mounted(timeout)
    except BaseException:
        store.stop()
        raise
    return store


def start_redis(maxmemory_mb: int = 256, timeout: float = 20.0, policy: str = "allkeys-lru") -> LocalStore:
    """A `redis-server` on a free port of 127.0.0.1, no persistence, `policy` (LRU eviction) at
    `maxmemory_mb` (`policy="noeviction"`: a full server refuses writes)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("the redis store needs `redis-server` (apt-get install -y redis-server)")
    work = Path(tempfile.mkdtemp(prefix="sglh-redis-"))
    port = free_port()
    args = [
        exe,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        policy,
        "--dir",
        str(work),
    ]
    store = LocalStore(url=f"redis://127.0.0.1:{port}", workdir=work, ports={"redis": port})
    store._args = {"redis": args}
    store._logs = {"redis": work / "redis.log"}
    try:
        store.procs["redis"] = _spawn(args, store._logs["redis"])
        _wait_port(port, store.procs["redis"], timeout, "redis-server")
    except BaseException:
        store.stop()
        raise
    return store


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sgl_hicache.tiers.store_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", choices=("mooncake", "redis"))
    ap.add_argument("--size-mb", type=int, default=1024, help="holder segment (mooncake) or maxmemory (redis), MiB")
    ap.add_argument("--snapshot", action="store_true", help="mooncake: keep objects across a master restart")
    args = ap.parse_args(argv)
    try:
        store = start_mooncake(args.size_mb, args.snapshot) if args.backend == "mooncake" else start_redis(args.size_mb)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    def stop_on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)  # a plain kill also stops the store's processes
    print(
        f"store running: --store '{store.url}'  (pids {', '.join(f'{k}={p.pid}' for k, p in store.procs.items())}); Ctrl-C stops it",
        flush=True,
    )
    try:
        while all(p.poll() is None for p in store.procs.values()):
            time.sleep(1)
        print("error: a store process exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        store.stop()


if __name__ == "__main__":
    sys.exit(main())
