#!/usr/bin/env bash
# Run the test suite; sets up the virtual environment first.
# Without arguments: the in-process tests spread over the machine's cores (pytest-xdist), then
# the multi-process tests (marked slow: each already runs two or three processes of its own)
# one at a time. Extra arguments go to one plain pytest run instead, e.g.
#   scripts/test.sh -m "not slow"      (the quick subset)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-auto}" -m "not slow"
exec .venv/bin/python -m pytest -q -p no:cacheprovider -m slow
