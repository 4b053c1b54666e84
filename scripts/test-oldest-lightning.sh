#!/usr/bin/env bash
# Run the Lightning adapter's quick tests against the oldest Lightning release we support
# (lightning_incremental/lightning/compat.py: OLDEST_SUPPORTED), in a venv of its own.
# Over the machine's cores (pytest-xdist, as the README's quick tests); extra arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST="${OLDEST_LIGHTNING:-lightning==2.5.0}"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$OLDEST" > "$constraints"
PIP_CONSTRAINT="$constraints" VENV=.venv-oldest-lightning bash scripts/setup.sh test
.venv-oldest-lightning/bin/python -c "import lightning; print('[test] against lightning', lightning.__version__)"
exec .venv-oldest-lightning/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-auto}" -m "not slow" \
    tests/lightning tests/runtime/test_failure_policy.py tests/tools/test_cli.py "$@"
