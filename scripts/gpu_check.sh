#!/usr/bin/env bash
# The GPU check, to run whenever a GPU machine is lent: the device tier on CUDA with a
# pinned host tier (bit-exact round trips through the cache's handlers and LayerwiseLoader), host<->device
# GB/s against a plain pinned copy, and the share of a layer-wise load hidden behind per-layer compute.
#
#   scripts/gpu_check.sh [--cpu-smoke] [benchmarks/io/gpu_check.py options]
#
# Needs python with torch and xxhash only: no SGLang, no network, no pip install (sgl_hicache is
# imported from this checkout). JSON: $OUT/gpu_check.json when $OUT is set, else --json PATH, else
# ./gpu_check.json. Exit 0 ok, 1 a check failed, 2 no CUDA device; killed after GPU_CHECK_TIMEOUT_S
# (default 290 s; the script skips sizes it cannot start within --budget-s, default 200 s).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('xxhash')))" \
    || { echo "gpu_check: $PY has no torch or no xxhash" >&2; exit 1; }
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-290}" "$PY" -m benchmarks.io.gpu_check "$@"
