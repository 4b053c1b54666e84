#!/usr/bin/env bash
# Run the demo: train, checkpoint incrementally, crash, restart, resume, print the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python examples/demo.py "$@"
