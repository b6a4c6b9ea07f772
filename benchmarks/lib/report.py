"""Report helpers: medians that skip missing values, one number format, the commit measured."""

from __future__ import annotations

import statistics
import subprocess

from benchmarks.lib.paths import REPO


def med(xs: list[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str) -> str:
    """`x` formatted with `spec`, or "-" for a missing value."""
    return "-" if x is None else format(x, spec)


def git_rev() -> str | None:
    """HEAD of this checkout, with "+dirty(sgl_hicache/)" when the package has local changes; None
    without git."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "sgl_hicache"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty(sgl_hicache/)" if dirty else "")) or None
