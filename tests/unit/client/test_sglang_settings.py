"""The SGLang backend's settings and launcher: no sglang needed (they run in the core venv too)."""

from __future__ import annotations

import json

import pytest

from sgl_hicache.client.backend_settings import BackendSettings, SettingsError, load_settings, settings_env, unknown_env
from sgl_hicache.client.launch import build_command, build_parser, main


def test_defaults_and_env_overrides(tmp_path):
    assert load_settings({}) == BackendSettings()
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"host_tokens": 1000, "predictor": "tree_walk", "disk_dir": "/x"}))
    s = load_settings({"SGLHICACHE_CONFIG": str(cfg), "SGLHICACHE_HOST_TOKENS": "2000", "SGLHICACHE_PREFETCH": "off"})
    assert (s.host_tokens, s.predictor, s.disk_dir, s.prefetch) == (2000, "tree_walk", "/x", False)
    assert load_settings(settings_env(s)) == s.replace(disk_dir="/x")
    assert s.host_tokens_for(512, 64) == 2000 and BackendSettings().host_tokens_for(512, 64) == 2048
    assert unknown_env({"SGLHICACHE_HOST_TOKEN": "1", "SGLHICACHE_DIR": "/d"}) == ["SGLHICACHE_HOST_TOKEN"]


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"SGLHICACHE_HOST_TOKENS": "many"}, "SGLHICACHE_HOST_TOKENS"),
        ({"SGLHICACHE_WRITE_POLICY": "sometimes"}, "write_policy"),
        ({"SGLHICACHE_PREFETCH": "maybe"}, "SGLHICACHE_PREFETCH"),
        ({"SGLHICACHE_CONFIG": "/nonexistent/c.json"}, "no such file"),
    ],
)
def test_bad_settings_name_the_field(env, needle):
    with pytest.raises(SettingsError, match=needle):
        load_settings(env)


def test_bad_config_key(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"host_tokenz": 1}))
    with pytest.raises(SettingsError, match="unknown key 'host_tokenz'"):
        load_settings({"SGLHICACHE_CONFIG": str(cfg)})


def test_launch_command_passes_flags_and_adds_backend(monkeypatch):
    monkeypatch.setattr("sgl_hicache.client.launch.has_cuda", lambda: False)
    ns = build_parser().parse_args(
        [
            "--host-tokens",
            "4096",
            "--disk-dir",
            "/tmp/kv",
            "--page-size",
            "16",
            "--",
            "--model-path",
            "m",
            "--max-total-tokens",
            "1024",
            "--port",
            "31000",
        ]
    )
    argv, env = build_command(ns, environ={})
    assert argv[1:4] == ["-m", "sglang.launch_server", "--model-path"]
    assert argv[argv.index("--radix-cache-backend") + 1] == "sgl_hicache"
    assert argv[argv.index("--max-total-tokens") + 1] == "1024" and argv.count("--max-total-tokens") == 1
    assert "--device" in argv and "torch_native" in argv and "--port" in argv
    assert env["SGLHICACHE_HOST_TOKENS"] == "4096" and env["SGLHICACHE_DISK_DIR"] == "/tmp/kv"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_launch_rejects_conflicts(capsys):
    assert main(["--", "--model-path", "m", "--radix-cache-backend", "radix"]) == 2
    assert main(["--", "--model-path", "m", "--enable-hierarchical-cache"]) == 2
    assert main(["--", "--port", "1"]) == 2
    assert main(["--write-policy", "bogus", "--", "--model-path", "m"]) == 2
    assert "sgl-hicache serve" in capsys.readouterr().err


def _server_args(**changes):
    from types import SimpleNamespace

    base = dict(
        hicache_ratio=None,
        hicache_size=0,
        hicache_write_policy="write_through",
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config=None,
        hicache_io_backend="kernel",
        hicache_mem_layout="page_first",
        hicache_storage_prefetch_policy="timeout",
        hicache_host_memory_mode="cache",
    )
    return SimpleNamespace(**{**base, **changes})


def test_hicache_flags_map_onto_settings():
    from sgl_hicache.sglang.hicache_flags import apply_hicache_flags, hicache_flag_settings

    assert hicache_flag_settings(_server_args(), environ={}) == {}
    sa = _server_args(hicache_ratio=2.0, hicache_write_policy="write_back", hicache_storage_backend="file")
    assert hicache_flag_settings(sa, environ={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/kv"}) == {
        "host_ratio": 2.0,
        "write_policy": "write_back",
        "disk_dir": "/kv",
    }
    s = apply_hicache_flags(BackendSettings(), _server_args(hicache_size=3), given={}, environ={})
    assert s.host_gb == 3.0 and s.host_tokens_for(1024, bytes_per_token=1 << 20) == 3 * 1024
    mc = _server_args(
        hicache_storage_backend="mooncake",
        hicache_storage_backend_extra_config='{"master_server_address": "10.0.0.1:50051", '
        '"metadata_server": "http://10.0.0.1:8080/metadata"}',
    )
    assert (
        hicache_flag_settings(mc, environ={})["store"]
        == "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata"
    )


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"hicache_io_backend": "direct"}, "--hicache-io-backend direct has no meaning"),
        ({"hicache_mem_layout": "layer_first"}, "--hicache-mem-layout layer_first"),
        ({"hicache_storage_backend": "hf3fs"}, "--hicache-storage-backend hf3fs is not served"),
        ({"hicache_storage_backend": "mooncake"}, "needs the master's address"),
        ({"hicache_storage_backend_extra_config": "{}"}, "read only with --hicache-storage-backend mooncake"),
    ],
)
def test_hicache_flags_without_meaning_are_refused(changes, needle):
    from sgl_hicache.sglang.hicache_flags import hicache_flag_settings

    with pytest.raises(SettingsError, match=needle):
        hicache_flag_settings(_server_args(**changes), environ={})


def test_a_setting_given_both_ways_must_agree():
    from sgl_hicache.sglang.hicache_flags import apply_hicache_flags

    given = {"write_policy": "write_through_selective"}
    with pytest.raises(SettingsError, match="write_policy='write_through_selective'"):
        apply_hicache_flags(
            BackendSettings(**given), _server_args(hicache_write_policy="write_back"), given, environ={}
        )
    agreed = apply_hicache_flags(
        BackendSettings(write_policy="write_back"),
        _server_args(hicache_write_policy="write_back"),
        {"write_policy": "write_back"},
        environ={},
    )
    assert agreed.write_policy == "write_back"


def test_debug_switches_are_not_settings(tmp_path):
    from sgl_hicache.client.debug_settings import DebugSettings

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"check_invariants": True}))
    with pytest.raises(SettingsError, match="unknown key 'check_invariants'"):
        load_settings({"SGLHICACHE_CONFIG": str(cfg)})
    d = DebugSettings.from_env({"SGLHICACHE_CHECK_INVARIANTS": "1", "SGLHICACHE_FAULT_DISK_READ_FILE": "/f"})
    assert d.check_invariants and not d.check_scheduler_io and d.fault_disk_read_file == "/f"
    with pytest.raises(ValueError, match="SGLHICACHE_CONSENSUS_CHECK"):
        DebugSettings.from_env({"SGLHICACHE_CONSENSUS_CHECK": "maybe"})
    assert unknown_env({"SGLHICACHE_CHECK_SCHEDULER_IO": "1"}) == []
