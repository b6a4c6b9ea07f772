"""One disk directory read across TP sizes on the real SGLang 0.5.23 CPU server (the tiny Llama of
test_sglang_e2e: 2 KV heads, one per rank at `--tp 2`).

Page keys are named by the whole model, with no TP size; a TP=1 server keeps its pages in the base
directory, a TP=2 rank its head's in `<base>/heads<lo>-<hi>` (`tiers/disk/head_shards.py`). What it
proves, with three servers on one directory, each a restart across a TP change:
- pages a TP=1 server wrote are served to a TP=2 server (each rank reads its head of them) as the
  whole hit from disk, and pages a TP=2 server wrote to a TP=1 server (assembled from both ranks'
  directories); the reader writes nothing for them;
- greedy outputs equal the reading server's own fresh computation of the prompt (a `cache_salt`
  request), and logprobs differ from it by no more than two fresh computations at the two TP sizes
  differ (the KV was computed at the other TP size, whose ranks sum in another order; 0 at equal TP);
- one rank's head of a page, negated in its file (a valid page, checksums rewritten), moves the
  logprobs far past that: the forward reads the assembled heads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import xxhash
from page_files import rewrite_payloads
from servers import BackendServers
from test_sglang_e2e import (
    DEVICE_TOKENS,
    HIT,
    HOST_TOKENS,
    LOGPROB_TOL,
    PAGE,
    TP_ENV,
    _gen_lp,
    _logprob_diff,
    _pool,
    _prompt,
    _settled_pool,
    _wait_for,
    make_model,
)

from sgl_hicache.hashing import chain_keys
from sgl_hicache.tiers.codec import PAGE_SUFFIX


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_cross_tp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(workdir):
    servers = BackendServers(
        make_model(workdir / "model"), workdir, page=PAGE, host_tokens=HOST_TOKENS, device_tokens=DEVICE_TOKENS
    )
    yield servers.start
    servers.close()


def _on_disk(srv, tokens: int) -> None:
    """Wait until the server's disk tier holds at least `tokens` tokens (write-through landed)."""
    _wait_for(lambda: _settled_pool(srv)["pool"]["disk_stored_tokens"] >= tokens, f"{tokens} tokens on disk")


def _pages(directory: Path) -> list[Path]:
    return sorted(directory.glob("??/*" + PAGE_SUFFIX))


def _served_across(srv, prompt: list[int], written_at: dict) -> dict:
    """`prompt`'s whole hit from disk pages another TP size wrote, against this server's own fresh
    computation: equal greedy ids, logprobs within what two fresh computations at the two TP sizes differ."""
    out_f, d_f, lp_f = _gen_lp(srv, prompt, HIT, salt="fresh")
    assert sum(d_f.values()) == 0, d_f
    out, d, lp = _gen_lp(srv, prompt, HIT)
    assert d["storage"] == HIT and d["device"] == d["host"] == 0, d  # the whole hit from disk
    assert out == out_f == written_at["out"], (out, out_f, written_at["out"])
    noise = _logprob_diff(written_at["lp"], lp_f)  # the two TP sizes' fresh computations
    diff = _logprob_diff(lp_f, lp)
    print(f"\nlogprob |diff| served across TP vs fresh: {diff:.2e}; fresh at the two TP sizes: {noise:.2e}")
    assert diff <= max(2 * noise, LOGPROB_TOL), (diff, noise)
    return {"diff": diff, "noise": noise, "lp": lp_f}


def test_pages_written_at_one_tp_size_are_served_at_another(start_server, workdir):
    disk = workdir / "disk"
    P, Q, R = _prompt(21, HIT + 16), _prompt(22, HIT + 16), _prompt(23, HIT + 16)

    # 1. TP=1 writes P's pages: the whole model's, in the base directory
    srv = start_server("tp1-writes", disk)
    out_p, _, lp_p = _gen_lp(srv, P, 0)
    _on_disk(srv, HIT)
    srv.stop()
    base_pages = len(_pages(disk))
    assert base_pages >= HIT // PAGE

    # 2. TP=2 reads them (each rank its head), then writes Q and R into its ranks' directories
    srv = start_server("tp2-reads", disk, tp=2, **TP_ENV)
    _served_across(srv, P, {"out": out_p, "lp": lp_p})
    written = {name: _gen_lp(srv, x, 0) for name, x in (("Q", Q), ("R", R))}
    _on_disk(srv, 3 * HIT)
    root = xxhash.xxh3_128_digest(_pool(srv)["config"]["namespace"].encode())  # one for every TP size
    srv.stop()
    assert len(_pages(disk)) == base_pages  # TP=2 wrote nothing into TP=1's directory

    def files(prompt: list[int], shard: str) -> list[Path]:
        keys = chain_keys(root, prompt[:HIT], PAGE)
        return [disk / shard / k.hex()[:2] / f"{k.hex()}{PAGE_SUFFIX}" for k in keys]

    assert not any(f.exists() for s in ("heads0-1", "heads1-2") for f in files(P, s))  # read, not copied
    # R's head 1 negated in rank 1's files (valid pages): what TP=1 assembles for R is wrong there
    r_files = files(R, "heads1-2")
    assert all(f.is_file() for f in r_files), "R's pages are not where rank 1 keeps its head's"
    assert rewrite_payloads(r_files, lambda page: page.neg_()) == HIT // PAGE

    # 3. TP=1 reads Q from both ranks' directories; R's changed head moves its logprobs
    srv = start_server("tp1-reads", disk)
    q = _served_across(srv, Q, {"out": written["Q"][0], "lp": written["Q"][2]})
    _, d, lp_r = _gen_lp(srv, R, HIT)
    assert d["storage"] == HIT, d
    _, _, lp_r_fresh = _gen_lp(srv, R, HIT, salt="fresh")
    moved = _logprob_diff(lp_r_fresh, lp_r)
    print(f"logprob |diff| with one head of R's pages negated: {moved:.3f}")
    assert moved > 10 * max(2 * q["noise"], LOGPROB_TOL), (moved, q)
    srv.stop()
