"""SGLang's own `--hicache-*` flags, read as this backend's settings (no sglang import).

A user switching from SGLang HiCache keeps the flags they know: with `--radix-cache-backend
sgl_hicache`, the flags that have a meaning here map onto `BackendSettings`, and the others are
refused with a message naming the flag (a flag that silently did nothing would be worse).

| SGLang flag | here |
|---|---|
| `--hicache-ratio R` | `host_ratio=R` (host tier = R x the device pool) |
| `--hicache-size G` | `host_gb=G` (host tier of G GiB per rank; overrides the ratio, as in HiCache) |
| `--hicache-write-policy P` | `write_policy=P` (same three names) |
| `--hicache-storage-backend file` | the disk tier, in `$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` when set |
| `--hicache-storage-backend mooncake` | `store=mooncake://MASTER?metadata=URL`, from `--hicache-storage-backend-extra-config` (`master_server_address`, `metadata_server`) or `$MOONCAKE_MASTER` / `$MOONCAKE_TE_META_DATA_SERVER` |

A flag counts as given when its value differs from SGLang's default (`hicache_ratio` and
`hicache_storage_backend` default to None, `hicache_size` to 0; `hicache_write_policy`'s default,
`write_through`, is also ours). A setting given both ways, as a `--hicache-*` flag and in
`SGLHICACHE_*` / the JSON config, with different values is an error naming both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..client.backend_settings import BackendSettings, SettingsError

# SGLang 0.5.23's defaults (sglang/srt/arg_groups/fields/memory.py) for the flags that have no meaning here
_NO_MEANING_DEFAULTS: dict[str, Any] = {
    "hicache_host_memory_mode": "cache",
    "hicache_io_backend": "kernel",
    "hicache_mem_layout": "page_first",
    "hicache_storage_prefetch_policy": "timeout",
}
_WHY_NO_MEANING = {
    "hicache_host_memory_mode": "the host tier is always a cache here",
    "hicache_io_backend": "sgl_hicache moves bytes with its own transfer engine (layer-wise loads)",
    "hicache_mem_layout": "sgl_hicache's host tier has its own page layout",
    "hicache_storage_prefetch_policy": "sgl_hicache decides per request whether a disk load pays (load_timeout_s)",
}
STORAGE_BACKENDS = ("file", "mooncake")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _extra_config(raw: Any) -> dict[str, Any]:
    if raw in (None, ""):
        return {}
    if isinstance(raw, dict):
        return raw
    text = str(raw)
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise SettingsError(f"--hicache-storage-backend-extra-config {raw!r}: cannot read the file: {e}") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise SettingsError(
            f"--hicache-storage-backend-extra-config: not a JSON object ({e}); sgl_hicache reads only JSON here"
        ) from None
    if not isinstance(obj, dict):
        raise SettingsError("--hicache-storage-backend-extra-config must be a JSON object")
    return obj


def _mooncake_url(extra: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    master = extra.get("master_server_address") or environ.get("MOONCAKE_MASTER")
    if not master:
        raise SettingsError(
            "--hicache-storage-backend mooncake needs the master's address: "
            "master_server_address in --hicache-storage-backend-extra-config, or $MOONCAKE_MASTER"
        )
    metadata = extra.get("metadata_server") or environ.get("MOONCAKE_TE_META_DATA_SERVER")
    url = f"mooncake://{master}"
    if metadata and str(metadata).startswith("http"):
        url += f"?metadata={metadata}"
    return url


def hicache_flag_settings(server_args: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings SGLang's `--hicache-*` flags in `server_args` ask for (keys of `BackendSettings`).

    Raises `SettingsError` naming every given flag that has no meaning here or a value we cannot serve."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    problems: list[str] = []
    for name, default in _NO_MEANING_DEFAULTS.items():
        value = getattr(server_args, name, default)
        if value != default:
            problems.append(f"{_flag(name)} {value} has no meaning with sgl_hicache ({_WHY_NO_MEANING[name]}); drop it")
    ratio = getattr(server_args, "hicache_ratio", None)
    if ratio is not None:
        out["host_ratio"] = float(ratio)
    size = getattr(server_args, "hicache_size", 0) or 0
    if size:
        out["host_gb"] = float(size)
    policy = getattr(server_args, "hicache_write_policy", "write_through")
    if policy != "write_through":
        out["write_policy"] = str(policy)
    backend = getattr(server_args, "hicache_storage_backend", None)
    extra = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if backend == "file":
        directory = environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
        if directory:
            out["disk_dir"] = directory
    elif backend == "mooncake":
        try:
            out["store"] = _mooncake_url(_extra_config(extra), environ)
        except SettingsError as e:
            problems.append(str(e))
    elif backend is not None:
        problems.append(
            f"--hicache-storage-backend {backend} is not served by sgl_hicache; "
            f"choose one of {', '.join(STORAGE_BACKENDS)} (or drop it: the disk tier is on by default)"
        )
    if extra not in (None, "") and backend != "mooncake":
        problems.append("--hicache-storage-backend-extra-config is read only with --hicache-storage-backend mooncake")
    if problems:
        raise SettingsError("; ".join(problems))
    return out


def apply_hicache_flags(
    settings: BackendSettings, server_args: Any, given: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> BackendSettings:
    """`settings` with SGLang's `--hicache-*` flags mapped onto it.

    `given` holds the settings the user set through `SGLHICACHE_*` or the JSON config
    (`settings.given_settings`); a flag that disagrees with one of them is an error naming both."""
    mapped = hicache_flag_settings(server_args, environ)
    clashes = [
        f"{key}={given[key]!r} (SGLHICACHE_{key.upper()} or the config) against {value!r} from a --hicache-* flag"
        for key, value in mapped.items()
        if key in given and given[key] != value
    ]
    if clashes:
        raise SettingsError("a setting given twice with different values: " + "; ".join(clashes))
    return settings.replace(**mapped) if mapped else settings


__all__ = ["STORAGE_BACKENDS", "apply_hicache_flags", "hicache_flag_settings"]
