#!/usr/bin/env bash
# Interleaved A/B of two checkouts on tree_ops.py and overhead.py: each round runs A then B (B then A
# on odd rounds), each process measuring its tree against SGLang's RadixCache in the same process, so
# the ratio cancels the machine's load at that moment. Raw JSON per process under OUT.
#   benchmarks/ab_runs.sh A_DIR B_DIR OUT_DIR ROUNDS TRACE
set -euo pipefail
A=$1; B=$2; OUT=$3; ROUNDS=${4:-3}; TRACE=${5:-/work/traces/mooncake_conversation_trace.jsonl}
PY=${PY:-/work/main/.venv-sglang/bin/python}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="a b"; else order="b a"; fi
  for side in $order; do
    dir=$A; [ "$side" = b ] && dir=$B
    for bench in tree_ops overhead; do
      (cd "$dir" && PYTHONPATH=$dir "$PY" "$dir/benchmarks/$bench.py" --trace "$TRACE" --repeats 1 \
        --json "$OUT/${bench}_${side}_r$r.json" >/dev/null 2>&1)
    done
  done
done
