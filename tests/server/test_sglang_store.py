"""Two real SGLang 0.5.23 servers (CPU, the repo's tiny Llama with real-scale random weights) share
one real Mooncake Store through the store tier (`SGLHICACHE_STORE`, what `sgl-hicache serve --store`
sets). Turn N of a conversation runs on server A; turn N+1 on server B, which never saw turn N:

- B reports the shared part as SGLang's `storage` tier in `cached_tokens_details` and in
  `sglang:cached_tokens_total{cache_source="storage"}`, and our `/metrics` name the tier (`store`);
- B's greedy output equals the output of the same prompt computed from scratch (a `cache_salt`
  request, which the backend serves without the cache), and one token changed in turn N changes it
  (the outputs depend on the cached KV, so equal outputs mean equal KV).

- an idle server writes nothing: once its write-back has drained, a few seconds without requests
  leave the Mooncake master's put counter and both servers' store counters where they were.

Lean: one launch per server, several conversations per launch, the idle check on the same servers.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
from test_sglang_e2e import VOCAB, _prompt, _wait_for, make_model

PAGE = 16
CONVERSATIONS = 3


@pytest.fixture(scope="module")
def servers(tmp_path_factory, mooncake_service):
    from sgl_hicache.client.server import SGLangServer

    work = tmp_path_factory.mktemp("sglang_store")
    model = make_model(work / "model")
    env = {
        "SGLHICACHE_STORE": mooncake_service.url,
        "SGLHICACHE_HOST_TOKENS": "4096",
        # everything computed goes down to host and on to the store in the background, paced
        "SGLHICACHE_DEVICE_WRITEBACK_CLEAN_FRACTION": "1.0",
        "SGLHICACHE_WRITEBACK_CLEAN_FRACTION": "1.0",
        "SGLHICACHE_CHECK_INVARIANTS": "1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    started = []
    try:
        for name in ("a", "b"):
            started.append(
                SGLangServer.start(
                    model,
                    load_format=None,
                    log_path=work / f"{name}.log",
                    env=env,
                    timeout_s=300,
                    extra_args=[
                        "--max-total-tokens",
                        "2048",
                        "--page-size",
                        str(PAGE),
                        "--radix-cache-backend",
                        "sgl_hicache",
                        "--enable-metrics",
                        "--log-level",
                        "warning",
                    ],
                )
            )
        yield started
    finally:
        for srv in started:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)


def _gen(srv, ids, salt: str | None = None, n: int = 8) -> tuple[list[int], dict]:
    body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if salt:
        body["cache_salt"] = salt
    r = srv.post("/generate", body)
    details = r["meta_info"].get("cached_tokens_details") or {}
    return r["output_ids"], {k: details.get(k, 0) for k in ("device", "host", "storage")}


def _store_stats(srv) -> dict:
    return json.loads(srv.get("/server_info"))["internal_states"][0]["sgl_hicache"]["store"]


def test_turn_n_on_a_turn_n_plus_1_on_b(servers):
    from sgl_hicache.client.stats_client import fetch_metrics

    a, b = servers
    storage_total = 0
    for c in range(CONVERSATIONS):
        turn1 = _prompt(500 + c, 320)
        # counted before the turn runs: write-back may copy the turn's pages while it is still
        # running (a node in use qualifies), so a count read after it could already include some
        before = _store_stats(a)["pages_written"]
        out1, d1 = _gen(a, turn1)
        assert sum(d1.values()) == 0, d1
        # the turn's pages reach the store in the background, a batch per scheduler call into the
        # cache: other traffic drives it, as it does on a serving fleet. Here one two-page prompt,
        # repeated (SGLang matches a prompt without its last token, so a one-page prompt never reaches
        # the cache): it adds its two pages once, so turn 1 is all written once the count passes both.
        poke = _prompt(20_000 + c, 2 * PAGE)

        def written(before: int = before, poke: list[int] = poke) -> bool:
            if _store_stats(a)["pages_written"] >= before + (320 + 8) // PAGE + 2:
                return True
            _gen(a, poke, n=1)
            return False

        try:
            _wait_for(written, f"A's write-back to the store (conversation {c})", timeout_s=90)
        except BaseException:
            print(
                "A:", json.loads(a.get("/server_info"))["internal_states"][0]["sgl_hicache"].get("tree_text", "")[:3000]
            )
            print("A store:", _store_stats(a))
            raise
        turn2 = turn1 + out1 + _prompt(900 + c, 40)
        ref, d_ref = _gen(b, turn2, salt=f"scratch-{c}")  # computed from scratch, never stored
        assert sum(d_ref.values()) == 0, d_ref
        out2, d2 = _gen(b, turn2)
        assert d2["device"] == 0 and d2["host"] == 0 and d2["storage"] >= 320, d2  # B never saw turn 1
        assert out2 == ref, (c, out2, ref)
        storage_total += d2["storage"]
        if c == 0:  # the output depends on the shared KV: a token of turn 1 changed changes it
            changed = []
            for k in (2, 40, 150, 300):
                t = list(turn2)
                t[k] = (t[k] - 16 + 1) % (VOCAB - 16) + 16
                changed.append(_gen(b, t, salt=f"changed-{k}")[0])
            assert any(o != ref for o in changed), changed
    st = _store_stats(b)
    assert st["pages_read"] >= CONVERSATIONS * 320 // PAGE and st["corrupt_values"] == 0 and st["errors"] == 0, st
    lines = fetch_metrics(b.url)
    storage = [ln for ln in lines if ln.startswith("sglang:cached_tokens_total") and 'cache_source="storage"' in ln]
    assert storage and float(storage[0].rsplit(" ", 1)[1]) >= storage_total, storage
    # our own counters name the tier (published by the scheduler every stats interval)
    _wait_for(
        lambda: any(ln.startswith('sgl_hicache_hit_tokens_total{tier="store"}') for ln in fetch_metrics(b.url)),
        "/metrics to name the store tier",
        timeout_s=30,
    )
    assert any(ln.startswith('sgl_hicache_store_total{event="pages_read"}') for ln in fetch_metrics(b.url))


def test_idle_servers_write_nothing(servers, mooncake_service):
    """After the replay (the test above), with no requests, neither server puts anything into the store.
    First each server's write-back drains (a repeated two-page prompt drives it, as in the test above,
    until its `pages_written` stops moving: the known gap is that write-back advances only when a
    request reaches the cache), then 4 s of idle."""
    for k, srv in enumerate(servers):
        poke = _prompt(30_000 + k, 2 * PAGE)
        last = [-1, time.monotonic()]

        def drained(srv=srv, poke=poke, last=last) -> bool:
            n = _store_stats(srv)["pages_written"]
            if n != last[0]:
                last[0], last[1] = n, time.monotonic()
            elif time.monotonic() - last[1] >= 1.5:
                return True
            _gen(srv, poke, n=1)
            time.sleep(0.2)
            return False

        _wait_for(drained, f"server {k}'s write-back to drain", timeout_s=90)
    time.sleep(0.5)  # a put already on a transfer thread lands
    puts = ("master_batch_put_start_items_total", "master_put_start_requests_total")
    before = [mooncake_service.master_metrics().get(k, 0.0) for k in puts], [_store_stats(s) for s in servers]
    time.sleep(4.0)
    after = [mooncake_service.master_metrics().get(k, 0.0) for k in puts], [_store_stats(s) for s in servers]
    assert after[0] == before[0], (before[0], after[0])  # the store's own view: no put at all
    for b, a in zip(before[1], after[1]):
        for c in (
            "pages_written",
            "bytes_written",
            "puts_failed",
            "puts_skipped",
            "exists_calls",
            "pages_read",
            "errors",
        ):
            assert a[c] == b[c], (c, b, a)
