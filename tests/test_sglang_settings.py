"""The SGLang backend's settings and launcher: no sglang needed (they run in the core venv too)."""

from __future__ import annotations

import json

import pytest

from sgl_hicache.sglang.launch import build_command, build_parser, main
from sgl_hicache.sglang.settings import BackendSettings, SettingsError, load_settings, settings_env, unknown_env


def test_defaults_and_env_overrides(tmp_path):
    assert load_settings({}) == BackendSettings()
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"host_tokens": 1000, "predictor": "tree_walk", "disk_dir": "/x"}))
    s = load_settings({"SGLHICACHE_CONFIG": str(cfg), "SGLHICACHE_HOST_TOKENS": "2000", "SGLHICACHE_PREFETCH": "off"})
    assert (s.host_tokens, s.predictor, s.disk_dir, s.prefetch) == (2000, "tree_walk", "/x", False)
    assert load_settings(settings_env(s)) == s.replace(disk_dir="/x")
    assert s.host_tokens_for(512) == 2000 and BackendSettings().host_tokens_for(512) == 2048
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
    monkeypatch.setattr("sgl_hicache.sglang.launch.has_cuda", lambda: False)
    ns = build_parser().parse_args(["--host-tokens", "4096", "--disk-dir", "/tmp/kv", "--page-size", "16", "--",
                                    "--model-path", "m", "--max-total-tokens", "1024", "--port", "31000"])
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
