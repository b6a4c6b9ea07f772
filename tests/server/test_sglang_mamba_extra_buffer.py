"""The tiny Qwen3-Next on `--radix-cache-backend sgl_hicache` at SGLang's default scheduling flags:
overlap scheduling on and a page size of 16, where SGLang resolves `--mamba-radix-cache-strategy
auto` to `extra_buffer` (`arg_groups/overrides.py:477`). The request's forward copies its recurrent
state into ping-pong track slots at chunk-aligned points (every 64 tokens of a prefill, counted from
its cached prefix); the backend takes those slots as its state snapshots (a finished request's
latest tracked state; a running request's at each checkpoint, by donation) and tiers
them as under `no_buffer` (`sgl_hicache/sglang/kinds/mamba/state_sources.py`).

It runs on CPU with the CPU test layer's `mamba_extra_buffer` patches (SGLang refuses extra_buffer on
CPU, `arg_groups/mamba_hook.py:120`; its decode tracking is a Triton kernel, its prefill tracking reads
the chunked delta rule's per-chunk states, which the CPU op does not return; see
scripts/cpu/layer/sglang_cpu_layer/mamba_extra_buffer.py).

What it proves: the phases of `test_sglang_mamba.every_tier` (greedy outputs and logprobs equal to
scratch from device, host and disk and after a restart; a snapshot file rewritten with another valid
state moves them, one with a flipped byte is refused; no state byte moved on the scheduler thread)
at hit points SGLang's extra buffer keeps: P's at 64, S's at 128 and R's at 192 (their 76-, 140- and
204-token prompts, tracked within the prefill from the per-chunk states, `_force_track_h`; the tree
takes the track slot by donation at the checkpoint SGLang makes of every request still running after
its prefill, `batch_result_processor.py:394`). Flood prompts of 260 tokens leave snapshots at 256
only.
"""

from __future__ import annotations

import shutil

import pytest
from test_sglang_mamba import every_tier, mamba_servers

# SGLang's default flags (the page size the task names: on CPU SGLang's default is 1)
ARGS = ["--page-size", "16"]
# each running request holds 3 slots (its own and 2 ping-pong track slots, overlap scheduling on)
SLOTS = 8
HITS = {"P": 64, "R": 192, "S": 128}
# their snapshots at 256: above P's, R's and S's in the tiers' priority (FLOPs saved per byte), so
# that those leave the device and the host first
FLOOD_TOKENS = 260
# P's pages stay in host through the first flood (P, R and S are longer than under no_buffer) and
# leave it in the second: 1,689 tokens of KV
HOST_TOKENS = 2560


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_mamba_extra_buffer")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(workdir):
    servers = mamba_servers(workdir, 16, SLOTS, ARGS, host_tokens=HOST_TOKENS)
    yield servers.start
    servers.close()


def test_extra_buffer_outputs_equal_scratch_from_every_tier_and_after_a_restart(start_server, workdir):
    every_tier(start_server, workdir, HITS, SLOTS, FLOOD_TOKENS)


class _Pool:
    """SGLang's `HybridReqToTokenPool` under extra_buffer with overlap (2 ping-pong slots), as far
    as the state sources use it: its allocator (`alloc`, `free`), `set_mamba_ping_pong_slot`,
    `donate_mamba_ping_pong_slot` and `free_mamba_cache`, on SGLang's own code."""

    mamba_ping_pong_track_buffer_size = 2
    enable_mamba_extra_buffer = True

    def __init__(self, slots: int) -> None:
        import torch
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

        self.free_slots = list(range(1, slots + 1))
        self.mamba_allocator = self
        self.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros((4, 2), dtype=torch.int64)
        for name in (
            "get_mamba_ping_pong_other_idx",
            "get_mamba_ping_pong_keep_idx",
            "set_mamba_ping_pong_slot",
            "donate_mamba_ping_pong_slot",
            "free_mamba_cache",
        ):
            setattr(self, name, getattr(HybridReqToTokenPool, name).__get__(self))

    def alloc(self, k: int):
        import torch

        if len(self.free_slots) < k:
            return None
        got, self.free_slots = self.free_slots[:k], self.free_slots[k:]
        return torch.tensor(got, dtype=torch.int64)

    def free(self, idx) -> None:
        self.free_slots += [int(i) for i in idx.view(-1)]


class _Req:
    """A request holding its own slot and two ping-pong slots, the latest tracked at `last` tokens
    (position 1), the previous at `prev` (position 0)."""

    def __init__(self, pool: _Pool, last: int | None, prev: int | None, finished: bool) -> None:
        from types import SimpleNamespace

        self.kv = SimpleNamespace(req_pool_idx=1, mamba_cow_src_index=None, mamba_needs_clear=False)
        self.kv.mamba_pool_idx = pool.alloc(1)[0]
        self.kv.mamba_ping_pong_track_buffer = pool.alloc(2)
        self.kv.mamba_ping_pong_empty = [False, False]
        pool.req_index_to_mamba_ping_pong_track_buffer_mapping[1] = self.kv.mamba_ping_pong_track_buffer
        self.kv.mamba_last_track_idx, self.kv.mamba_next_track_idx = 1, 0
        self.kv.mamba_last_track_seqlen, self.kv.mamba_prev_track_seqlen = last, prev
        self._finished = finished

    def finished(self) -> bool:
        return self._finished


def test_extra_buffer_offers_the_tracked_slot_and_releases_the_rest():
    """A finished request offers its latest tracked state its committed tokens cover (else the
    previous one, else nothing); the slot the tree takes leaves the buffer and its release frees the
    other three, never the taken one. A running request's slot is taken by donation: a fresh slot
    replaces it and its track length is cleared (the fresh slot holds nothing tracked)."""
    from sgl_hicache.sglang.kinds.mamba.state_sources import ExtraBuffer, Offer

    pool = _Pool(8)
    src = ExtraBuffer(pool)
    req = _Req(pool, last=192, prev=128, finished=True)
    own, pp = int(req.kv.mamba_pool_idx), req.kv.mamba_ping_pong_track_buffer.tolist()
    assert src.offer(req, 200) == Offer(192, 1)
    assert src.offer(req, 150) == Offer(128, 0)  # the latest ran past the committed tokens
    assert src.offer(req, 100) is None
    slot = src.hand_over(req, Offer(192, 1), lambda: None)
    assert slot == pp[1] and req.kv.mamba_ping_pong_empty == [False, True]
    src.release(req)
    assert sorted(pool.free_slots) == sorted([4, 5, 6, 7, 8, own, pp[0]]) and slot not in pool.free_slots

    pool = _Pool(8)
    src = ExtraBuffer(pool)
    req = _Req(pool, last=256, prev=None, finished=False)
    pp = req.kv.mamba_ping_pong_track_buffer.tolist()
    assert src.offer(req, 256) == Offer(256, 1) and src.offer(req, 255) is None
    slot = src.hand_over(req, Offer(256, 1), lambda: pool.alloc(1))
    assert slot == pp[1] and int(req.kv.mamba_ping_pong_track_buffer[1]) not in pp
    assert req.kv.mamba_last_track_seqlen is None and src.offer(req, 300) is None
    assert src.hand_over(req, Offer(256, 1), lambda: None) is None  # no fresh slot: nothing taken
