"""DeepSeek MTP (NextN) speculative decoding with `--radix-cache-backend sgl_hicache`, on the real SGLang
0.5.23 CPU server.

The model: `scripts/cpu/tiny-deepseek-v3` (DeepSeek-V3-shaped: MLA, MoE layers with `noaux_tc` routing,
`num_nextn_predict_layers: 1`), weights from `make_mla_model`: the checkpoint holds the NextN layer at
index `num_hidden_layers`, as DeepSeek V3's does. `--speculative-algorithm NEXTN` is SGLang's alias of
EAGLE (`arg_groups/speculative_hook.py:109`); for a `DeepseekV3ForCausalLM` target SGLang takes the
draft from the target's own checkpoint (`speculative_hook.py:1138`) as `DeepseekV3ForCausalLMNextN`
(`configs/model_config.py:1036`, `models/deepseek_nextn.py`). The draft's KV is an `MLATokenToKVPool` of
one layer at the target's token slots; the backend tiers its latent rows with the target's as one more
layer of each page (`DraftPoolsAdapter`, pool kind `draft`).

Runs on CPU with the CPU test layer's EAGLE patches plus one for DeepSeek's draft
(`speculative_patches.patch_deepseek_mtp`: `models/deepseek_v2.py:3447` calls `torch.cuda.synchronize()`).

The reference is the device hit, not the scratch run: `torch_native` reads the MLA pool as MHA K / V,
so a prefill from scratch and an extend over a cached prefix differ, with SGLang's own radix cache as
with this backend (`test_sglang_e2e_mla.py`'s docstring). For the same reason the prompt (HIT + 3
tokens, N output tokens) never completes a page past its hit: measured with HIT + 17 tokens and 16
output tokens, the device hit's outputs parted from the host and disk hits' (equal to each other) from
the 7th token on. The walk (`tests/spec_walk.py`): greedy
outputs and logprobs from host and disk hits and after a restart equal the device hit's; the NextN
draft's acceptance is the same from each tier's hit and moves after a restart on page files whose draft
rows were negated; a token changed in the last cached page moves the output logprobs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from servers import BackendServers
from spec_walk import SPEC_CHAIN_ARGS, walk_speculative_tiers
from test_sglang_e2e import _prompt
from test_sglang_e2e_mla import make_mla_model

REPO = Path(__file__).resolve().parents[2]
TINY_V3 = REPO / "scripts" / "cpu" / "tiny-deepseek-v3"
PAGE, HIT, N = 16, 304, 12
TARGET_LAYERS = json.loads((TINY_V3 / "config.json").read_text())["num_hidden_layers"]  # then the NextN layer


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_mtp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(workdir):
    model = make_mla_model(workdir / "model", config=TINY_V3)
    args = ("--speculative-algorithm", "NEXTN", *SPEC_CHAIN_ARGS)
    servers = BackendServers(model, workdir, page=PAGE, host_tokens=4096, args=args)
    yield servers.start
    servers.close()


def test_mtp_server_tiers_and_a_restart_equal_the_device_hit(start_server, workdir):
    walk_speculative_tiers(
        start_server,
        workdir / "disk",
        _prompt(1, HIT + 3),
        HIT,
        n=N,
        page=PAGE,
        target_layers=TARGET_LAYERS,
        reference="device",
        label="MTP",
    )
