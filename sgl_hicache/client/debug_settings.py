"""Test and diagnosis switches of the SGLang backend: environment only, never user settings.

They make the server slower or make it fail on purpose, so they are not in `BackendSettings`, the
JSON config or `sgl-hicache serve`'s flags:

- `SGLHICACHE_CHECK_INVARIANTS=1`: check the tree and every store's accounting after each scheduler call;
- `SGLHICACHE_CHECK_SCHEDULER_IO=1`: count the copies, disk writes, sleeps and waits made inside
  scheduler calls (`call_timer.IOGuard`; the tests assert they are 0);
- `SGLHICACHE_CONSENSUS_CHECK=1`: at TP >= 2, all-reduce a digest of each rank's tree every step and
  stop on a difference;
- `SGLHICACHE_FAULT_DISK_READ_FILE=PATH`: while PATH holds a TP rank's number, that rank's disk reads fail.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEBUG_ENV = (
    "SGLHICACHE_CHECK_INVARIANTS",
    "SGLHICACHE_CHECK_SCHEDULER_IO",
    "SGLHICACHE_CONSENSUS_CHECK",
    "SGLHICACHE_FAULT_DISK_READ_FILE",
)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class DebugSettings:
    """The switches above; all off by default. `from_env` raises ValueError naming a bad value."""

    check_invariants: bool = False
    check_scheduler_io: bool = False
    consensus_check: bool = False
    fault_disk_read_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DebugSettings:
        env = os.environ if env is None else env

        def flag(var: str) -> bool:
            text = env.get(var, "").strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError(f"env {var}={env[var]!r} is not a boolean (1/0, true/false, on/off)")
            return text in _TRUE

        return cls(
            check_invariants=flag("SGLHICACHE_CHECK_INVARIANTS"),
            check_scheduler_io=flag("SGLHICACHE_CHECK_SCHEDULER_IO"),
            consensus_check=flag("SGLHICACHE_CONSENSUS_CHECK"),
            fault_disk_read_file=env.get("SGLHICACHE_FAULT_DISK_READ_FILE") or None,
        )


__all__ = ["DEBUG_ENV", "DebugSettings"]
