#!/usr/bin/env bash
# Replay the first 2,000 requests of the shipped Mooncake trace through the embedded engine with the
# default policy (predict), write the report, print the per-tier table and tree view, and plot it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRACE=${TRACE:-$ROOT/traces/mooncake_conversation_trace.jsonl}
OUT=${OUT:-$ROOT/out}
"$ROOT/scripts/replay.sh" "$TRACE" --limit 2000 --report "$OUT/replay.json"
"${CORE_VENV:-$ROOT/.venv}/bin/sgl-hicache" stats "$OUT/replay.json" --plot "$OUT/replay.png"
