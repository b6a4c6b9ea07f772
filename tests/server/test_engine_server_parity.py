"""Same controller, same results: one trace slice through the embedded engine and through the real SGLang
server (CPU, `--radix-cache-backend sgl_hicache`) gives per-tier hit tokens within 2 %.

One server launch (`benchmarks/server/parity.py`, the benchmark's own code path): the first 150
requests of the shipped Mooncake trace, blocks scaled 512 -> 4 tokens, page 4, one output token,
sequential (concurrency 1: the comparison where the two controllers must agree; see the benchmark's
docstring for why concurrent replays differ by thread timing), device pool at its floor (the longest
prompt), host 16x the pool, disk on. That slice hits the device and a lower tier, so a difference in
admission, eviction or hit attribution between the two engines shows.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import mooncake_trace

REPO = Path(__file__).resolve().parents[2]


def test_embedded_engine_and_server_agree_per_tier(tmp_path: Path) -> None:
    from benchmarks.server import parity as engine_server_parity

    out_path = tmp_path / "parity.json"
    rc = engine_server_parity.main(
        [
            # the benchmark's defaults (tiny model, scale 4, page 4, 1 output token, pool at its floor,
            # host 16x, disk on, sequential), spelled out so that a change of defaults does not change the test
            "--trace",
            str(mooncake_trace()),
            "--model",
            str(REPO / "scripts" / "cpu" / "tiny-llama"),
            "--requests",
            "150",
            "--scale",
            "4",
            "--page-size",
            "4",
            "--output-tokens",
            "1",
            "--pool",
            "0.02",
            "--host-ratio",
            "16",
            "--concurrency",
            "1",
            "--eviction-demotes",
            "all",
            "--start-timeout",
            "600",
            "--json",
            str(out_path),
        ]
    )
    out = json.loads(out_path.read_text())
    server, embedded = out["server"]["hit_tokens"], out["embedded"]["hit_tokens"]
    # the slice must exercise more than the device tier, or agreement proves little
    assert server["device"] > 0 and server["host"] + server["disk"] > 0, out
    assert out["max_relative_difference"] <= 0.02, out
    assert rc == 0
    assert sum(embedded.values()) > 0
