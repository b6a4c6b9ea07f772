#!/usr/bin/env bash
# The project's test command (what CI runs, what the README gives).
#
#   scripts/test.sh [pytest args]
#
# 1. the core suite in a venv with NO SGLang installed (.venv): proves the core needs only torch and
#    xxhash; tests marked `sglang` are deselected there;
# 2. the SGLang suite (tests marked `sglang`, set by tests/with_sglang/ and tests/server/: SGLang 0.5.23
#    on CPU, its real pool classes and the real server with sgl_hicache as
#    its radix cache) in .venv-sglang, installed by scripts/install_sglang_cpu.sh. It runs with
#    SGLHICACHE_REQUIRE_SGLANG=1: if sglang cannot be imported there the run is an error (exit 4), not
#    a pass made of skips (tests/conftest.py).
# SKIP_SGLANG=1 runs part 1 only. Both venvs are created when missing and reused when present.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
CORE=${CORE_VENV:-$ROOT/.venv}
SGL=${SGLANG_VENV:-$ROOT/.venv-sglang}
quiet_pip() { grep -v -E "WARNING: Location .* is ignored|^(Requirement already satisfied|  Using cached|Looking in|  Downloading|Collecting)" || true; }

# The store tier's tests start a real Mooncake Store (master + holder) and a real redis-server
# (tests/conftest.py fixtures): system packages first (CI runs as root on a fresh machine), then the
# clients into both venvs.
STORE_PIP=("mooncake-transfer-engine-non-cuda==0.3.13.post1" "redis" "hiredis")
if ! command -v redis-server >/dev/null || ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 redis-server) >/dev/null
    else
        echo "error: the store tests need libibverbs1 and redis-server (apt-get install -y libibverbs1 redis-server, as root)" >&2
        exit 1
    fi
fi

t0=$(date +%s)
[ -x "$CORE/bin/python" ] || "$PY" -m venv "$CORE"
"$CORE/bin/pip" install -q -e ".[dev]" 2>&1 | quiet_pip
"$CORE/bin/pip" install -q "${STORE_PIP[@]}" 2>&1 | quiet_pip
if "$CORE/bin/python" -c "import sglang" 2>/dev/null; then
    echo "error: $CORE has sglang installed; the core suite must run without it" >&2
    exit 1
fi
# The SGLang environment installs (mostly download and unpack) while the core suite runs; its output
# is shown after the core suite.
INSTALL_LOG=$(mktemp)
INSTALL_PID=
if [ "${SKIP_SGLANG:-0}" != 1 ]; then
    ( "$ROOT/scripts/install_sglang_cpu.sh" "$SGL" && "$SGL/bin/pip" install -q "${STORE_PIP[@]}" 2>&1 | quiet_pip
      # the install wrote ~2.7 GB: flush it now, so that its writeback does not compete with the
      # SGLang suite's disk-tier reads and writes
      sync ) > "$INSTALL_LOG" 2>&1 &
    INSTALL_PID=$!
    trap 'kill "$INSTALL_PID" 2>/dev/null || true' EXIT  # a failed core suite does not leave it running
fi
echo "== core suite (no sglang) =="
# Each suite has a wall limit too (pytest-timeout bounds a test, not a hang at interpreter exit), so
# a hang fails here with a message rather than running CI out of its time.
limited() { local s=$1; shift; timeout -k 30 "$s" "$@" || { rc=$?; [ $rc = 124 ] && echo "[test.sh] error: the suite ran past ${s} s" >&2; return $rc; }; }
SGLHICACHE_REQUIRE_SGLANG=0 limited 1800 "$CORE/bin/python" -m pytest -q -m "not sglang" "$@"
echo "[test.sh] core suite done after $(( $(date +%s) - t0 )) s"

if [ "${SKIP_SGLANG:-0}" = 1 ]; then
    echo "[test.sh] SKIP_SGLANG=1: the SGLang suite was not run"
    exit 0
fi
echo "== SGLang suite (real server on CPU) =="
install_rc=0
wait "$INSTALL_PID" || install_rc=$?
cat "$INSTALL_LOG"; rm -f "$INSTALL_LOG"
[ "$install_rc" = 0 ] || { echo "[test.sh] error: installing the SGLang environment failed (exit $install_rc)" >&2; exit "$install_rc"; }
# -p no:cacheprovider: no .pytest_cache writes racing the core run's
SGLHICACHE_REQUIRE_SGLANG=1 limited 4200 "$SGL/bin/python" -m pytest -q -m sglang -p no:cacheprovider -rs --durations=30 "$@"
echo "[test.sh] all done after $(( $(date +%s) - t0 )) s"
