"""Tiering settings of the SGLang backend: from a JSON file and/or `SGLHICACHE_*` environment variables.

SGLang's own flags cannot carry our options (its argument parser rejects unknown flags), so a plain
`python -m sglang.launch_server ... --radix-cache-backend sgl_hicache` reads them here, in the scheduler
process, when the backend is built:

1. `SGLHICACHE_CONFIG=/path/to/config.json`: a JSON object whose keys are the field names below;
2. then every `SGLHICACHE_<FIELD>` variable (upper case) overrides the file's value.

Unknown keys, bad types and bad values raise `SettingsError` naming the key and the source.
SGLang's own `--hicache-*` flags map onto these settings too (`hicache_flags.py`). Test and diagnosis
switches are not settings: they live in `debug_settings.py`, environment only.
This module imports no sglang (the launcher uses it to write the config it passes on).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..config import DEFAULT_POLICY, ConfigError, TieringPolicy
from ..policy.admission import ADMISSION_HOLDS

ENV_PREFIX = "SGLHICACHE_"
CONFIG_ENV = "SGLHICACHE_CONFIG"


class SettingsError(ConfigError):
    """A tiering setting is invalid; the message names the key, the value and where it came from."""


@dataclass(frozen=True)
class BackendSettings:
    """Options of the `sgl_hicache` radix-cache backend (all have working defaults).

    Capacities are in tokens. `host_tokens=None` means `host_gb` GiB when given, else `host_ratio` x the
    device pool; `disk_tokens=None`
    means as many tokens as fit in `disk_gb` GiB. `disk_dir=None` means
    `~/.cache/sgl_hicache/<namespace>` (or `$SGLHICACHE_DIR/<namespace>`), where the namespace
    fingerprints the model, its KV layout and the page size, so two models never share pages.
    `disk_tokens=0` turns the disk tier off, `host_tokens=0` the host tier (and with it the disk tier).
    """

    host_tokens: int | None = None
    host_ratio: float = 4.0
    host_gb: float | None = None  # host tier in GiB per rank (SGLang's --hicache-size); overrides host_ratio
    disk_dir: str | None = None
    disk_tokens: int | None = None
    disk_gb: float = 16.0
    disk_fsync: bool = False
    # device -> host: write_through (a background copy at commit) | write_through_selective | write_back
    write_policy: str = DEFAULT_POLICY.write_policy
    write_through_threshold: int = DEFAULT_POLICY.write_through_threshold
    disk_write_policy: str = DEFAULT_POLICY.disk_write_policy  # host -> disk: write_back (watermark) | write_through
    eviction_policy: str | None = None  # lru | lfu; None: SGLang's --radix-eviction-policy when we support it, else lru
    predictor: str = (
        DEFAULT_POLICY.predictor
    )  # tree_walk (promotes likely descendants disk -> host) | continuation | none
    predictor_budget_tokens: int = DEFAULT_POLICY.predictor_budget_tokens
    prefetch: bool = DEFAULT_POLICY.prefetch  # start disk -> host promotion when a request is matched (while it waits)
    learn_returns: bool = DEFAULT_POLICY.learn_returns  # retain a conversation for the pause its history predicts
    transfer_workers: int = 2
    writeback_clean_fraction: float = (
        DEFAULT_POLICY.writeback_clean_fraction
    )  # keep this share of the host tier also on disk, written in the background (0: off)
    device_writeback_clean_fraction: float = (
        DEFAULT_POLICY.device_writeback_clean_fraction
    )  # keep this share of the device pool also on host, copied in the background (0: off)
    load_timeout_s: float = 30.0  # how long a request may wait for its disk pages before it recomputes them
    tenant_salt: str = ""  # extra namespace salt (isolates caches of tenants sharing one disk directory)
    store: str | None = None  # a shared store in the disk tier's place: mooncake://HOST:PORT or redis://HOST:PORT
    store_min_hits: int = 0  # write back to the store only pages hit at least this often
    stats_file: str | None = None  # the scheduler writes JSON stats here every stats_interval_s (atomic rename)
    stats_interval_s: float = 2.0
    eviction_demotes: str = DEFAULT_POLICY.eviction_demotes  # all | host | none: which evictions copy a dirty page down synchronously (CacheConfig); none: never on the scheduler thread
    writeback_batch_pages: int = (
        DEFAULT_POLICY.writeback_batch_pages
    )  # most pages one background write-back round copies per link (it copies only up to the clean watermark)
    layerwise_loads: bool = (
        True  # init_load_back queues host->device copies per layer; the forward of layer i waits for layer i only
    )
    skip_waiting_admission: bool = (
        True  # a request whose prefetch is in flight is skipped this round, not the end of admission
    )
    admission_hold: str = "cost"  # a request offered for the first time to a prefill batch that has one already waits a round: cost (when the measured prefill cost says the split lowers time to first token, policy/admission.py) | always | off
    time_calls: bool = True  # time every cache call the scheduler makes (p50/p99/max in the stats)
    hint_port: int | None = None  # the hint API's port (sglang/hint_server.py); None: off; 0: any free port
    hint_host: str = "127.0.0.1"  # the hint API's bind address
    # re-warm at start (`control/rewarm.py`): a server started on a disk directory brings the prefixes
    # the stopped one used most back to host in the background (TP = 1; off at TP >= 2); the record
    # of them is saved every rewarm_interval_s, written off the scheduler thread
    rewarm: bool = DEFAULT_POLICY.rewarm
    rewarm_interval_s: float = 30.0
    mamba_state_share: float = (
        0.25  # hybrid Mamba models: the share of the host and disk budgets that holds state snapshots
    )

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise SettingsError(msg)

        for name in ("host_tokens", "disk_tokens"):  # (hint_port is checked below)
            v = getattr(self, name)
            need(
                v is None or (isinstance(v, int) and v >= 0),
                f"{name} must be a non-negative integer or null, got {v!r}",
            )
        need(self.host_ratio >= 0, f"host_ratio must be >= 0, got {self.host_ratio!r}")
        need(self.disk_gb >= 0, f"disk_gb must be >= 0, got {self.disk_gb!r}")
        need(
            isinstance(self.transfer_workers, int) and self.transfer_workers >= 1,
            f"transfer_workers must be an integer >= 1, got {self.transfer_workers!r}",
        )
        need(self.load_timeout_s >= 0, f"load_timeout_s must be >= 0, got {self.load_timeout_s!r}")
        need(
            self.admission_hold in ADMISSION_HOLDS,
            f"admission_hold must be one of {', '.join(ADMISSION_HOLDS)}, got {self.admission_hold!r}",
        )
        need(
            self.store is None or "://" in self.store,
            f"store must be a URL (mooncake://HOST:PORT or redis://HOST:PORT), got {self.store!r}",
        )
        need(
            isinstance(self.store_min_hits, int) and self.store_min_hits >= 0,
            f"store_min_hits must be an integer >= 0, got {self.store_min_hits!r}",
        )
        need(
            self.hint_port is None or (isinstance(self.hint_port, int) and 0 <= self.hint_port <= 65535),
            f"hint_port must be a port number (0-65535) or null, got {self.hint_port!r}",
        )
        need(self.rewarm_interval_s > 0, f"rewarm_interval_s must be > 0, got {self.rewarm_interval_s!r}")
        need(self.stats_interval_s > 0, f"stats_interval_s must be > 0, got {self.stats_interval_s!r}")
        need(self.host_gb is None or self.host_gb >= 0, f"host_gb must be >= 0 or null, got {self.host_gb!r}")
        need(
            0.0 <= self.mamba_state_share < 1.0, f"mamba_state_share must be in [0, 1), got {self.mamba_state_share!r}"
        )
        try:  # the policy knobs are checked once, where both engines build them (config.TieringPolicy)
            self.tiering()
        except ConfigError as e:
            raise SettingsError(str(e)) from None

    def tiering(self, sglang_eviction: str | None = None) -> TieringPolicy:
        """The policy the server runs: these settings, with the eviction order resolved
        (`eviction_policy`, else SGLang's `--radix-eviction-policy` when it is one we have, else lru)."""
        eviction = self.eviction_policy or (
            sglang_eviction.lower() if sglang_eviction and sglang_eviction.lower() in ("lru", "lfu") else "lru"
        )
        return TieringPolicy(
            eviction_policy=eviction,
            write_policy=self.write_policy,
            write_through_threshold=self.write_through_threshold,
            disk_write_policy=self.disk_write_policy,
            eviction_demotes=self.eviction_demotes,
            predictor=self.predictor,
            predictor_budget_tokens=self.predictor_budget_tokens,
            prefetch=self.prefetch,
            device_writeback_clean_fraction=self.device_writeback_clean_fraction,
            writeback_clean_fraction=self.writeback_clean_fraction,
            writeback_batch_pages=self.writeback_batch_pages,
            learn_returns=self.learn_returns,
            rewarm=self.rewarm,
        )

    def host_tokens_for(self, device_tokens: int, bytes_per_token: int) -> int:
        """The host tier's capacity: `host_tokens`, else `host_gb` GiB, else `host_ratio` x the device pool."""
        if self.host_tokens is not None:
            return self.host_tokens
        if self.host_gb is not None:
            return int(self.host_gb * (1 << 30)) // max(1, bytes_per_token)
        return int(device_tokens * self.host_ratio)

    def disk_tokens_for(self, bytes_per_token: int) -> int:
        if self.disk_tokens is not None:
            return self.disk_tokens
        return int(self.disk_gb * (1 << 30)) // max(1, bytes_per_token)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def replace(self, **changes: Any) -> BackendSettings:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in fields(BackendSettings)}
_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, raw: Any, source: str) -> Any:
    """Turn a JSON value or an environment string into the field's type."""
    default = _FIELDS[name].default
    kind: type | None = type(default) if default is not None else None
    optional_int = name in ("host_tokens", "disk_tokens", "hint_port")
    optional_float = name == "host_gb"
    if optional_float:
        kind = float
    optional_str = name in ("disk_dir", "eviction_policy", "stats_file", "store")
    if isinstance(raw, str) and source.startswith("env"):
        text = raw.strip()
        if (optional_int or optional_float or optional_str) and text.lower() in ("", "none", "null", "auto"):
            return None
        try:
            if kind is bool:
                if text.lower() in _BOOL_TRUE:
                    return True
                if text.lower() in _BOOL_FALSE:
                    return False
                raise ValueError
            if optional_int or kind is int:
                return int(text)
            if kind is float:
                return float(text)
        except ValueError:
            raise SettingsError(
                f"{source}: {name}={raw!r} is not a valid {('boolean' if kind is bool else 'integer' if optional_int or kind is int else 'number')}"
            ) from None
        return text
    if raw is None:
        if optional_int or optional_float or optional_str:
            return None
        raise SettingsError(f"{source}: {name} must not be null")
    if kind is bool and not isinstance(raw, bool):
        raise SettingsError(f"{source}: {name} must be true or false, got {raw!r}")
    if (optional_int or kind is int) and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise SettingsError(f"{source}: {name} must be an integer, got {raw!r}")
    if kind is float and (isinstance(raw, bool) or not isinstance(raw, (int, float))):
        raise SettingsError(f"{source}: {name} must be a number, got {raw!r}")
    if (optional_str or kind is str) and not isinstance(raw, str):
        raise SettingsError(f"{source}: {name} must be a string, got {raw!r}")
    return float(raw) if kind is float else raw


