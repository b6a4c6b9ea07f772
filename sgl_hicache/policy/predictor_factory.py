"""The one predictor factory: every predictor by its name (`config.PREDICTORS`)."""

from __future__ import annotations

from .predictor import Predictor, TreeWalkPredictor
from .reuse import ContinuationPredictor, ReuseModel


def make_predictor(name: str, page_size: int, budget_tokens: int, model: object = None, **kw: object) -> Predictor:
    """The predictor called `name`; `continuation` reads the cache's reuse model (`TieredCache.reuse`)."""
    if name == "none":
        return Predictor()
    if name == "tree_walk":
        return TreeWalkPredictor(page_size, budget_tokens, **kw)  # type: ignore[arg-type]
    if name == "continuation":
        if not isinstance(model, ReuseModel):
            raise ValueError("the continuation predictor needs the cache's reuse model (TieredCache.reuse)")
        return ContinuationPredictor(model, page_size, budget_tokens, **kw)  # type: ignore[arg-type]
    raise ValueError(f"unknown predictor {name!r}; choose one of none, tree_walk, continuation")
