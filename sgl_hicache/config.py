"""Frozen, validated configuration: the KV layout of a model and the tier capacities of a cache.

Every value is checked when the object is built, so a bad flag or a bad config file fails at start
with a message that names the field, never later inside the serving path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

EVICTION_POLICIES = ("lru", "lfu", "reuse")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DISK_WRITE_POLICIES = ("write_back", "write_through")
PREDICTORS = ("none", "tree_walk", "continuation")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV cache: what a page holds and what the namespace fingerprints.

    Two caches whose layouts differ in any field never share a page key (see `hashing.Namespace`).
    `kv_planes` is how many per-layer buffers a token has: 2 for K and V (MHA / GQA), 1 for MLA's
    one latent + rope row (then `num_kv_heads` is 1 and `head_dim` is the row's width).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    architecture: str = "llama"
    kv_planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"KVLayout.{name} must be a positive integer, got {value!r}")
        _require(self.dtype in _DTYPES, f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        _require(bool(self.architecture), "KVLayout.architecture must not be empty")
        _require(
            self.kv_planes in (1, 2),
            f"KVLayout.kv_planes must be 1 (MLA latent) or 2 (K and V), got {self.kv_planes!r}",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @functools.cached_property  # asked on every transfer; computing it makes a tensor
    def bytes_per_token(self) -> int:
        """Every plane (K and V, or MLA's latent) of every layer for one token."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.kv_planes * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class HeadShard:
    """The KV heads `[lo, hi)` of a model's `total` that one cache holds (a tensor-parallel rank's
    shard of an MHA / GQA model; `whole` at TP 1).

    Page keys are named by the whole model (`CacheConfig.key_layout`), so every TP size names a page
    alike; what differs is which heads its bytes hold, and the disk tier keeps each shard's pages in a
    directory of its own (`tiers/disk/head_shards.py`), from which a cache of another TP size
    assembles the heads it needs.
    """

    lo: int
    hi: int
    total: int

    def __post_init__(self) -> None:
        _require(
            all(isinstance(v, int) for v in (self.lo, self.hi, self.total)) and 0 <= self.lo < self.hi <= self.total,
            f"HeadShard needs 0 <= lo < hi <= total, got lo={self.lo!r} hi={self.hi!r} total={self.total!r}",
        )

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.total

    @property
    def heads(self) -> int:
        return self.hi - self.lo


EVICTION_DEMOTES = ("all", "host", "none")


def _check_policy_knobs(c: TieringPolicy | CacheConfig) -> None:
    """The checks of the policy knobs `TieringPolicy` and `CacheConfig` share (each names its field)."""
    _require(
        c.eviction_policy in EVICTION_POLICIES,
        f"eviction_policy: unknown eviction policy {c.eviction_policy!r}; choose one of {', '.join(EVICTION_POLICIES)}",
    )
    _require(
        c.write_policy in WRITE_POLICIES,
        f"write_policy: unknown write policy {c.write_policy!r}; choose one of {', '.join(WRITE_POLICIES)}",
    )
    _require(
        c.disk_write_policy in DISK_WRITE_POLICIES,
        f"disk_write_policy: unknown disk write policy {c.disk_write_policy!r}; choose one of {', '.join(DISK_WRITE_POLICIES)}",
    )
    _require(
        c.eviction_demotes in EVICTION_DEMOTES,
        f"eviction_demotes must be one of {', '.join(EVICTION_DEMOTES)}, got {c.eviction_demotes!r}",
    )
    _require(
        c.predictor in PREDICTORS,
        f"predictor: unknown predictor {c.predictor!r}; choose one of {', '.join(PREDICTORS)}",
    )
    _require(
        isinstance(c.write_through_threshold, int) and c.write_through_threshold >= 1,
        f"write_through_threshold must be an integer >= 1, got {c.write_through_threshold!r}",
    )


@dataclass(frozen=True)
class TieringPolicy:
    """The policy knobs both engines share, with the one set of defaults that ships.

    The SGLang backend (`sglang/settings.py: BackendSettings`) and the embedded engine
    (`engine/simulator.py: EngineConfig`) take their defaults from here, so a replay measures the
    configuration the server runs; `tests/unit/test_defaults.py` asserts they agree. Why each default:
    - `write_policy="write_through"`: every committed device page gets a host copy in the
      background at commit (the pump's first job), so a page is clean by the time it is evictable
      and eviction never copies nor drops (SGLang HiCache's default too);
    - `eviction_demotes="none"`: eviction never copies on the thread that evicts (SGLang's
      scheduler thread); a dirty victim is taken only when no clean one is left, and counted;
    - `disk_write_policy="write_through"`: a page that lands on host gets a disk copy in the
      background too, so host eviction drops clean pages (on the shipped trace's first 2,000
      requests the watermark alone dropped 16 % of host evictions dirty: 25.6 % hits against 28.4 %);
    - `writeback_clean_fraction`: under `write_back`, the share of a tier kept clean, raised when the
      measured eviction rate needs more (`policy/writeback.py: watermark_pages`);
    - `predictor="tree_walk"`: descendant prediction is on, beside the queue prefetch. It stays
      silent where nothing can be gained: 0 tokens promoted on every multi-turn trace family at
      0.1-0.3x its working set (docs/results.md, "Prediction"), through the guard, the
      shadow bets, the prefetch room and the stay test (`speculation.py`); `none` turns it off;
    - `learn_returns=False`: with it on, a conversation is retained for the pause its own past pauses
      predict, as a client's tool-call hint would ask, ranked against what the other pages are worth
      (`control/hint_desk.py`, `policy/return_gaps.py`). Off: on recorded agent sessions it gained
      only where the device was tight (0.97x mean) and cost elsewhere (up to 1.065x p99, 1.015x mean),
      and the server does not read a call's ending yet (`docs/agent-hints.md`, "The server's own retentions");
    - `rewarm=True`: a cache restarted on a disk directory brings back to host, in the background and
      into free host pages only, the prefixes the stopped one used most (`control/rewarm.py`): its
      first requests hit host instead of disk, and nothing is evicted for it.
    """

    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    disk_write_policy: str = "write_through"
    eviction_demotes: str = "none"
    predictor: str = "tree_walk"
    predictor_budget_tokens: int = 8192
    prefetch: bool = True
    device_writeback_clean_fraction: float = 0.25
    writeback_clean_fraction: float = 0.25
    writeback_batch_pages: int = 1024
    admission_min_probability: float = 0.0
    learn_returns: bool = False
    rewarm: bool = True

    def __post_init__(self) -> None:
        _check_policy_knobs(self)
        _require(
            isinstance(self.predictor_budget_tokens, int) and self.predictor_budget_tokens >= 0,
            f"predictor_budget_tokens must be an integer >= 0, got {self.predictor_budget_tokens!r}",
        )
        for name in ("device_writeback_clean_fraction", "writeback_clean_fraction"):
            value = getattr(self, name)
            _require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value!r}")
        _require(
            isinstance(self.writeback_batch_pages, int) and self.writeback_batch_pages >= 1,
            f"writeback_batch_pages must be an integer >= 1, got {self.writeback_batch_pages!r}",
        )

    def replace(self, **changes: Any) -> TieringPolicy:
        return dataclasses.replace(self, **changes)


