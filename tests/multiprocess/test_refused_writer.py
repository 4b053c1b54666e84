"""A real ``accelerate launch`` of 2 processes (gloo on CPU) against a store a live run of
another job writes: the main process finds the live writer at the checkpointer's creation, and
both processes raise ``WriterLeaseError`` naming it — the second as the coordinator's twin —
without either waiting in a collective; the live run keeps its lease."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_incremental.core import CheckpointStore
from tests.live_writer import JOB as LIVE_JOB
from tests.live_writer import live_writer, store_files

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "jobs" / "refused_writer_job.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_both_processes_refuse_a_live_writers_store_and_none_hangs(tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    with CheckpointStore(store) as first:
        first.save({"w": [1, 2, 3]}, 1).wait()
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        str(SCRIPT),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_INCREMENTAL")}
    env.update(JOB_STORE=str(store), JOB_OUT=str(out), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with live_writer(store) as live:
        before = store_files(store)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-4000:]
        results = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
        assert store_files(store) == before
    assert live.still_writer
    for rank, result in enumerate(results):
        assert result["writer_lease_error"], (rank, result)
        assert result["weights_unchanged"]
        assert f"pid {live.pid}" in result["message"] and f"job {LIVE_JOB}" in result["message"]
    assert results[0]["raised"][0] == "WriterLeaseError"
    assert results[1]["raised"][0] == "CoordinatorWriterLeaseError"
    assert "rank 0 could not start writing the checkpoint store" in results[1]["message"]
