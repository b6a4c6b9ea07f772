#!/usr/bin/env bash
# Every policy (recompute, demote, prefetch, predict) on the same trace and capacities, side by side,
# for two model/hardware presets; tables with ratios against recompute and demote, and a plot each.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRACE=${TRACE:-$ROOT/traces/mooncake_conversation_trace.jsonl}
OUT=${OUT:-$ROOT/out}
"$ROOT/scripts/replay.sh" "$TRACE" --limit 2000 --compare --report "$OUT/compare-llama3-8b.json"
"${CORE_VENV:-$ROOT/.venv}/bin/sgl-hicache" stats "$OUT/compare-llama3-8b.json" --plot "$OUT/compare-llama3-8b.png" > /dev/null
# a larger model: more KV bytes per token, so every hit moves more bytes over the same links
"$ROOT/scripts/replay.sh" "$TRACE" --limit 2000 --compare --model qwen2.5-32b --hardware h200 \
    --device-tokens 250000 --host-tokens 1000000 --report "$OUT/compare-qwen32b.json"
"${CORE_VENV:-$ROOT/.venv}/bin/sgl-hicache" stats "$OUT/compare-qwen32b.json" --plot "$OUT/compare-qwen32b.png" > /dev/null
echo "plots: $OUT/compare-llama3-8b.png $OUT/compare-qwen32b.png"
