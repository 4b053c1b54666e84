#!/usr/bin/env bash
# Run the test suite; sets up the virtual environment first.
# Two phases of the selected tests (all of them, or those the arguments select: -m, -k, paths):
# first the quick tests and the slow ones that may run beside others (marked spread: in one
# process, or processes that time nothing) over the machine's cores (pytest-xdist), then the
# other slow tests one at a time (each runs two or three processes of its own that watch each
# other's timing). Exits non-zero when either phase failed.
#   scripts/test.sh -m "not slow"      (the quick subset, on every core)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# --durations: the slowest tests are named in every run's log (where the suite's time goes)
run() {  # one phase; 5 (none of the selected tests is of that phase) is not a failure
    local rc=0
    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then rc=0; fi
    return "$rc"
}
beside=0
run -n "${TEST_WORKERS:-auto}" --phase=beside "$@" || beside=$?
run --phase=alone "$@" || exit $?
exit "$beside"
