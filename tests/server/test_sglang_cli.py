"""A new user's sequence, as subprocesses of the real CLI against the real SGLang 0.5.23 server on CPU:
the README's own lines (its "first run against the real server" block), read from README.md, with a
free port and a temp dir in place of 30123 and /tmp/kv, and `--report` added to the replay:

    sgl-hicache serve --host-tokens 4096 --disk-dir /tmp/kv --page-size 16 -- \\
        --model-path scripts/cpu/tiny-llama --load-format dummy --skip-tokenizer-init --port 30123 ...
    sgl-hicache replay <shipped trace> --url http://127.0.0.1:30123 --limit 300 --scale 16 --max-new-tokens 4 ...
    sgl-hicache stats http://127.0.0.1:30123
    sgl-hicache stats http://127.0.0.1:30123 --prometheus

The tiny model's vocabulary is 1,024 tokens; the trace reader's default is 32,000. Before the replayer
asked the server, this sequence sent ids >= 1,024, SGLang's scheduler died of an IndexError in the
embedding, and the replay still exited 0 with a table of zeros. Here the replay must take the
vocabulary from the server, fail no request and leave the server healthy. (`--max-new-tokens 4`: the
trace's own output lengths, hundreds of tokens each, would make the replay take minutes on 2 cores;
the prompts, which are what reproduces the crash, are the trace's.)
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import mooncake_trace
from documented import documented_commands

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1024  # scripts/cpu/tiny-llama/config.json


def _cli() -> list[str]:
    """The installed `sgl-hicache` script of this interpreter's environment, else the same entry point via -m."""
    script = Path(sys.executable).with_name("sgl-hicache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sgl_hicache.cli"]


