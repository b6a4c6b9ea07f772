"""The embedded engine as the agent benchmarks run it: llama3-8b on the H200 cost model, the
replay's own clock (open loop), pages accounted without their bytes."""

from __future__ import annotations

from typing import Any

from sgl_hicache.sim.presets import get_hardware, get_model
from sgl_hicache.sim.simulator import EmbeddedEngine, EngineConfig


def agent_engine(policy: str, device: int, host: int, disk: int, **overrides: Any) -> EmbeddedEngine:
    """A fresh engine for one policy at these tier sizes (tokens), with `overrides` of
    `EngineConfig`'s fields; the caller closes it."""
    return EmbeddedEngine(
        EngineConfig(
            policy=policy,
            model=get_model("llama3-8b"),
            hardware=get_hardware("h200"),
            device_tokens=device,
            host_tokens=host,
            disk_tokens=disk,
            concurrency=None,
            byte_mode="metadata",
            **overrides,
        )
    )


def percentile(xs: list[float], q: float) -> float:
    """The `q` quantile of `xs` (the sample at rank q x n, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
