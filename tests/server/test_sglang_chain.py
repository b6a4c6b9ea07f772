"""The real CPU server serves a chain replay's continuations from the predictor's promotions.

`benchmarks/server/chain.py` (its own code path, one repeat, small): the `chain` shape (7 sessions of 3
turns, 640-token histories, interleaved so that the 1,024-token device pool and 2,048-token host tier
spill the early ones to disk; after a pause each session's probe arrives 2 s before its continuation)
replayed on its trace clock against three fresh servers, one after the other: `prefetch` (predictor
off), `predict` (`tree_walk`), and `scratch` (SGLang with the radix cache off). With `predict`, the
probe's match triggers the walk, the history comes disk -> host during the lead, and the continuation
finds it on host: the predictor's promoted tokens are used (counted as used hits), the continuations'
host hits are at least those used tokens, and they are more than without the predictor, where the same
history counts as disk hits. Greedy outputs (realistic random weights: wrong KV would change them) are
identical with and without the predictor; against the from-scratch run they differ only where every
prefix cache does (bf16 near-ties), on the same requests with and without the predictor.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_predict_serves_the_continuation_from_promotions_made_during_the_lead(tmp_path: Path) -> None:
    from benchmarks.server import chain as chain_server

    out_path = tmp_path / "chain.json"
    rc = chain_server.main(
        [
            # spelled out, so that a change of the benchmark's defaults does not change the test
            "--configs",
            "prefetch,predict,scratch",
            "--repeats",
            "1",
            "--sessions",
            "7",
            "--turns",
            "3",
            "--turn-tokens",
            "192",
            "--system-tokens",
            "64",
            "--output-tokens",
            "8",
            "--turn-gap",
            "1",
            "--session-gap",
            "2.5",
            "--pause",
            "10",
            "--lead",
            "2",
            "--device-tokens",
            "1024",
            "--host-tokens",
            "2048",
            "--page-size",
            "16",
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(out_path),
        ]
    )
    # 7 sessions, not 5: the trigger's first two bets are shadow bets (no copies) until their continuations
    # are admitted, and sessions start 2.0-3.0 s apart against a 2 s lead, so on a slow machine a third or
    # fourth probe arrives before a bet is judged; with 5, one session (sometimes none) was left to copy for
    out = json.loads(out_path.read_text())
    s = out["summary"]
    runs = {r["config"]: r for r in out["runs"]}
    assert all("error" not in r and r["failed"] == 0 for r in runs.values()), runs
    pred, base = s["predict"], s["prefetch"]
    promoted, used = pred["predict"]["promoted_tokens"], pred["predict"]["used_tokens"]
    # the server's own account of the predictor's decisions (guard refusals, shadow record): a trigger went live
    spec = pred["speculation"]
    assert spec is not None and any(t["live"] for t in spec["shadow"].values()), pred
    assert promoted > 0 and used >= 0.8 * promoted, pred  # promoted disk -> host, and used by the continuations
    # the continuations' host hits are those promotions (used counts whole nodes, a hit stops a page short of a prompt's end)
    assert 0.9 * used <= pred["cont_hits"]["host"] <= used, pred
    assert pred["cont_hits"]["host"] > base["cont_hits"]["host"] + used // 2, (pred, base)
    assert pred["cont_hits"]["disk"] < base["cont_hits"]["disk"], (pred, base)  # without: the history comes from disk
    assert base["predict"]["promoted_tokens"] == 0
    # greedy outputs: identical with and without the predictor; against the from-scratch run, only
    # the bf16 near-ties every prefix cache has (SGLang's own too: the benchmark's docstring), the
    # same requests with and without the predictor, and few
    assert pred["outputs_equal_prefetch"] is True, s
    assert pred["differ_from_scratch"] == base["differ_from_scratch"], s
    assert len(pred["differ_from_scratch"]) <= runs["predict"]["requests"] // 10, s
    assert rc == 0
