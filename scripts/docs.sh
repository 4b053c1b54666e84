#!/usr/bin/env bash
# Build the documentation site into site/ (git-ignored), warnings as errors; sets up the
# virtual environment with the docs extra first. Extra arguments go to mkdocs build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
bash scripts/setup.sh test,docs
NO_MKDOCS_2_WARNING=1 exec "$VENV/bin/python" -m mkdocs build --strict --site-dir site "$@"
