#!/usr/bin/env bash
# Run the test suite; sets up the virtual environment first.
# Without arguments: the quick tests and the slow ones that may run beside others (marked
# spread: in one process, or processes that time nothing) over the machine's cores
# (pytest-xdist), then the other slow tests one at a time (each runs two or three processes of
# its own that watch each other's timing). Extra arguments go to one plain pytest run instead:
#   scripts/test.sh -m "not slow"      (the quick subset)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# --durations: the slowest tests are named in every run's log (where the suite's time goes)
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-auto}" -m "not slow or spread" \
    --durations=15
exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "slow and not spread" --durations=15
