#!/usr/bin/env bash
# Install the real SGLang 0.5.23 server into a venv on a CPU-only machine, with the CPU workarounds
# this repo keeps under scripts/cpu/, then install sgl_hicache itself (editable) so that its
# `sglang.srt.plugins` entry point is registered.
#
#   usage: scripts/install_sglang_cpu.sh [VENV_DIR]        (default: <repo>/.venv-sglang)
#   env:   PYTHON=python3.11       interpreter used to create a new venv
#          FORCE=1                 redo every step even if the venv is up to date
#
# Idempotent: a stamp file in the venv records a hash of the inputs (this script, scripts/cpu/*,
# pyproject.toml); when it matches, the script only checks the install and exits in a second or two.
#
# Why it is not `pip install sglang`: that pulls torch 2.14.1 (CUDA) and CUDA-only wheels
# (sgl-kernel, flashinfer, ...). Instead: torch 2.13.0 (the CPU wheel on disk), sglang and torchvision
# with --no-deps, and the runtime deps from requirements-sglang-cpu.txt under constraints.txt.
# CPU workarounds (none of them touches product code):
#   1. torchvision 0.28.0 on PyPI is a CUDA build whose C ops cannot load against CPU torch; two
#      unguarded `register_fake` decorators in torchvision/_meta_registrations.py are guarded.
#   2. SGLANG_USE_CPU_ENGINE=1 imports `sgl_kernel`; its CPU build is not on PyPI, so an import-only
#      stand-in (scripts/cpu/shim/sgl_kernel), with torch references of the linear-attention ops a
#      tiny Qwen3-Next calls (its `mamba` module), is put on sys.path by a .pth file.
#   3. The CPU test layer (scripts/cpu/layer, package sglang_cpu_layer, its own SGLang plugin): the
#      patches and torch reference kernels SGLang's CPU path lacks (cudaHostRegister and a CUDA copy
#      kernel for SGLang's own HiCache, attention sinks, DP attention's idle rank, PD prefill, EAGLE
#      on torch_native). Installed here only; it patches a process only when SGLANG_CPU_TEST_LAYER=1
#      is set there (the test suite sets it) and CUDA is absent. sgl_hicache itself patches nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CPU="$ROOT/scripts/cpu"
VENV=${1:-$ROOT/.venv-sglang}
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0

t0=$(date +%s)
lap() { echo "[install_sglang_cpu $(( $(date +%s) - t0 ))s] $*"; }
# pip's noise on these machines (local index locations it skips, resolver warnings about sglang's own
# CUDA pins, which are intentional here); anything else is shown.
quiet_pip() { grep -v -E "WARNING: Location .* is ignored|^(Requirement already satisfied|  Using cached|Looking in|  Downloading|Collecting)|requires .*, (but you have|which is not installed)|dependency resolver does not currently" || true; }

stamp_inputs() {
    { cat "$ROOT/scripts/install_sglang_cpu.sh" "$ROOT/pyproject.toml";
      find "$CPU" -type f \( -name '*.txt' -o -name '*.py' -o -name '*.toml' \) -not -path '*/__pycache__/*' | sort | xargs cat; } \
        | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.sgl_hicache_sglang_cpu.stamp"
WANT=$(stamp_inputs)

if [[ -z "${FORCE:-}" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    if "$VENV/bin/python" - <<PY
import importlib.metadata as md, sys
ok = md.version("sglang") == "$SGLANG_VERSION" and md.version("torch").startswith("$TORCH_VERSION")
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins")]
sys.exit(0 if ok and "sgl_hicache.sglang.plugin:register" in eps and "sglang_cpu_layer.plugin:register" in eps else 1)
PY
    then
        lap "up to date: $VENV (sglang $SGLANG_VERSION, torch $TORCH_VERSION, sgl_hicache plugin registered)"
        exit 0
    fi
    lap "stamp matches but the venv is incomplete; reinstalling"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
    lap "created venv $VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# torch first (CPU wheel from disk) together with the runtime deps, all under the constraints.
"${PIP[@]}" -q -c "$CPU/constraints.txt" -r "$CPU/requirements-sglang-cpu.txt" 2>&1 | quiet_pip
lap "torch $TORCH_VERSION + runtime deps"

# sglang and torchvision without their dependency pins (sglang pins a CUDA torch).
"${PIP[@]}" -q --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION" 2>&1 | quiet_pip
lap "sglang $SGLANG_VERSION + torchvision $TORCHVISION_VERSION (--no-deps)"

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# Workaround 1: guard torchvision's fake registrations of ops its CUDA-built _C cannot provide.
"$VENV/bin/python" - "$SITE/torchvision/_meta_registrations.py" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
patched = src
for op in ("nms", "qnms"):
    plain = f'@torch.library.register_fake("torchvision::{op}")'
    guarded = f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))'
    if guarded not in patched:
        patched = patched.replace(plain, guarded)
if patched != src:
    open(path, "w").write(patched)
    print("patched", path)
PY
# Workaround 2: the import-only sgl_kernel stand-in.
echo "$CPU/shim" > "$SITE/sgl_hicache_sgl_kernel_shim.pth"
lap "CPU workarounds (torchvision guard, sgl_kernel shim)"

# sgl_hicache itself (editable): registers the sglang.srt.plugins entry point; [dev] brings pytest.
# Then the CPU test layer (editable), its own plugin, off unless SGLANG_CPU_TEST_LAYER=1.
"${PIP[@]}" -q -c "$CPU/constraints.txt" -e "$ROOT[dev]" 2>&1 | quiet_pip
"${PIP[@]}" -q --no-deps -e "$CPU/layer" 2>&1 | quiet_pip
lap "sgl_hicache + the CPU test layer (editable)"

# Check: SGLang's cache modules import on the CPU engine, the shim is the one found, the plugin loads.
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - <<'PY' 2>&1 | grep -v -i warn
import importlib.metadata as md
import sglang, sgl_kernel, torch
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
from sglang.srt.mem_cache.registry import register_radix_cache_backend  # noqa: F401
eps = {e.name: e.value for e in md.entry_points(group="sglang.srt.plugins")}
assert eps.get("sgl_hicache") == "sgl_hicache.sglang.plugin:register", eps
assert eps.get("sglang_cpu_test_layer") == "sglang_cpu_layer.plugin:register", eps
print(f"ok: sglang {sglang.__version__}, torch {torch.__version__}, sgl_kernel from {sgl_kernel.__file__}")
PY
echo "$WANT" > "$STAMP"
lap "done ($(du -sh "$VENV" | cut -f1))"
