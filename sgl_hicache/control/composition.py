"""The one composition root: settings + stores + an executor -> the cache and its controller.

The SGLang backend (`sglang/factory.py`) and the embedded engine (`engine/simulator.py`) both build
through here, so the two differ only in their stores, their executor and their clock, never in a
policy or a default (`config.TieringPolicy`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..cache import TieredCache
from ..config import CacheConfig, TieringPolicy
from ..policy.predictor import Predictor
from ..policy.predictor_factory import make_predictor
from ..tiers.base import TierStore
from ..transfer.executors import Executor
from .lifecycle import ControllerSettings, RequestController


def controller_settings(policy: TieringPolicy) -> ControllerSettings:
    """The lifecycle's knobs of `policy`."""
    return ControllerSettings(
        prefetch=policy.prefetch,
        device_writeback_clean_fraction=policy.device_writeback_clean_fraction,
        writeback_clean_fraction=policy.writeback_clean_fraction,
        writeback_batch_pages=policy.writeback_batch_pages,
        learn_returns=policy.learn_returns,
    )


def build_cache(
    config: CacheConfig,
    *,
    device: TierStore | None = None,
    host: TierStore | None = None,
    lower: TierStore | None = None,
    clock: Callable[[], float] = time.monotonic,
    priority: Callable | None = None,
) -> TieredCache:
    """A cache a controller drives: its write-through copies are the controller's background work,
    never made inline by the thread that inserts."""
    return TieredCache(
        config, device=device, host=host, disk=lower, clock=clock, priority=priority, inline_writes=False
    )


def build_controller(
    cache: TieredCache,
    executor: Executor,
    policy: TieringPolicy,
    clock: Callable[[], float],
    predictor: Predictor | None = None,
) -> RequestController:
    """The controller over `cache`: `policy`'s predictor (or the one given: the oracle's) and knobs."""
    if predictor is None:
        # the tree walk reads its counts with the half-life the cache writes them with (learned by the tree)
        kw = {"half_life": lambda: cache.tree.half_life.value} if policy.predictor == "tree_walk" else {}
        predictor = make_predictor(
            policy.predictor, cache.page_size, policy.predictor_budget_tokens, model=cache.reuse, **kw
        )
    return RequestController(cache, executor, predictor, controller_settings(policy), clock=clock)
