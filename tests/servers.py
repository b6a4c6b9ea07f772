"""Real SGLang CPU servers with the backend, as the server tests start them (not a test module)."""

from __future__ import annotations

from pathlib import Path

# The debug checks every server test runs with: the tree's invariants after each call, and the
# scheduler thread's I/O (no copy, disk write, sleep or wait), reported in /server_info.
CHECKED = {"SGLHICACHE_CHECK_INVARIANTS": "1", "SGLHICACHE_CHECK_SCHEDULER_IO": "1"}
# Re-warm at start is off unless a test turns it on: a server that lived past its record interval would
# otherwise bring the prefixes a restart test expects from disk back to host first.
NO_REWARM = {"SGLHICACHE_REWARM": "0"}


class BackendServers:
    """Starts servers of one model with `--radix-cache-backend sgl_hicache` and shared settings, each
    with its own disk directory and log (`<workdir>/<name>.log`); `close()` stops every one started
    (its whole process group), pass or fail.

    `env` is added to every server's environment (`CHECKED` by default; re-warm off, `NO_REWARM`, unless
    `env` or the start's `env_extra` sets `SGLHICACHE_REWARM`), `args` to its command line;
    `stats=True` makes each write its stats file to `<workdir>/<name>-stats.json` every 0.5 s.
    `tokenizer=True` starts them without `--skip-tokenizer-init`, for a model folder that has a
    tokenizer (`make_model(..., tokenizer=True)`): text prompts and `/v1/chat/completions` work."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *,
        page: int,
        host_tokens: int,
        device_tokens: int = 1024,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        stats: bool = False,
        tokenizer: bool = False,
        timeout_s: float = 400,
    ) -> None:
        self.model, self.workdir, self.page = model, workdir, page
        self.host_tokens, self.device_tokens = host_tokens, device_tokens
        self.env = dict(CHECKED if env is None else env)
        self.args, self.stats, self.tokenizer, self.timeout_s = args, stats, tokenizer, timeout_s
        self.started: list = []

    def start(self, name: str, disk_dir: Path, tp: int = 1, **env_extra: str):
        from sgl_hicache.client.server import SGLangServer

        env = {
            "SGLHICACHE_HOST_TOKENS": str(self.host_tokens),
            "SGLHICACHE_DISK_DIR": str(disk_dir),
            "SGLHICACHE_DISK_TOKENS": str(64 * 1024),
            **NO_REWARM,
            **self.env,
            **(
                {
                    "SGLHICACHE_STATS_FILE": str(self.workdir / f"{name}-stats.json"),
                    "SGLHICACHE_STATS_INTERVAL_S": "0.5",
                }
                if self.stats
                else {}
            ),
            **env_extra,
        }
        args = [
            "--max-total-tokens",
            str(self.device_tokens),
            "--page-size",
            str(self.page),
            "--radix-cache-backend",
            "sgl_hicache",
            "--log-level",
            "warning",
            *(["--tp", str(tp)] if tp > 1 else []),
            *self.args,
        ]
        srv = SGLangServer.start(
            self.model,
            load_format=None,
            skip_tokenizer_init=not self.tokenizer,
            log_path=self.workdir / f"{name}.log",
            env=env,
            timeout_s=self.timeout_s,
            extra_args=args,
        )
        self.started.append(srv)
        return srv

    def close(self) -> None:
        for srv in self.started:
            srv.stop()
        assert not any(srv.alive() for srv in self.started)


def flush_cache(srv, attempts: int = 50) -> None:
    """SGLang's /flush_cache (a text reply): the device and host copies go (sgl_hicache keeps its disk
    files). SGLang refuses it with 400 until the scheduler has seen itself idle once after the last
    request (`Scheduler.is_fully_idle`: `last_batch` empty), which an idle scheduler sleeping on its
    sockets reaches only a moment after the reply: retry a few times."""
    import time
    import urllib.error
    import urllib.request

    for i in range(attempts):
        try:
            with urllib.request.urlopen(
                urllib.request.Request(f"{srv.url}/flush_cache", b"", method="POST"), timeout=60
            ) as r:
                assert r.status == 200, r.status
                return
        except urllib.error.HTTPError as e:
            if e.code != 400 or i == attempts - 1:
                raise
            time.sleep(0.2)