def _env() -> dict[str, str]:
    env = dict(os.environ)  # this checkout's code, also in the server's processes
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _readme_commands(port: int, disk_dir: Path) -> dict[str, list[str]]:
    """The README's first-run block as argv lists keyed by subcommand ("serve", "replay", "stats",
    "stats --prometheus"), with `port` and `disk_dir` in place of 30123 and /tmp/kv."""
    out: dict[str, list[str]] = {}
    for cmd in documented_commands():
        if not cmd.where.startswith("README.md") or "30123" not in cmd.text:
            continue
        words = shlex.split(
            cmd.text.replace("\\\n", " ").replace("30123", str(port)).replace("/tmp/kv", str(disk_dir)), comments=True
        )
        assert words[0] == "sgl-hicache", cmd
        key = words[1] + (" --prometheus" if "--prometheus" in words else "")
        out[key] = [*_cli(), *words[1:]]
    assert set(out) == {"serve", "replay", "stats", "stats --prometheus"}, sorted(out)
    return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`sgl-hicache serve` in its own process group; stopped (the whole group) when the module ends."""
    from sgl_hicache.client.server import free_port, group_shm_files

    work = tmp_path_factory.mktemp("sglang_cli")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")  # noqa: SIM115 (the server writes it; closed when it stops)
    commands = _readme_commands(port, work / "disk")
    cmd = commands["serve"]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    shm: set[Path] = set()
    t0 = time.monotonic()
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() - t0 > 240:
                pytest.fail(f"server not up (exit {proc.poll()}):\n" + (work / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        shm = group_shm_files(proc.pid)
        yield {
            "url": url,
            "work": work,
            "log": work / "server.log",
            "start_s": time.monotonic() - t0,
            "commands": commands,
        }
    finally:
        shm |= group_shm_files(proc.pid)
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):  # SGLang can take 20 s+ to exit on SIGTERM
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
        proc.wait(timeout=10)
        log.close()
        for seg in shm:  # segments the server's processes left behind
            seg.unlink(missing_ok=True)
        shutil.rmtree(work / "disk", ignore_errors=True)


def _run(argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_replay_the_shipped_trace_against_the_server(server):
    mooncake_trace()  # fails clearly when the shipped trace is missing
    report = server["work"] / "report.json"
    proc = _run([*server["commands"]["replay"], "--report", str(report)])
    log_tail = server["log"].read_text()[-3000:]
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\nserver log:\n{log_tail}"
    assert "IndexError" not in log_tail
    assert f"vocab {VOCAB} (server)" in proc.stdout
    rep = json.loads(report.read_text())["policies"]["server"]
    assert rep["server"]["vocab_size"] == VOCAB
    assert rep["requests_failed"] == 0, rep["errors"]
    assert rep["requests_sent"] + rep["requests_skipped"] == 300
    assert rep["requests_sent"] >= 250  # a few prompts exceed the 1,024-token pool: skipped, counted
    assert rep["requests"] == rep["requests_sent"]
    assert rep["hit_tokens"]["disk"] + rep["hit_tokens"]["host"] > 0, rep["hit_tokens"]
    assert "\r" not in proc.stderr  # progress in a pipe: plain lines
    assert _healthy(server["url"])


def test_stats_of_the_live_server(server):
    proc = _run(server["commands"]["stats"])
    assert proc.returncode == 0, proc.stderr
    assert "hit rate" in proc.stdout and "largest subtrees" in proc.stdout
    header = next(ln for ln in proc.stdout.splitlines() if ln.startswith("subtree"))
    assert all(col in header for col in ("depth", "tokens", "hits", "last access", "device", "host", "disk"))


def test_stats_prometheus_of_the_live_server(server):
    from prometheus_client.parser import text_string_to_metric_families

    proc = _run(server["commands"]["stats --prometheus"])
    assert proc.returncode == 0, proc.stderr
    families = {f.name: f for f in text_string_to_metric_families(proc.stdout)}
    for name in (
        "sgl_hicache_hit_tokens",
        "sgl_hicache_evicted_tokens",
        "sgl_hicache_promoted_tokens",
        "sgl_hicache_stored_tokens",
        "sgl_hicache_capacity_tokens",
        "sgl_hicache_requests",
        "sgl_hicache_bytes_moved",
    ):
        assert name in families, sorted(families)
    for name in ("sgl_hicache_hit_tokens", "sgl_hicache_stored_tokens", "sgl_hicache_capacity_tokens"):
        tiers = {s.labels.get("tier"): s.value for s in families[name].samples}
        assert set(tiers) == {"device", "host", "disk"}, (name, tiers)
    assert families["sgl_hicache_requests"].samples[0].value > 0
    assert {s.labels["tier"]: s.value for s in families["sgl_hicache_capacity_tokens"].samples}["host"] == 4096
    cached = {s.labels["cache_source"] for s in families["sglang:cached_tokens"].samples}
    assert cached == {"device", "host", "storage"}


@pytest.mark.parametrize("excerpt", ["sharegpt_v3_excerpt.json", "lmbench_trace_excerpt.jsonl"])
def test_replay_real_trace_formats_against_the_server(server, excerpt):
    """The ShareGPT (canonical-file format, duplicate ids) and LMBench (string-nanosecond timestamps,
    varying tokens per hash id) excerpts of tests/data replay against the real server: every request
    served, the reader's lenient choices noted in the report."""
    report = server["work"] / f"{excerpt}.report.json"
    replay = server["commands"]["replay"]
    argv = [
        *replay[: replay.index("replay") + 1],
        str(REPO / "tests" / "data" / excerpt),
        "--url",
        server["url"],
        "--max-new-tokens",
        "4",
        "--concurrency",
        "4",
        "--report",
        str(report),
    ]
    proc = _run(argv)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server['log'].read_text()[-3000:]}"
    result = json.loads(report.read_text())
    rep = result["policies"]["server"]
    assert rep["requests_failed"] == 0, rep["errors"]
    assert rep["requests_sent"] > 0 and rep["requests"] == rep["requests_sent"]
    assert result["trace"].get("notes"), result["trace"]  # duplicate ids / ns timestamps were noted
    assert _healthy(server["url"])
