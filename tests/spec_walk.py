"""The tier walk of a speculative-decoding server (EAGLE, DeepSeek MTP / NextN), not a test module.

Under speculative decoding the target's outputs never depend on the draft model's KV; the draft's KV
shows only in how many of its proposals the target accepts (SGLang's `spec_num_correct_drafts`). So
the walk asserts, beside `tier_walk`'s equal outputs and logprobs from every tier, that the acceptance
is the same from every tier's hit, and that it moves after a restart on page files whose draft rows
were negated (valid pages: checksums rewritten), with the target's outputs unchanged.
"""

from __future__ import annotations

from pathlib import Path

from page_files import page_shape, rewrite_payloads
from test_sglang_e2e import _settled_pool
from tier_walk import (
    TIERS,
    TierWalk,
    assert_a_changed_cached_page_moves,
    assert_restart_serves_from_disk,
    assert_settled_and_clean,
    assert_tiers_equal,
    walk_tiers,
)

# what SGLang's CPU path runs on `torch_native` with the CPU test layer's patches
# (`scripts/cpu/layer/sglang_cpu_layer/speculative_patches.py`): a chain of one draft token per step
SPEC_CHAIN_ARGS = (
    "--speculative-num-steps",
    "1",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "2",
)


def corrupt_draft_rows(directory: Path, target_layers: int) -> int:
    """Negate the draft model's rows (a page's layers from `target_layers` on: K and V, or MLA's latent
    row) in every page file under `directory`, as valid pages (`page_files.rewrite_payloads`): the
    target's rows are untouched, only the draft reads wrong KV. Returns the number of files changed.
    Only for a stopped server's directory."""
    from sgl_hicache.tiers.codec import PAGE_SUFFIX

    files = sorted(directory.rglob("*" + PAGE_SUFFIX))
    assert all(page_shape(f)[0] > target_layers for f in files), files
    return rewrite_payloads(files, lambda page: page[target_layers:].neg_())


def accepted(meta: dict) -> int:
    """How many of the draft model's proposals the target accepted in a response (its `meta_info`)."""
    return int(meta["spec_num_correct_drafts"])


def walk_speculative_tiers(
    start_server,
    disk: Path,
    prompt: list[int],
    hit: int,
    *,
    n: int,
    page: int,
    target_layers: int,
    reference: str = "scratch",
    where: str = "output",
    label: str = "",
) -> TierWalk:
    """One speculative server's walk: `start_server(name, disk)` starts a server (`first`, then
    `restart` on the same disk directory). Serves `prompt` from scratch and from device, host and disk
    hits of `hit` tokens (`tier_walk.walk_tiers`, each hit's tier asserted; `n` output tokens), then
    asserts:
      * greedy outputs and logprobs of every tier equal the `reference` run's;
      * the draft's acceptance is the same from every tier as in the reference run, and not zero;
      * a token changed in the last cached page moves the logprobs (`where`: output or input);
      * no request holds pages, the scheduler thread made no copy, wait, sleep or file write;
      * after a restart on page files whose draft rows were negated, the whole hit comes from disk with
        the reference's outputs and logprobs, and the acceptance moves.
    Returns the walk."""
    srv = start_server("first", disk)
    assert _settled_pool(srv)["config"]["pool_kind"] == "draft"
    # SGLang caps a request's prefix match at its `logprob_start_len` in raw tokens; the tree keys
    # speculative decoding by bigrams (N raw tokens make N - 1 positions), so a request that may reuse
    # `hit` cached positions asks for logprobs from `hit + 1` on
    walk = walk_tiers(srv, prompt, hit, start=hit + 1, n=n)
    assert_tiers_equal(walk, reference, label)
    # the draft model proposed from its own KV of the cached positions, which came back with the
    # target's from each tier: its proposals were accepted as often as in the reference run
    by_tier = {name: accepted(walk.metas[name]) for name in dict.fromkeys((reference, *TIERS))}
    print(f"\n{label} accepted drafts of {n} tokens by tier: {by_tier}")
    assert len(set(by_tier.values())) == 1 and by_tier[reference] > 0, by_tier
    assert_a_changed_cached_page_moves(srv, walk, reference, where=where)
    assert_settled_and_clean(srv)
    srv.stop()
    # not vacuous: the draft rows of every page on disk negated. After the restart the whole hit comes
    # from disk; the target's rows are intact, so its greedy outputs and logprobs are the reference's,
    # but the draft proposes from wrong KV and the acceptance moves
    changed = corrupt_draft_rows(disk, target_layers)
    assert changed >= hit // page, changed
    meta = assert_restart_serves_from_disk(start_server("restart", disk), walk, reference)
    corrupted = accepted(meta)
    print(f"{label} accepted drafts after a restart on {changed} pages with negated draft rows: {corrupted}")
    assert corrupted != by_tier[reference], (corrupted, by_tier)
    return walk
