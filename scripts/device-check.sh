#!/usr/bin/env bash
# The CUDA paths and the GPU figures, on a machine with one CUDA GPU, in under 8 minutes:
#   1. the GPU-marked tests (tests/gpu: the pinned-memory snapshot, the copies on a side stream
#      ordered against training's later work, load(into=) onto device tensors, a bit-exact
#      resume of a Lightning run on accelerator="gpu");
#   2. the training stall per checkpoint on the GPU (benchmarks/suites/gpu_stall.py);
#   3. the goodput benchmark on the GPU, both workloads, a save every 10 steps
#      (benchmarks.suites.goodput).
# Usage, from the repository root:  scripts/device-check.sh [REPORT_DIR]   (default: $OUT, else
# device_out). Writes REPORT_DIR/report.md (a summary of everything) and the logs and JSON it
# is made from. Exits non-zero when a test failed or a step did not finish.
#
# It uses the machine's own python3 (a CUDA build of torch, with Lightning, Accelerate, numpy,
# fsspec, xxhash, rich, pytest and hypothesis); packages it lacks (zstandard on some images) can
# be put as wheels in .whl/, installed with pip --no-index into a private directory.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${1:-${OUT:-device_out}}"
mkdir -p "$REPORT"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import zstandard, xxhash, fsspec, rich" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/li-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/li-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# cuBLAS needs a fixed workspace for deterministic results (the bit-exact resume test)
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
export LI_DEVICE_REPORT="$REPORT/cuda_paths.jsonl"
rm -f "$LI_DEVICE_REPORT"
status=0

step() {  # step NAME SECONDS COMMAND...: run it with a deadline, its output in REPORT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "[device-check] $name (at most ${limit}s)"
    local started=$SECONDS
    timeout "$limit" "$@" >"$REPORT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - started)) s" >>"$REPORT/steps.txt"
    tail -n 5 "$REPORT/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

: >"$REPORT/steps.txt"
{
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PY" -c "import lightning, accelerate, zstandard; print('lightning', lightning.__version__, 'accelerate', accelerate.__version__, 'zstandard', zstandard.__version__)"
} >"$REPORT/machine.txt" 2>&1
cat "$REPORT/machine.txt"

step gpu-tests 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs
step gpu-stall 90 "$PY" -m benchmarks.suites.gpu_stall --out "$REPORT"
step goodput 240 "$PY" -m benchmarks.suites.goodput --device cuda --regimes free --intervals 10 \
    --steps 50 --repeats 1 --systems none,callback,plugin,modelcheckpoint,async_io,incremental,save_state \
    --out "$REPORT/goodput"

{
    echo "# Device check"
    echo
    echo '```'
    cat "$REPORT/machine.txt"
    echo
    cat "$REPORT/steps.txt"
    echo '```'
    echo
    echo "## GPU-marked tests"
    echo
    echo '```'
    tail -n 15 "$REPORT/gpu-tests.log"
    echo '```'
    echo
    echo "## CUDA path figures (tests/gpu, JSON lines)"
    echo
    echo '```'
    cat "$LI_DEVICE_REPORT" 2>/dev/null
    echo '```'
    echo
    cat "$REPORT/gpu_stall.md" 2>/dev/null
    echo
    cat "$REPORT/goodput/goodput.md" 2>/dev/null
} >"$REPORT/report.md"
echo "[device-check] report: $REPORT/report.md (status $status)"
exit "$status"
