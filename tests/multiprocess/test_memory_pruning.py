"""The memory tier on one node, end to end over a real gloo group (``torchrun --standalone
--nproc-per-node 2 --max-restarts 1`` of ``tests/jobs/memory_pruning_job.py``): the node's
first rank writes the whole state, the second its own state alone, so the second's part of a
step is in memory long before the first's. The second rank is SIGKILLed while the first still
writes its part of step 3: the node's memory must still hold step 2 of both ranks, and the
restarted group resumes from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "memory_pruning_job.py"
TIMEOUT_S = 300


def test_a_rank_keeps_the_step_every_rank_holds_until_every_rank_holds_a_newer_one(
    tmp_path: Path,
) -> None:
    out, memory = tmp_path / "out", tmp_path / "memory"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        str(JOB),
        "--memory",
        str(memory),
        "--out",
        str(out),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # see tests/multiprocess/test_torchrun.py
    )
    run = subprocess.run(
        cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    # what the node held when rank 1 died: both ranks' step 2 (rank 0's step 3 unwritten)
    held = json.loads((out / "held.json").read_text())
    assert {"2:0", "2:1", "3:1"} <= set(held), held
    assert "3:0" not in held, held
    for rank in (0, 1):  # the restarted group resumed from it, from the node's own memory
        assert json.loads((out / f"resumed_rank{rank}.json").read_text()) == [2, "memory"]
