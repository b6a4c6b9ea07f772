"""PD disaggregation end to end: a prefill server with `--radix-cache-backend sgl_hicache` and a decode
server on SGLang's default cache, paired by the client as SGLang's load balancer pairs them (the same
request to both, with the prefill server's `bootstrap_host` / `bootstrap_port` and one
`bootstrap_room`), KV moved by Mooncake over TCP on 127.0.0.1 (`--disaggregation-transfer-backend
mooncake_tcp`, `MC_TCP_BIND_ADDRESS=127.0.0.1`; SGLang refuses the `fake` backend for a prefill server).

The prefill server computes each prompt's KV (SGLang caps its requests at one new token), hands it
to the decode server, and keeps the prompt's pages in its tree cache: the next request with that
prefix is a device, host or disk hit on the prefill side. The tiny Llama (MHA) with random weights of
realistic scale: its extend over a cached prefix reproduces the scratch prefill bit for bit
(tests/server/test_sglang_e2e.py), so the reference is the scratch run. Greedy outputs decoded on the decode
server, and the prompt-tail logprobs computed on the prefill server, equal the scratch run's from
prefill-side device, host and disk hits and after a restart of the prefill server; a token changed
in the last cached page moves them; the prefill server's scheduler thread made no copy, write, sleep
or wait inside a cache call.

SGLang's prefill server needs two CPU patches at its KV sends (pinned memory and CUDA events),
applied by `scripts/cpu/layer/sglang_cpu_layer/patches.py` on CPU only.
"""

from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

import pytest
from test_sglang_e2e import (
    HIT,
    LOGPROB_TOL,
    PAGE,
    VOCAB,
    _logprob_diff,
    _lp_body,
    _prompt,
    _wait_for,
    make_model,
)

PD_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # else the transfer engine listens on the external address


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_pd")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers(workdir):
    """start(role, name, ...) starts a prefill (our backend) or decode (SGLang's cache) server."""
    from sgl_hicache.client.server import SGLangServer, free_port

    model = make_model(workdir / "model")
    started = []

    def start(role: str, name: str, bootstrap_port: int, disk_dir: Path | None = None) -> SGLangServer:
        env = dict(PD_ENV)
        extra = [
            "--max-total-tokens",
            "1024",
            "--page-size",
            str(PAGE),
            "--log-level",
            "warning",
            "--disaggregation-mode",
            role,
            "--disaggregation-transfer-backend",
            "mooncake_tcp",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
        ]
        if role == "prefill":
            env.update(
                {
                    "SGLHICACHE_HOST_TOKENS": "4096",
                    "SGLHICACHE_DISK_DIR": str(disk_dir),
                    "SGLHICACHE_DISK_TOKENS": str(64 * 1024),
                    "SGLHICACHE_CHECK_INVARIANTS": "1",
                    "SGLHICACHE_CHECK_SCHEDULER_IO": "1",
                    "SGLHICACHE_REWARM": "0",  # the restart below is a disk hit (tests/servers.py, NO_REWARM)
                }
            )
            extra += ["--radix-cache-backend", "sgl_hicache"]
        srv = SGLangServer.start(
            model, load_format=None, log_path=workdir / f"{name}.log", env=env, timeout_s=600, extra_args=extra
        )
        started.append(srv)
        return srv

    start.free_port = free_port
    yield start
    for srv in started:
        srv.stop()
        assert not srv.alive()


