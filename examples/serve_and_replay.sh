#!/usr/bin/env bash
# Launch SGLang with the sgl_hicache tiered prefix cache, replay a slice of the Mooncake trace against
# it over HTTP, print the server's per-tier stats, and stop the server (its whole process group).
#
#   examples/serve_and_replay.sh [MODEL_DIR] [PORT]
#
# Defaults: the repo's tiny Llama config with SGLang's dummy weights (no download), port 30123, a
# 1,024-token device pool (far smaller than the workload), host 4,096 tokens, disk under a temp dir.
# Needs the SGLang venv: scripts/install_sglang_cpu.sh (creates .venv-sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv-sglang/bin/python}
MODEL=${1:-scripts/cpu/tiny-llama}
PORT=${2:-30123}
TRACE=${TRACE:-/work/shared/traces/mooncake_conversation_trace.jsonl}
WORK=$(mktemp -d /tmp/sgl-hicache-example.XXXXXX)
LOAD_FORMAT=()
[[ "$MODEL" == scripts/cpu/tiny-llama ]] && LOAD_FORMAT=(--load-format dummy)

# 1. serve: tiering options before --, SGLang flags after it (CPU flags are added when there is no CUDA)
setsid "$PY" -m sgl_hicache.sglang.launch --host-tokens 4096 --disk-dir "$WORK/disk" --page-size 16 \
    --stats-file "$WORK/stats.json" -- \
    --model-path "$MODEL" "${LOAD_FORMAT[@]}" --skip-tokenizer-init --host 127.0.0.1 --port "$PORT" \
    --max-total-tokens 1024 --enable-metrics > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null || true; sleep 3; kill -KILL -- -$SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -30 "$WORK/server.log"; exit 1; }
    sleep 1
done
echo "server up (log $WORK/server.log)"

# 2. replay: the multi-turn sessions of the trace's first 400 lines, 512-token blocks scaled to 16 tokens
"$PY" - "$TRACE" "http://127.0.0.1:$PORT" "$WORK/report.json" <<'EOF'
import json, sys
from sgl_hicache.replay import load_trace
from sgl_hicache.replay.http import replay_http
trace, url, out = sys.argv[1:4]
reqs = load_trace(trace, scale=16, limit=400, vocab_size=1024)
n = {}
for r in reqs:
    n[r.session] = n.get(r.session, 0) + 1
reqs = [r for r in reqs if n[r.session] > 1 and len(r.input_ids) <= 700]
rep = replay_http(reqs, url, concurrency=4, max_new_tokens=8)
rep.pop("server_stats", None)
json.dump(rep, open(out, "w"), indent=1)
print(f"{rep['requests']} requests, failed {rep['requests_failed']}, hit tokens {rep['hit_tokens']}, "
      f"hit rate {rep['hit_rate']:.1%}, TTFT mean {rep['ttft_s']['mean']:.3f}s p90 {rep['ttft_s']['p90']:.3f}s, "
      f"throughput {rep['throughput_tok_s']:.0f} tok/s")
EOF

# 3. the live per-tier table and tree, from the running server
"$PY" -c "from sgl_hicache.sglang.stats_client import fetch_stats, render; print(render(fetch_stats('http://127.0.0.1:$PORT')))"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^(sglang:cached_tokens_total|sgl_hicache_stored_tokens)' || true
echo "report: $WORK/report.json"
