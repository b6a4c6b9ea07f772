"""SGLang HiCache's own flags on the real server: `--radix-cache-backend sgl_hicache` with
`--hicache-ratio`, `--hicache-write-policy` and `--hicache-storage-backend file` runs with the mapped
settings (read back from the server's stats), and a flag with no meaning here stops the start with a
message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "scripts" / "cpu" / "tiny-llama"
POOL, PAGE = 1024, 16


def test_hicache_flags_map_onto_the_settings(tmp_path):
    from sgl_hicache.client.server import SGLangServer
    from sgl_hicache.client.stats_client import fetch_stats

    store = tmp_path / "hicache-files"
    with SGLangServer.start(
        TINY,
        log_path=tmp_path / "server.log",
        timeout_s=300,
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store), "SGLHICACHE_DIR": str(tmp_path / "default")},
        extra_args=[
            "--max-total-tokens",
            str(POOL),
            "--page-size",
            str(PAGE),
            "--radix-cache-backend",
            "sgl_hicache",
            "--hicache-ratio",
            "2",
            "--hicache-write-policy",
            "write_back",
            "--hicache-storage-backend",
            "file",
        ],
    ) as srv:
        out = srv.generate(list(range(5, 5 + 3 * PAGE)), max_new_tokens=2)
        assert len(out["output_ids"]) == 2
        config = fetch_stats(srv.url)["config"]
    assert config["host_tokens"] == 2 * config["device_tokens"]
    assert config["write_policy"] == "write_back"
    assert config["disk_tokens"] > 0 and Path(config["disk_dir"]) == store


def test_a_hicache_flag_without_meaning_is_refused(tmp_path):
    from sgl_hicache.client.server import ServerStartError, SGLangServer

    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError):
        SGLangServer.start(
            TINY,
            log_path=log,
            timeout_s=300,
            extra_args=[
                "--max-total-tokens",
                str(POOL),
                "--page-size",
                str(PAGE),
                "--radix-cache-backend",
                "sgl_hicache",
                "--hicache-io-backend",
                "direct",
            ],
        )
    assert "--hicache-io-backend direct has no meaning with sgl_hicache" in log.read_text()
