#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what it needs.
# Usage: scripts/setup.sh [EXTRAS]   (default extras: test)
# Installs the pinned CPU build of torch first: an unpinned torch would pull a multi-GB CUDA
# build. Set TORCH_SPEC to choose another (e.g. TORCH_SPEC="torch==2.5.1").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRAS="${1:-test}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.installed-$(cat pyproject.toml scripts/setup.sh ${PIP_CONSTRAINT:-} | sha1sum | cut -c1-12)-${EXTRAS//,/_}"
if [ ! -f "$stamp" ]; then
    python -m pip install --quiet --upgrade pip >&2
    if ! python -c "import torch" 2>/dev/null; then
        echo "[setup] installing $TORCH_SPEC (CPU build)" >&2
        python -m pip install --quiet "$TORCH_SPEC" >&2
    fi
    echo "[setup] installing lightning-incremental[$EXTRAS]" >&2
    python -m pip install --quiet -e ".[$EXTRAS]" >&2
    touch "$stamp"
fi
