"""Tree workloads and allocators shared by the tree benchmarks: the trace prompts' options
(`add_trace_args`), the synthetic sessions of a production-size pool (`requests_with_growth`,
`add_workload_args`), a mock allocator for SGLang's simulated `RadixCache` and the allocator its
server builds (`server_allocator`, needs SGLang)."""

from __future__ import annotations

import argparse
import random
from array import array
from collections.abc import Iterator
from pathlib import Path

from benchmarks.lib.paths import DEFAULT_TRACE
from sgl_hicache.config import KVLayout

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1)  # the tree does not care about KV bytes


class MockAllocator:
    """What RadixCache.create_simulated needs from a KV allocator: nothing is really freed."""

    device = "cpu"

    def free(self, idx) -> None:
        pass

    def free_segment(self, idx, start_pos: int = 0) -> None:
        pass


def server_allocator(size: int, page_size: int, head_dim: int | None = None, dtype=None):
    """The KV allocator SGLang 0.5.23's server builds for a plain model outside PD disaggregation
    (`kv_cache_configurator.py`, the last `else` branch: no sort on free); with `head_dim`, over a
    real KV pool of one layer and one head of that dimension on CPU (what `SGLangDevicePool` reads
    its layout from), in `dtype` (default float16)."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dtype = dtype or torch.float16
    kv = None
    if head_dim is not None:
        kv = MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            head_num=1,
            head_dim=head_dim,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
    if page_size == 1:
        return TokenToKVPoolAllocator(size, dtype=dtype, device="cpu", kvcache=kv, need_sort=False)
    return PagedTokenToKVPoolAllocator(
        size, page_size=page_size, dtype=dtype, device="cpu", kvcache=kv, need_sort=False
    )


def add_trace_args(ap: argparse.ArgumentParser, repeats: int, quick_requests: int = 50) -> None:
    """The options of a benchmark that replays the first prompts of the trace (`tree.overhead`,
    `tree.hicache_peer`, `io.disk_shared_match`); `quick_requests`: what ``--quick`` runs."""
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=2000, help="first N lines of the trace (default 2000)")
    ap.add_argument("--scale", type=int, default=32, help="tokens per 512-token trace block (default 32)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--repeats", type=int, default=repeats, help=f"interleaved rounds; figures are medians (default {repeats})"
    )
    ap.add_argument("--quick", action="store_true", help=f"smallest size: {quick_requests} requests, 2 rounds")


def requests(args: argparse.Namespace, page_size: int) -> Iterator[array]:
    """The request stream (int64 token arrays, as SGLang's `RadixKey.token_ids`); the same for
    every side at one page size."""
    for prompt, _ in requests_with_growth(args, page_size):
        yield prompt


def requests_with_growth(args: argparse.Namespace, page_size: int) -> Iterator[tuple[array, int]]:
    """`requests`, each with the new tokens the stream has added so far (its own and every earlier
    request's turns): a tree of the pool's size evicts from about when this passes `--pool-tokens`."""
    rng = random.Random(args.seed)
    node = max(page_size, (args.pool_tokens // args.target_nodes) // page_size * page_size)
    history = args.history_tokens or 32 * node
    n_sessions = args.sessions or max(1, int(1.5 * args.pool_tokens / (history / 2)))
    systems = [array("q", rng.choices(range(1, 1 << 20), k=args.system_tokens)) for _ in range(args.system_prompts)]
    sessions: list[tuple[int, array]] = [(rng.randrange(args.system_prompts), array("q")) for _ in range(n_sessions)]
    inserted = 0
    budget = args.pressure * args.pool_tokens
    while inserted < budget:
        i = rng.randrange(n_sessions)
        sys_id, hist = sessions[i]
        if len(hist) > history:
            sys_id, hist = rng.randrange(args.system_prompts), array("q")
        elif hist and rng.random() < args.branch:
            hist = hist[: rng.randrange(len(hist) // page_size + 1) * page_size]  # regenerate from there
        turn = array("q", rng.choices(range(1, 1 << 20), k=node * rng.randint(1, 3)))
        hist = hist + turn
        sessions[i] = (sys_id, hist)
        prompt = systems[sys_id] + hist
        inserted += len(turn)
        yield prompt[: len(prompt) - len(prompt) % page_size], inserted


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic stream's options (`tree.scale`, `tree.hicache_peer --workload tree_scale`)."""
    ap.add_argument("--pool-tokens", type=int, default=1_000_000, help="device pool, tokens (default 1M)")
    ap.add_argument("--target-nodes", type=int, default=120_000, help="sets the node size: pool / this (default 120k)")
    ap.add_argument("--pressure", type=float, default=2.0, help="tokens inserted, in pools (default 2)")
    ap.add_argument("--sessions", type=int, default=0, help="default: 1.5 pools of history (working set > pool)")
    ap.add_argument("--system-prompts", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--history-tokens", type=int, default=0, help="a session starts afresh past this; default 32 nodes")
    ap.add_argument("--branch", type=float, default=0.2, help="share of turns that regenerate from an earlier point")
    ap.add_argument("--seed", type=int, default=0)
