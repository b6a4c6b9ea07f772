"""The residency manager (`TieredCache`) and the jobs it delegates, one module each."""

from .residency import TieredCache
from .results import InsertOutcome, PrefixMatch

__all__ = ["InsertOutcome", "PrefixMatch", "TieredCache"]
