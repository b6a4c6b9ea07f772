"""The tiny Qwen3-Next on `--radix-cache-backend sgl_hicache` at SGLang's default scheduling flags:
overlap scheduling on and a page size of 16, where SGLang resolves `--mamba-radix-cache-strategy
auto` to `extra_buffer` (`arg_groups/overrides.py:477`). The request's forward copies its recurrent
state into ping-pong track slots at chunk-aligned points (every 64 tokens of a prefill, counted from
its cached prefix); the backend takes those slots as its state snapshots (a finished request's
latest tracked state; a running chunked prefill's at each chunk's checkpoint, by donation) and tiers
them as under `no_buffer` (`sgl_hicache/sglang/kinds/mamba/state_sources.py`).

It runs on CPU with the CPU test layer's `mamba_extra_buffer` patches (SGLang refuses extra_buffer on
CPU, `arg_groups/mamba_hook.py:120`; its decode tracking is a Triton kernel, its prefill tracking reads
the chunked delta rule's per-chunk states, which the CPU op does not return; see
scripts/cpu/layer/sglang_cpu_layer/mamba_extra_buffer.py).

What it proves: the phases of `test_sglang_mamba.every_tier` (greedy outputs and logprobs equal to
scratch from device, host and disk and after a restart; a snapshot file rewritten with another valid
state moves them, one with a flipped byte is refused; no state byte moved on the scheduler thread)
at hit points SGLang's extra buffer keeps: P's at 64, S's at 128 and R's at 192 (their 76-, 140- and
204-token prompts, tracked within the prefill from the per-chunk states, `_force_track_h`; taken from
the ping-pong slot at the finished request's end). Flood prompts of 260 tokens leave snapshots at
256 only.
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