DEFAULT_POLICY = TieringPolicy()


@dataclass(frozen=True)
class CacheConfig:
    """Capacities and policies of a tiered cache. Capacities are in tokens and rounded down to pages.

    `host_tokens == 0` disables the host tier, `disk_tokens == 0` (or no `disk_dir`) the disk tier;
    with both off the cache behaves like SGLang's plain radix cache (evicted means recomputed).
    """

    layout: KVLayout
    device_tokens: int
    host_tokens: int = 0
    disk_tokens: int = 0
    page_size: int = 16
    disk_dir: Path | None = None
    # the policy knobs default to what ships (TieringPolicy), so a cache built from defaults runs as the server does
    eviction_policy: str = DEFAULT_POLICY.eviction_policy
    write_policy: str = DEFAULT_POLICY.write_policy
    write_through_threshold: int = DEFAULT_POLICY.write_through_threshold
    disk_write_policy: str = DEFAULT_POLICY.disk_write_policy
    predictor: str = DEFAULT_POLICY.predictor
    # with the reuse model: a page evicted from a tier is copied one tier down only when its expected
    # reuse is at least this (0: every evicted page is kept below, as before)
    admission_min_probability: float = DEFAULT_POLICY.admission_min_probability
    tenant_salt: str = ""
    disk_fsync: bool = False
    # Which evictions copy a dirty page one tier down, synchronously: "all" (device -> host and host
    # -> disk), "host" (device -> host only: a memory copy; a dirty host page is dropped, never written
    # to disk here), "none" (eviction never copies). A dirty page not copied is dropped and counted in
    # `dropped_dirty_tokens`; background write-back keeps pages clean ahead of eviction.
    eviction_demotes: str = DEFAULT_POLICY.eviction_demotes
    store_url: str | None = None  # a shared store (mooncake://, redis://) in the disk tier's place
    store_tokens: int = 1 << 24  # how many of the store's tokens this cache's tree may track
    store_min_hits: int = 0  # write back to the store only pages hit at least this often
    # the heads of the model this cache holds (None: all of them, and page keys name this layout)
    head_shard: HeadShard | None = None

    def __post_init__(self) -> None:
        _require(
            isinstance(self.page_size, int) and self.page_size >= 1,
            f"page_size must be an integer >= 1, got {self.page_size!r}",
        )
        for name in ("device_tokens", "host_tokens", "disk_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"{name} must be a non-negative integer, got {value!r}")
        _require(
            self.device_tokens >= self.page_size,
            f"device_tokens ({self.device_tokens}) must hold at least one page of {self.page_size} tokens",
        )
        _check_policy_knobs(self)
        _require(
            0.0 <= self.admission_min_probability <= 1.0,
            f"admission_min_probability must be in [0, 1], got {self.admission_min_probability!r}",
        )
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))
            _require(
                not self.disk_dir.exists() or self.disk_dir.is_dir(),
                f"disk_dir {str(self.disk_dir)!r} exists and is not a directory",
            )
        if self.disk_tokens > 0:
            _require(self.disk_dir is not None, "disk_tokens > 0 needs a disk_dir")
        if self.head_shard is not None:
            _require(
                self.head_shard.heads == self.layout.num_kv_heads,
                f"head_shard {self.head_shard} holds {self.head_shard.heads} KV heads, the layout "
                f"{self.layout.num_kv_heads}",
            )
        if self.store_url:
            _require(
                self.disk_pages == 0,
                "a store tier takes the disk tier's place: give disk_tokens=0 (or no disk_dir) with store_url",
            )
            _require(
                self.host_tokens >= self.page_size,
                "a store tier needs a host tier (host_tokens >= page_size): pages reach it through host",
            )
            _require(
                isinstance(self.store_tokens, int) and self.store_tokens >= self.page_size,
                f"store_tokens must be an integer >= page_size, got {self.store_tokens!r}",
            )
            _require(
                isinstance(self.store_min_hits, int) and self.store_min_hits >= 0,
                f"store_min_hits must be an integer >= 0, got {self.store_min_hits!r}",
            )

    @property
    def key_layout(self) -> KVLayout:
        """The layout page keys are named by: the whole model's when this cache holds a shard of its
        KV heads, so that caches of every TP size name a page alike."""
        if self.head_shard is None:
            return self.layout
        return dataclasses.replace(self.layout, num_kv_heads=self.head_shard.total)

    @property
    def device_pages(self) -> int:
        return self.device_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_size

    @property
    def disk_pages(self) -> int:
        return self.disk_tokens // self.page_size if self.disk_dir is not None else 0

    @property
    def store_pages(self) -> int:
        return self.store_tokens // self.page_size if self.store_url else 0

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.layout.bytes_per_token

    def replace(self, **changes: Any) -> CacheConfig:
        return dataclasses.replace(self, **changes)


def default_disk_dir() -> Path:
    """Where the disk tier lives when the user names no directory."""
    base = os.environ.get("SGLHICACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sgl_hicache")
    return Path(base)


__all__ = [
    "CacheConfig",
    "ConfigError",
    "DEFAULT_POLICY",
    "TieringPolicy",
    "DISK_WRITE_POLICIES",
    "EVICTION_POLICIES",
    "KVLayout",
    "PREDICTORS",
    "WRITE_POLICIES",
    "default_disk_dir",
]