def _pd_generate(prefill, decode, bootstrap_port: int, ids, start: int, n: int = 8) -> tuple[list[int], dict, dict]:
    """One request through the pair: the same body to both servers, as SGLang's load balancer sends it.
    Returns (the decode server's output ids, the prefill server's cached tokens by source, logprobs:
    the prompt tail's from the prefill server, the outputs' from the decode server)."""
    body = _lp_body(
        ids,
        start,
        n,
        bootstrap_host="127.0.0.1",
        bootstrap_port=bootstrap_port,
        bootstrap_room=random.randrange(1 << 62),
    )
    replies: dict = {}

    def send(name, srv):
        try:
            replies[name] = srv.post("/generate", body, timeout_s=300)
        except BaseException as exc:  # surfaced below
            replies[name] = exc

    threads = [threading.Thread(target=send, args=(k, s)) for k, s in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, v in replies.items():
        if isinstance(v, BaseException):
            srv = prefill if k == "prefill" else decode
            raise AssertionError(f"the {k} server failed the request: {v!r}\n{srv.log_tail(60)}")
    p_meta, d_meta = replies["prefill"]["meta_info"], replies["decode"]["meta_info"]
    details = p_meta.get("cached_tokens_details") or {}
    inp, inp_top = p_meta["input_token_logprobs"], p_meta["input_top_logprobs"]
    first = len(ids) - len(inp)

    def entry(lp, top):
        return (lp[1], lp[0], [(t[1], t[0]) for t in (top or [])])

    lps = {
        "input": {first + i: entry(lp, top) for i, (lp, top) in enumerate(zip(inp, inp_top)) if lp[0] is not None},
        "output": [entry(lp, top) for lp, top in zip(d_meta["output_token_logprobs"], d_meta["output_top_logprobs"])],
    }
    return replies["decode"]["output_ids"], {k: details.get(k, 0) for k in ("device", "host", "storage")}, lps


def _prefill_state(srv) -> dict:
    import json

    info = json.loads(srv.get("/server_info"))
    return info["internal_states"][0]["sgl_hicache"]


def test_prefill_server_with_the_backend_serves_from_every_tier_and_after_a_restart(servers, workdir):
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (mooncake-transfer-engine-non-cuda)")
    disk = workdir / "disk"
    boot = servers.free_port()
    decode = servers("decode", "decode", boot)
    prefill = servers("prefill", "prefill", boot, disk)

    def gen(ids, start, srv=None):
        return _pd_generate(srv or prefill, decode, boot, ids, start)

    P = _prompt(1, 320)
    out_s, d0, lp_s = gen(P, 0)
    assert sum(d0.values()) == 0 and len(out_s) == 8, (d0, out_s)
    out_dev, d1, lp_dev = gen(P, HIT)
    assert d1["device"] == HIT, d1

    def flood(seed, count):
        for i in range(count):
            gen(_prompt(seed * 1000 + i, 300), 300)

    flood(2, 4)  # P leaves the prefill server's device pool, stays on its host tier
    out_host, d2, lp_host = gen(P, HIT)
    assert d2["host"] > 0 and d2["host"] + d2["storage"] == HIT, d2
    flood(3, 20)  # and its host tier: disk only
    out_disk, d3, lp_disk = gen(P, HIT)
    assert d3["storage"] > 0 and d3["device"] + d3["host"] + d3["storage"] == HIT, d3
    assert out_s == out_dev == out_host == out_disk, (out_s, out_dev, out_host, out_disk)
    diffs = {n: _logprob_diff(lp_s, lp) for n, lp in (("device", lp_dev), ("host", lp_host), ("disk", lp_disk))}
    print(f"\nPD logprob |diff| vs scratch: {diffs}")
    assert all(v <= LOGPROB_TOL for v in diffs.values()), diffs
    P3 = list(P)
    P3[HIT - 3] = (P[HIT - 3] - 16 + 1) % (VOCAB - 16) + 16
    lp3 = gen(P3, HIT)[2]
    late = max(abs(lp3["input"][q][1] - lp_s["input"][q][1]) for q in range(HIT + 1, len(P)))
    print(f"PD tail logprob |diff| with a token of the last cached page changed: {late:.4f}")
    assert late > 1000 * LOGPROB_TOL, late

    def settled():
        st = _prefill_state(prefill)
        return st if st["pool"]["check"] == "ok" else None

    st = _wait_for(settled, "the prefill server's transfers to settle")
    assert st["pool"]["request_held_tokens"] == 0, st["pool"]
    io = st["scheduler_io"]
    offenders = io.pop("first_offender")
    assert io["copy"] == 0 and not io["copy_by_link"], (io, offenders)
    assert io["disk_write"] == io["sleep"] == io["event_wait"] == 0, (io, offenders)
    assert st["hit_tokens"]["host"] > 0 and st["hit_tokens"]["disk"] > 0, st["hit_tokens"]
    prefill.stop()
    # SGLang's decode server forgets a prefill server's transfer endpoints only after two missed
    # heartbeats to its bootstrap port (disaggregation/common/conn.py, heartbeat_checker); a restarted
    # prefill server answers there seconds after it starts, so the decode server may keep sending to
    # the old endpoints. Restarting the pair keeps this test about the prefill server's disk tier.
    decode.stop()
    boot = servers.free_port()
    decode = servers("decode", "decode-restart", boot)
    again = servers("prefill", "prefill-restart", boot, disk)
    out, d, lp = gen(P, HIT, again)
    assert d["storage"] > 0 and d["device"] == 0, d
    assert out == out_s, (out, out_s)
    assert _logprob_diff(lp_s, lp) <= LOGPROB_TOL
