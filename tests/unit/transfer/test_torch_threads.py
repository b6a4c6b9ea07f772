"""The cache's worker threads run torch ops on one OpenMP thread; the caller's (the forward's) stays."""

from __future__ import annotations

import threading

import pytest
import torch

from sgl_hicache.transfer.torch_threads import single_threaded_torch


def _in_thread(fn):
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(value=fn()))
    t.start()
    t.join()
    return out["value"]


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch without OpenMP")
def test_a_worker_thread_caps_its_own_team_only():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def worker():
            capped = single_threaded_torch()
            x = torch.arange(200_000, dtype=torch.float32)
            y = x.index_select(0, torch.arange(0, 200_000, 3))  # a parallel op: the cap survives it
            return capped, torch.get_num_threads(), float(y[-1])

        capped, n, last = _in_thread(worker)
        assert capped and n == 1 and last == 199_998.0
        assert torch.get_num_threads() == 2  # the calling thread keeps its team
        assert _in_thread(torch.get_num_threads) == 2  # and a thread started later gets the process's setting
    finally:
        torch.set_num_threads(before)


def test_the_transfer_engine_workers_are_capped(tmp_path):
    from conftest import make_cache

    from sgl_hicache.transfer import engine

    seen = []
    original = engine.single_threaded_torch
    engine.single_threaded_torch = lambda: seen.append(threading.current_thread().name) or original()
    try:
        eng = engine.TransferEngine(make_cache(tmp_path), workers=2).start()
        eng.stop()
    finally:
        engine.single_threaded_torch = original
    assert sorted(seen) == ["sgl-hicache-transfer-0", "sgl-hicache-transfer-1"]
