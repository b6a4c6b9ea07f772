#!/usr/bin/env bash
# Launch SGLang with the sgl_hicache tiered prefix cache, replay the Mooncake trace against it over HTTP,
# print the server's per-tier stats and tree, and stop the server (its whole process group).
#
#   examples/serve_and_replay.sh [TRACE] [MODEL_DIR] [PORT]
#
# TRACE: a trace file (default: the shipped trace, traces/mooncake_conversation_trace.jsonl
# next to the repository; a relative path is taken from where you run the script). MODEL_DIR: default
# the repo's tiny Llama config with SGLang's dummy weights (no download). PORT: default 30123.
# A 1,024-token device pool (far smaller than the workload), host 4,096 tokens, disk under a temp dir.
# The replayer asks the server its vocabulary (1,024 for the tiny model), so no --vocab-size is needed.
# Needs the SGLang venv: scripts/install_sglang_cpu.sh (creates .venv-sglang).
set -euo pipefail
HERE=$(pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TRACE=${1:-${TRACE:-$ROOT/traces/mooncake_conversation_trace.jsonl}}
case "$TRACE" in /*) ;; *) TRACE="$HERE/$TRACE" ;; esac
MODEL=${2:-scripts/cpu/tiny-llama}
[[ "$MODEL" != /* && -d "$HERE/$MODEL" && "$MODEL" != scripts/cpu/tiny-llama ]] && MODEL="$HERE/$MODEL"  # a folder, from where you are
cd "$ROOT"
PORT=${3:-30123}
PY=${PY:-.venv-sglang/bin/python}
CLI=("$PY" -m sgl_hicache.cli)
[ -f "$TRACE" ] || { echo "no trace file $TRACE" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sgl-hicache-example.XXXXXX")
LOAD_FORMAT=()
[[ "$MODEL" == scripts/cpu/tiny-llama ]] && LOAD_FORMAT=(--load-format dummy)

# 1. serve: tiering options before --, SGLang flags after it (CPU flags are added when there is no CUDA)
setsid "${CLI[@]}" serve --host-tokens 4096 --disk-dir "$WORK/disk" --page-size 16 --stats-file "$WORK/stats.json" -- \
    --model-path "$MODEL" "${LOAD_FORMAT[@]}" --skip-tokenizer-init --host 127.0.0.1 --port "$PORT" \
    --max-total-tokens 1024 --enable-metrics > "$WORK/server.log" 2>&1 &
SERVER=$!
stop() {  # the whole process group, then the /dev/shm files it held (SGLang leaves some behind)
    local shm
    shm=$("$PY" -c "from sgl_hicache.client.server import group_shm_files as g; print(*g($SERVER))" 2>/dev/null || true)
    kill -TERM -- -$SERVER 2>/dev/null || true; sleep 10; kill -KILL -- -$SERVER 2>/dev/null || true
    [ -z "$shm" ] || rm -f $shm
}
trap stop EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -30 "$WORK/server.log"; exit 1; }
    sleep 1
done
echo "server up (log $WORK/server.log)"

# 2. replay: the trace's first 300 requests, 512-token blocks scaled to 16 tokens, 8 output tokens each
#    (prompts the 1,024-token pool cannot take are skipped and counted; a failed request exits non-zero)
"${CLI[@]}" replay "$TRACE" --url "http://127.0.0.1:$PORT" --limit 300 --scale 16 --max-new-tokens 8 \
    --concurrency 4 --report "$WORK/report.json"

# 3. the live per-tier table and tree, and the Prometheus text, from the running server
"${CLI[@]}" stats "http://127.0.0.1:$PORT"
"${CLI[@]}" stats "http://127.0.0.1:$PORT" --prometheus | grep -E '^(sglang:cached_tokens_total|sgl_hicache_stored_tokens)' || true
echo "report: $WORK/report.json"
