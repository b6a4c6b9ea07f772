#!/usr/bin/env bash
# The HiCache peer's venv for benchmarks/server/store.py: SGLang's own HiCache with
# `--hicache-storage-backend mooncake` on CPU needs the reference's hicache-peer-plugin
# (pure-torch page_first_direct copies, loaded through the `sglang.srt.plugins` entry point).
# Installed into that plugin's own small venv, never into .venv-sglang, where it would load into
# every SGLang server started from it.
#
#   scripts/install_hicache_peer.sh [VENV] [SGLANG_VENV] [PLUGIN_DIR]
#
# VENV (default .venv-hicache-peer) is an overlay: a venv without packages of its own except the
# plugin, whose .pth adds SGLANG_VENV's site-packages (default .venv-sglang, as
# scripts/install_sglang_cpu.sh builds it: SGLang 0.5.23, mooncake, sgl_hicache) behind its own.
# Seconds to build, no download. PLUGIN_DIR defaults to the reference copy beside the repository.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv-hicache-peer}
SGL=${2:-$ROOT/.venv-sglang}
PLUGIN=${3:-$ROOT/../shared/reference/mooncake-store/hicache-peer-plugin}
[ -x "$SGL/bin/python" ] || { echo "error: $SGL/bin/python not found (scripts/install_sglang_cpu.sh builds it)" >&2; exit 1; }
[ -f "$PLUGIN/pyproject.toml" ] || { echo "error: $PLUGIN/pyproject.toml not found (the hicache-peer-plugin)" >&2; exit 1; }
SITE=$("$SGL/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE=$("$SGL/bin/python" -c 'import sys; print(sys._base_executable)')
rm -rf "$VENV"
"$BASE" -m venv --without-pip "$VENV"
VSITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$SITE')" > "$VSITE/zz_sglang_venv.pth"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp -r "$PLUGIN" "$TMP/plugin" && chmod -R u+w "$TMP/plugin"   # the reference copy is read-only; the build writes beside it
"$SGL/bin/pip" install -q --no-deps --no-build-isolation --target "$VSITE" "$TMP/plugin"
"$VENV/bin/python" -c 'import importlib.metadata as m, sglang; names = sorted(e.name for e in m.entry_points(group="sglang.srt.plugins")); assert "hicache_mooncake_cpu" in names, names; print("ok: sglang", sglang.__version__, "plugins", names)'
