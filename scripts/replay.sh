#!/usr/bin/env bash
# The main job on a fresh machine: create .venv if needed, install sgl_hicache, run `sgl-hicache replay`.
#   scripts/replay.sh TRACE [replay flags]      e.g. scripts/replay.sh traces/mooncake_conversation_trace.jsonl --limit 2000 --compare
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${CORE_VENV:-$ROOT/.venv}
if [ ! -x "$VENV/bin/sgl-hicache" ]; then
    [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/pip" install -q -e "$ROOT[dev]" 2>&1 | grep -v -E "WARNING: Location .* is ignored" || true
fi
exec "$VENV/bin/sgl-hicache" replay "$@"
