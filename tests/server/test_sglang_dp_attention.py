"""End to end with data parallelism inside one server: the real SGLang 0.5.23 CPU server, the tiny
DeepSeek-V2 config (MLA, `scripts/cpu/tiny-deepseek`, the weights of tests/server/test_sglang_e2e_mla.py),
`--radix-cache-backend sgl_hicache`, in the two deployments SGLang has: DP attention (`--tp 2 --dp 2
--enable-dp-attention`) and data-parallel replicas (`--dp-size 2`, each replica TP 1).

Each DP rank (attention-DP rank or replica) runs its own scheduler and its own tree; its cache group
(the attention-TP group, or the replica's TP group) has one rank, so no agreement is built, and the
two DP ranks share one disk directory through the shared-directory protocol
(`sglang/parallel/data_parallel.py`). Requests are pinned to a DP rank with SGLang's `routed_dp_rank`.

On one server: a prompt served by DP rank 0 from host and disk hits gives the greedy outputs and
logprobs of its device hit (the reference under MLA with `torch_native`: tests/server/test_sglang_e2e_mla.py
explains why not the scratch run); the same prompt sent to DP rank 1 is a disk hit on the pages DP rank
0 wrote, with the same outputs; a token changed in the last cached page moves the logprobs; both DP
ranks served requests, each publishes its own stats and Prometheus series (`dp_rank` label), and
neither scheduler thread copied, wrote, slept or waited inside a cache call (the I/O guard). After a
restart on the same directory the prompt is a disk hit on either DP rank with the same outputs.

SGLang's CPU path needs two patches for DP attention (the idle DP rank's padded batch), applied by
`scripts/cpu/layer/sglang_cpu_layer/patches.py` on CPU only; replicas need none.
"""

from __future__ import annotations

import json
import shutil

import pytest
from servers import CHECKED, BackendServers
from test_sglang_e2e import LOGPROB_TOL, _logprob_diff, _prompt, _wait_for
from test_sglang_e2e_mla import HIT, PAGE, VOCAB, make_mla_model

DP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
TOP_K = 5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_dp_attention")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# the deployment: its server arguments, and whether its DP ranks are attention-DP ranks
DEPLOYMENTS = {
    "attention": (("--tp", "2", "--dp", "2", "--enable-dp-attention"), True),
    "replicas": (("--dp-size", "2"), False),
}


@pytest.fixture(params=sorted(DEPLOYMENTS))
def deployment(request) -> str:
    return request.param


@pytest.fixture
def start_server(workdir, deployment):
    args = (*DEPLOYMENTS[deployment][0], "--enable-metrics")
    servers = BackendServers(
        make_mla_model(workdir / "model"),
        workdir,
        page=PAGE,
        host_tokens=4096,
        env={**CHECKED, **DP_ENV},
        args=args,
        stats=True,
        timeout_s=600,
    )
    yield servers.start
    servers.close()


def _gen(srv, ids, dp_rank: int, start: int | None = None, n: int = 8) -> tuple[list[int], dict, dict]:
    """Greedy generation on DP rank `dp_rank` (with logprobs from prompt position `start` on, as
    test_sglang_e2e._gen_lp): (output ids, cached tokens by source, logprobs)."""
    body = {
        "input_ids": list(ids),
        "routed_dp_rank": dp_rank,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }
    if start is not None:
        body.update(return_logprob=True, logprob_start_len=start, top_logprobs_num=TOP_K)
    r = srv.post("/generate", body)
    meta = r["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    lps: dict = {}
    if start is not None:
        inp, inp_top = meta["input_token_logprobs"], meta["input_top_logprobs"]
        first = len(ids) - len(inp)

        def entry(lp, top):
            return (lp[1], lp[0], [(t[1], t[0]) for t in (top or [])])

        lps = {
            "input": {first + i: entry(lp, top) for i, (lp, top) in enumerate(zip(inp, inp_top)) if lp[0] is not None},
            "output": [entry(lp, top) for lp, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])],
        }
    return r["output_ids"], {k: details.get(k, 0) for k in ("device", "host", "storage")}, lps


def _flood(srv, dp_rank: int, seed: int, count: int, n: int = 300) -> None:
    for i in range(count):
        _gen(srv, _prompt(seed * 1000 + i, n), dp_rank, n=2)


def _by_dp_rank(srv) -> dict[int, dict]:
    """Each DP rank's `sgl_hicache` state from /server_info (one scheduler per DP rank)."""
    info = json.loads(srv.get("/server_info"))
    states = [s["sgl_hicache"] for s in info["internal_states"] if "sgl_hicache" in s]
    return {s["backend"]["dp"]["rank"]: s for s in states}


def _settled(srv) -> dict[int, dict]:
    def settled():
        states = _by_dp_rank(srv)
        return states if len(states) == 2 and all(s["pool"]["check"] == "ok" for s in states.values()) else None

    return _wait_for(settled, "both DP ranks' transfers to settle")


