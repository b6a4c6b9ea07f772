"""Argument types of the command line (argparse `type=` callables): a bad value is an
`argparse.ArgumentTypeError` naming what was expected and what was given."""

from __future__ import annotations

import argparse


def int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum` (1e6-style values accepted)."""

    def parse(text: str) -> int:
        try:
            value = int(float(text)) if text.lower().endswith(("e3", "e6", "e9")) else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


__all__ = ["int_at_least", "non_negative_float", "positive_float"]
