#!/usr/bin/env bash
# Run the test suite; sets up the virtual environment first.
# Extra arguments go to pytest, e.g.  scripts/test.sh -m "not slow"   (the quick subset)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