def test_dp_ranks_host_disk_and_peer_hits_and_a_restart_equal_the_device_hit(start_server, workdir, deployment):
    """On DP rank 0 the prompt's host and disk hits, on DP rank 1 its disk hit on rank 0's pages, and
    after a restart its disk hit on either DP rank, give the greedy outputs and logprobs of DP rank 0's
    device hit (not of its scratch run: tests/server/test_sglang_e2e_mla.py says why)."""
    attention_dp = DEPLOYMENTS[deployment][1]
    disk = workdir / f"disk-{deployment}"
    srv = start_server(f"dp-{deployment}", disk)
    P = _prompt(1, HIT + 4)  # 19 whole pages and 4 tokens (tests/server/test_sglang_e2e_mla.py explains)
    _, d0, _ = _gen(srv, P, 0, start=0)
    assert sum(d0.values()) == 0, d0
    out_dev, d1, lp_dev = _gen(srv, P, 0, start=HIT)  # the reference: DP rank 0's own device-pool reuse
    assert d1["device"] == HIT, d1
    # DP rank 1 has P nowhere but on the shared disk, written through by DP rank 0 in the background
    _wait_for(lambda: _by_dp_rank(srv)[0]["stored_tokens"]["disk"] >= HIT, "DP rank 0's disk copy of P")
    out_peer, dp1, lp_peer = _gen(srv, P, 1, start=HIT)
    assert dp1["storage"] == HIT, dp1
    _flood(srv, 0, 2, 4)  # P leaves DP rank 0's device, stays on its host
    out_host, d2, lp_host = _gen(srv, P, 0, start=HIT)
    assert d2["host"] > 0 and d2["host"] + d2["storage"] == HIT, d2
    _flood(srv, 0, 3, 20)  # P leaves DP rank 0's device and host, stays on disk
    out_disk, d3, lp_disk = _gen(srv, P, 0, start=HIT)
    # the whole hit from disk: the flood left none of it on DP rank 0's device or host
    assert d3["storage"] == HIT and d3["device"] == d3["host"] == 0, d3
    assert out_dev == out_host == out_disk == out_peer, (out_dev, out_host, out_disk, out_peer)
    diffs = {n: _logprob_diff(lp_dev, lp) for n, lp in (("host", lp_host), ("disk", lp_disk), ("dp1_disk", lp_peer))}
    print(f"\nDP ({deployment}) logprob |diff| vs DP rank 0's device hit: {diffs}")
    assert all(v <= LOGPROB_TOL for v in diffs.values()), diffs
    # not vacuous: one token changed in the last cached page moves the output logprobs
    P3 = list(P)
    P3[HIT - 3] = (P[HIT - 3] - 16 + 1) % (VOCAB - 16) + 16
    lp3 = _gen(srv, P3, 0, start=HIT)[2]
    late = max(abs(a[1] - b[1]) for a, b in zip(lp3["output"], lp_dev["output"]))
    print(f"output logprob |diff| with a token of the last cached page changed: {late:.4f}")
    assert late > 1000 * LOGPROB_TOL, late

    states = _settled(srv)
    for rank, st in states.items():
        dp = st["backend"]["dp"]
        assert dp == {
            "rank": rank,
            "size": 2,
            "attention_dp": attention_dp,
            "group_rank": 0,
            "group_size": 1,
            "tp_rank": rank if attention_dp else 0,  # each replica is TP 1
        }, dp
        assert "tp" not in st["backend"], st["backend"]  # one rank per attention-TP group: nothing to agree
        assert st["requests"] > 0 and st["config"]["disk_dir"] == str(disk), (rank, st["requests"], st["config"])
        assert st["pool"]["request_held_tokens"] == 0, st["pool"]
        io = st["scheduler_io"]
        offenders = io.pop("first_offender")
        assert io["copy"] == 0 and not io["copy_by_link"], (rank, io, offenders)
        assert io["disk_write"] == io["sleep"] == io["event_wait"] == 0, (rank, io, offenders)
    assert states[0]["hit_tokens"]["host"] > 0 and states[0]["hit_tokens"]["disk"] > 0, states[0]["hit_tokens"]
    assert states[1]["hit_tokens"]["disk"] >= HIT, states[1]["hit_tokens"]
    # each DP rank's figures apart: DP rank 1's stats file beside rank 0's (named by its TP rank, or
    # for a replica, which repeats TP rank 0, by its DP rank), Prometheus by dp_rank
    stats1 = workdir / (f"dp-{deployment}-stats.json" + (".rank1" if attention_dp else ".dp1"))
    assert _wait_for(stats1.exists, "DP rank 1's stats file")
    assert json.loads(stats1.read_text())["backend"]["dp"]["rank"] == 1
    metrics = srv.get("/metrics").splitlines()
    hits = [ln for ln in metrics if ln.startswith("sgl_hicache_hit_tokens")]
    assert any('dp_rank="0"' in ln for ln in hits) and any('dp_rank="1"' in ln for ln in hits), hits
    srv.stop()

    again = start_server(f"dp-{deployment}-restart", disk)
    for rank in (1, 0):
        out, d, lp = _gen(again, P, rank, start=HIT)
        assert d["storage"] == HIT, (rank, d)  # the shared directory's pages, found by both DP ranks
        assert out == out_dev, (rank, out, out_dev)
        assert _logprob_diff(lp_dev, lp) <= LOGPROB_TOL, rank
