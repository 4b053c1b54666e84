"""Retention beside a sharded save: the coordinator's retention after step S never removes an
object of another rank's part of step S+1 (tests/jobs/sharded_retention_job.py, 2 gloo ranks
under torchrun, the coordinator's object listing slowed to a second)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import CheckpointStore

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "sharded_retention_job.py"


def test_retention_spares_the_other_ranks_next_part(tmp_path: Path) -> None:
    store_dir, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(JOB), str(store_dir), str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        outcomes = json.loads((out / f"rank{rank}.json").read_text())
        assert set(outcomes.values()) == {"ok"}, outcomes
    with CheckpointStore(str(store_dir)) as store:
        assert store.steps() == [4]
        assert store.verify(4).ok
        g = torch.Generator().manual_seed(4)
        assert torch.equal(store.load()["w"], torch.randn(8192, generator=g))
