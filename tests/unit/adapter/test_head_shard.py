"""Which KV heads a rank's cache holds (`sglang/parallel/head_shard.py`) and what that changes: page
keys without the TP size, one base directory for every shard, a store key per shard."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sgl_hicache.config import HeadShard, KVLayout
from sgl_hicache.hashing import Namespace
from sgl_hicache.sglang.parallel.head_shard import head_shard, total_kv_heads
from sgl_hicache.sglang.parallel.rank_consensus import RankConsensus
from sgl_hicache.tiers.shared_store import SharedStoreTier
from sgl_hicache.tiers.store_protocol import StoreBackend

MHA = SimpleNamespace(kind="mha", replicated_across_tp=False)


@pytest.mark.parametrize(
    ("adapter", "local", "rank", "size", "total", "want"),
    [
        (MHA, 8, 0, 1, 8, HeadShard(0, 8, 8)),
        (MHA, 2, 3, 4, 8, HeadShard(6, 8, 8)),
        (MHA, 2, 1, 2, None, HeadShard(2, 4, 4)),
        (SimpleNamespace(kind="draft", replicated_across_tp=False), 1, 1, 2, 2, HeadShard(1, 2, 2)),
        (MHA, 1, 3, 8, 4, None),  # TP above the KV head count: heads replicated over ranks
        (SimpleNamespace(kind="mla", replicated_across_tp=True), 1, 1, 2, 1, None),
        (SimpleNamespace(kind="mamba", replicated_across_tp=False), 2, 0, 2, 4, None),
    ],
)
def test_a_rank_holds_its_even_share_of_the_heads(adapter, local, rank, size, total, want) -> None:
    assert head_shard(adapter, local, rank, size, total) == want


def test_total_heads_come_from_sglang_model_config() -> None:
    assert total_kv_heads(SimpleNamespace(get_total_num_kv_heads=lambda: 8)) == 8
    assert total_kv_heads(None) is None


def test_sharded_ranks_key_pages_without_the_tp_size(tmp_path: Path) -> None:
    c = RankConsensus(None, 1, 2)
    assert c.salt == "tp=2" and c.rank_dir(tmp_path) == tmp_path / "tp2-rank1"
    c.shard_heads()
    assert c.salt == "" and c.rank_dir(tmp_path) == tmp_path  # the store adds its heads' directory


class _Dict(StoreBackend):
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.data for k in keys]

    def get(self, key: str, max_bytes: int) -> bytes | None:
        return self.data.get(key)

    def put(self, keys: list[str], values: list[bytes]) -> list[bool]:
        self.data.update(zip(keys, values))
        return [True] * len(keys)


def test_each_shard_has_its_own_store_keys() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    ns = Namespace.for_model(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), 4)
    key = bytes(range(16))
    names = {SharedStoreTier(layout, 4, 8, _Dict(), ns, shard=HeadShard(h, h + 1, 2)).store_key(key) for h in range(2)}
    assert len(names) == 2  # ranks of one TP size never write one key
    whole = SharedStoreTier(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), 4, 8, _Dict(), ns)
    assert whole.store_key(key) == f"sglh/{ns.root.hex()}/{key.hex()}"
