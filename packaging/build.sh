#!/usr/bin/env bash
# Build the one-file executable dist/alp-gateway (runner, hub and simulator) with PyInstaller.
#
#   packaging/build.sh            # from anywhere; uses $ALP_BUILD_VENV (default build/venv)
#
# The build venv gets only the runtime dependencies and PyInstaller (pyproject's `build` extra),
# so nothing else that happens to be installed ends up in the binary. The binary runs on Linux
# machines of the same architecture with a glibc at least as new as the build machine's: build on
# the oldest distribution you deploy to (or on the Pi itself for arm64).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="${ALP_BUILD_VENV:-$ROOT/build/venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "build.sh: creating the build venv in $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# Always reinstall the project from this tree (pip rebuilds a local directory every time).
"$VENV/bin/python" -m pip install -q "${ROOT}[build]"

start=$(date +%s)
"$VENV/bin/python" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath "$ROOT/dist" --workpath "$ROOT/build/pyinstaller" \
    "$ROOT/packaging/alp-gateway.spec"
end=$(date +%s)

BIN="$ROOT/dist/alp-gateway"
"$BIN" --version >/dev/null
echo "build.sh: built $BIN ($(du -h "$BIN" | cut -f1), $((end - start)) s for PyInstaller)"
