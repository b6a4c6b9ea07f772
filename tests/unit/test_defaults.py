"""One set of defaults: `sgl-hicache replay` and `sgl-hicache serve`, given no tiering options, run
the same policy (`config.TieringPolicy`), so a replay measures the configuration that ships."""

from __future__ import annotations

import dataclasses

from sgl_hicache.cli import build_parser
from sgl_hicache.client.backend_settings import load_settings
from sgl_hicache.client.launch import build_command
from sgl_hicache.client.launch import build_parser as serve_parser
from sgl_hicache.config import DEFAULT_POLICY, TieringPolicy
from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EngineConfig


def _replay_policy(argv: list[str]) -> TieringPolicy:
    """The policy `sgl-hicache replay` builds from `argv` (as cli._replay_embedded does)."""
    args = build_parser().parse_args(["replay", "t.jsonl", *argv])
    return EngineConfig(
        policy=args.policy,
        model=get_model(args.model),
        hardware=get_hardware(args.hardware),
        device_tokens=args.device_tokens,
        eviction_policy=args.eviction,
        write_policy=args.write_policy,
        predictor_budget_tokens=args.predictor_budget,
        predictor=args.predictor,
        admission_min_probability=args.admission,
    ).tiering()


def _serve_policy(argv: list[str]) -> TieringPolicy:
    """The policy the server process of `sgl-hicache serve argv -- --model-path M` runs."""
    ns = serve_parser().parse_args([*argv, "--", "--model-path", "M"])
    _, env = build_command(ns, environ={})
    return load_settings(env).tiering()


def test_replay_and_serve_build_equal_settings_from_no_arguments() -> None:
    # the replay's default policy is `predict` (the queue prefetch plus the predictor), the server's
    # default runs the predictor too; the replay's `prefetch` is the same with the predictor off
    assert DEFAULT_POLICY.predictor == "tree_walk"
    assert _serve_policy([]) == _replay_policy([]) == DEFAULT_POLICY
    assert _replay_policy(["--policy", "prefetch"]) == dataclasses.replace(DEFAULT_POLICY, predictor="none")
    assert _serve_policy(["--predictor", "none"]) == _replay_policy(["--policy", "prefetch"])


def test_a_changed_default_reaches_both_engines() -> None:
    # the parity is not two copies that happen to agree: both read TieringPolicy's fields
    assert _serve_policy(["--write-policy", "write_back"]).write_policy == "write_back"
    assert _replay_policy(["--write-policy", "write_back"]).write_policy == "write_back"
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(TieringPolicy):
        if f.name in fields:
            assert fields[f.name] == f.default, f.name
