#!/usr/bin/env bash
# Start a local shared store for the store tier on one machine; prints the --store URL; Ctrl-C stops it.
#
#   scripts/store_local.sh mooncake [--size-mb 1024] [--snapshot]   # Mooncake master + one holder
#   scripts/store_local.sh redis [--size-mb 1024]                   # redis-server, no persistence, LRU
#
# Needs: apt-get install -y libibverbs1 redis-server; pip install -e '.[store]'.
# Then: sgl-hicache serve --store '<the URL it printed>' -- --model-path ... (docs/store.md)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m sgl_hicache.tiers.store_local "$@"
