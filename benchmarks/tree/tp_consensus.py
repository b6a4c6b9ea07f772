"""The per-step cost of the TP ranks' agreement (`sgl_hicache/sglang/parallel/rank_consensus.py`).

    .venv/bin/python -m benchmarks.tree.tp_consensus --json tp_consensus.json          # ~30 s here
    .venv/bin/python -m benchmarks.tree.tp_consensus --quick --json tp_consensus.json  # seconds

Two ranks (two processes, torch.distributed on gloo over loopback: what SGLang's TP cache group is
on CPU) each build the same `TieredCache` holding `--nodes` tree nodes, then time `RankConsensus.step`
as a scheduler step calls it: with `--ops` background transfers in flight (all finished, so all get
agreed and re-armed each step) and `--waiting` waiting requests. Two variants, interleaved
(off, check, off, check, ... for `--repeats` rounds of `--steps` steps):
- `off`: the default, one MIN all-reduce of the fixed-size vector;
- `check`: `consensus_check` on, which also digests the whole tree every step.
Reported: µs per step (median over rounds, rank 0's wall clock), the ratio check / off, and the
all-reduce's share of `off`. The peer is the bare all-reduce of the same vector (`allreduce`), the
floor any agreement over this group pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from sgl_hicache.cache import TieredCache
    from sgl_hicache.config import CacheConfig, KVLayout
    from sgl_hicache.sglang.parallel.rank_consensus import RankConsensus, tree_digest
    from sgl_hicache.transfer.ops import TransferOp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    page = 4
    cache = TieredCache(
        CacheConfig(layout, device_tokens=(2 * args.nodes + 8) * page, host_tokens=0, disk_tokens=0, page_size=page)
    )
    for i in range(args.nodes):  # a root fan of one-page nodes under a shared first page
        cache.insert([0, 0, 0, 0, i + 1, 0, 0, 0], cache.allocate_device(2))
    nodes = [cache.match([0, 0, 0, 0, i + 1, 0, 0, 0]).last_node for i in range(args.ops)]
    ops = []
    for n in nodes:
        op = TransferOp(n, "device", "host", [], [], 0, "backup")
        op.gated = True
        op.executed.set()
        ops.append(op)
    waiting = [(object(), False) for _ in range(args.waiting)]
    variants = {
        "off": RankConsensus(dist.group.WORLD, rank, 2, check=False),
        "check": RankConsensus(dist.group.WORLD, rank, 2, check=True),
    }
    vec_len = 9 + 2 * variants["off"].max_ops + variants["off"].max_waiting
    times: dict[str, list[float]] = {"off": [], "check": [], "allreduce": []}
    digest = lambda: tree_digest(cache)  # noqa: E731
    for rnd in range(args.repeats):
        order = ["off", "check", "allreduce"] if rnd % 2 == 0 else ["allreduce", "check", "off"]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                if name == "allreduce":
                    v = torch.zeros(vec_len, dtype=torch.int64)
                    dist.all_reduce(v, op=dist.ReduceOp.MIN)
                    continue
                for op in ops:
                    op.agreed = False
                variants[name].step(ops, waiting, digest=digest)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e6)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "benchmark": "tp_consensus",
            "config": {
                "nodes": args.nodes,
                "ops": args.ops,
                "waiting": args.waiting,
                "steps": args.steps,
                "repeats": args.repeats,
                "quick": args.quick,
                "ranks": 2,
                "backend": "gloo",
                "vector_int64": vec_len,
                "tree_nodes": cache.tree.node_count,
            },
            "us_per_step_median": med,
            "us_per_step_rounds": times,
            "ratios": {"check / off": med["check"] / med["off"], "allreduce / off": med["allreduce"] / med["off"]},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        }
        Path(out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=5000, help="tree nodes on each rank")
    ap.add_argument("--ops", type=int, default=64, help="background transfers in flight per step")
    ap.add_argument("--waiting", type=int, default=16, help="requests waiting for a prefetch per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smallest size (smoke test)")
    ap.add_argument("--json", required=True, help="write the result here")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.ops, args.waiting, args.steps, args.repeats = 50, 4, 2, 10, 2
    for name in ("nodes", "ops", "waiting", "steps", "repeats"):
        if getattr(args, name) < (1 if name in ("steps", "repeats") else 0):
            ap.error(f"--{name} must be >= {1 if name in ('steps', 'repeats') else 0}")
    if args.ops > args.nodes:
        ap.error("--ops must be <= --nodes")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, args, os.path.join(tmp, "store"), args.json)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
    if bad:
        print(f"error: a rank failed (exit codes {bad})", file=sys.stderr)
        return 1
    print(Path(args.json).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