def load_settings(env: Mapping[str, str] | None = None) -> BackendSettings:
    """Settings from `$SGLHICACHE_CONFIG` (JSON) then `SGLHICACHE_<FIELD>` overrides."""
    return BackendSettings(**given_settings(env))


def given_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the user gave, by key: `$SGLHICACHE_CONFIG`'s, then the `SGLHICACHE_<FIELD>` overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = env.get(CONFIG_ENV)
    if path:
        p = Path(path)
        try:
            obj = json.loads(p.read_text())
        except FileNotFoundError:
            raise SettingsError(f"{CONFIG_ENV}={path!r}: no such file") from None
        except (OSError, ValueError) as e:
            raise SettingsError(f"{CONFIG_ENV}={path!r}: cannot read JSON: {e}") from None
        if not isinstance(obj, dict):
            raise SettingsError(f"{path}: the config must be a JSON object, got {type(obj).__name__}")
        for key, raw in obj.items():
            if key not in _FIELDS:
                raise SettingsError(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(_FIELDS))}")
            values[key] = _coerce(key, raw, f"{path}")
    for name in _FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in env:
            values[name] = _coerce(name, env[var], f"env {var}")
    return values


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """`SGLHICACHE_*` variables that name no setting (likely typos; the backend logs them)."""
    env = os.environ if env is None else env
    from .debug_settings import DEBUG_ENV

    known = (
        {ENV_PREFIX + n.upper() for n in _FIELDS}
        | set(DEBUG_ENV)
        | {CONFIG_ENV, "SGLHICACHE_DIR", "SGLHICACHE_CPU_HICACHE_HOST_RESERVE_BYTES"}
    )
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)


def settings_env(settings: BackendSettings) -> dict[str, str]:
    """Environment variables that reproduce `settings` in another process (only non-default fields)."""
    out: dict[str, str] = {}
    for f in fields(BackendSettings):
        v = getattr(settings, f.name)
        if v == f.default:
            continue
        if v is None:
            out[ENV_PREFIX + f.name.upper()] = "none"
        elif isinstance(v, bool):
            out[ENV_PREFIX + f.name.upper()] = "1" if v else "0"
        else:
            out[ENV_PREFIX + f.name.upper()] = str(v)
    return out


__all__ = [
    "BackendSettings",
    "CONFIG_ENV",
    "ENV_PREFIX",
    "SettingsError",
    "given_settings",
    "load_settings",
    "settings_env",
    "unknown_env",
]
