"""Real ``accelerate launch`` runs with 2 processes on CPU (gloo): interrupted after a committed
checkpoint and restarted with the same command, a run ends bit-identical to an uninterrupted one.

On a machine without GPUs, ``accelerate launch --multi_gpu --num_processes 2`` starts the two
processes through torchrun and Accelerate picks the MULTI_CPU (gloo) backend;
``--num_processes 2 --cpu`` alone would start a single process (multi-CPU launching needs mpirun).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from tests.accelerate_results import assert_identical as assert_same_training

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "accelerate_job.py"
CRASH_AFTER = 7  # the newest committed checkpoint is then step 6: mid-epoch (epoch 1, batch 1/5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(env: dict[str, str], restarts: int = 0) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        *(["--max_restarts", str(restarts), "--monitor_interval", "0.1", "--rdzv_backend",
           "c10d"] if restarts else []),
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        str(JOB),
    ]  # fmt: skip
    full = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_INCREMENTAL")}
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full.get("PYTHONPATH")]))
    full.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _why(out: subprocess.CompletedProcess[str]) -> str:
    """The lines of a failed launch that say why (the tail is mostly the launcher's traceback)."""
    keys = ("Error", "error", "terminate", "what()", "Fatal", "Signal", "exitcode")
    lines = (out.stdout + out.stderr).splitlines()
    return "\n".join([line for line in lines if any(k in line for k in keys)][:60])


def finished(env: dict[str, str], restarts: int = 0) -> dict[str, Any]:
    out = launch(env, restarts)
    assert out.returncode == 0, _why(out)
    assert out.stdout.count("JOB DONE") == 2, out.stdout[-2000:]
    result: dict[str, Any] = torch.load(env["JOB_OUT"], weights_only=False)
    return result


def crashed(env: dict[str, str]) -> None:
    out = launch({**env, "JOB_CRASH_AFTER": str(CRASH_AFTER)})
    assert out.returncode != 0, "the interrupted run should have exited abnormally"
    assert not Path(env["JOB_OUT"]).exists()


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == 15
    assert_same_training(a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run (checkpointing, which must not change the training)."""
    tmp = tmp_path_factory.mktemp("reference")
    env = {"JOB_MODE": "api", "JOB_STORE": str(tmp / "store"), "JOB_OUT": str(tmp / "out.pt")}
    result = finished(env)
    assert result["resumed"] is None
    assert result["steps"] == [3, 6, 9, 12, 15]
    return result


def test_interrupted_mid_epoch_and_restarted_is_bit_identical(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    env = {"JOB_MODE": "api", "JOB_STORE": str(tmp_path / "store"), "JOB_OUT": str(tmp_path / "o")}
    crashed(env)
    resumed = finished(env)
    assert resumed["resumed"] == 6
    assert resumed["steps"] == [3, 6, 9, 12, 15]
    assert_identical(reference, resumed)


def test_a_diverged_process_is_repaired_and_the_run_stays_bit_identical(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Process 1 flips a bit of a weight right before the save of step 6: the replica check
    finds it, broadcasts the main process's copy, records the repair, and the run ends as if
    nothing happened, with both processes in agreement."""
    env = {
        "JOB_MODE": "api",
        "JOB_STORE": str(tmp_path / "store"),
        "JOB_OUT": str(tmp_path / "o"),
        "JOB_FLIP_AT": "6",
        "JOB_REPLICA_CHECK": "repair",
    }
    result = finished(env)
    assert_identical(reference, result)
    assert result["replicas_agree"]
    assert result["repairs"][6] == {
        "diverged_ranks": [1],
        "source_rank": 0,
        "repaired": ["models/0/0.weight"],
        "repaired_count": 1,
    }
    assert all(result["repairs"][s] is None for s in (3, 9, 12, 15))


def test_a_killed_process_is_restarted_by_the_launcher_and_resumes_exactly(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """``accelerate launch --max_restarts 1 --rdzv_backend c10d`` (the default static
    rendezvous serves a restarted group the first attempt's keys): process 1 is SIGKILLed at
    step 8; the launcher restarts both processes, the checkpointer claims a new generation and
    the run resumes from the newest checkpoint (6) by itself, ending bit-identical to the
    uninterrupted run."""
    env = {
        "JOB_MODE": "api",
        "JOB_STORE": str(tmp_path / "store"),
        "JOB_OUT": str(tmp_path / "o"),
        "JOB_KILL_AT": "8",
        # torchrun's shared rendezvous store keeps the first attempt's gloo addresses
        # (pytorch/pytorch#135712): each attempt gets its own store with this setting.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    result = finished(env, restarts=1)
    assert result["resumed"] == 6
    assert_identical(reference, result)
    with CheckpointStore(env["JOB_STORE"]) as store:
        assert [store.manifest(s).generation for s in store.steps()] == [1, 1, 2, 2, 2]


def test_launch_flag_routes_save_state_and_load_state(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """ACCELERATE_INCREMENTAL on the launch line reaches both processes; the script's plain
    ``accelerator.save_state()`` / ``load_state()`` go through the engine, and the resumed run
    is bit-identical, with the save iteration restored."""
    env = {
        "JOB_MODE": "flag",
        "ACCELERATE_INCREMENTAL": str(tmp_path / "store"),
        "JOB_OUT": str(tmp_path / "o"),
    }
    crashed(env)
    resumed = finished(env)
    assert resumed["resumed"] == 1  # save_state #0 at step 3, #1 at step 6
    assert resumed["iteration"] == 5  # Accelerate's own load_state would restart it at 0
    assert resumed["steps"] == [0, 1, 2, 3, 4]
    assert_identical(reference, resumed)


def test_bad_launch_flag_fails_clearly(tmp_path: Path) -> None:
    out = launch(
        {"JOB_MODE": "flag", "ACCELERATE_INCREMENTAL": "yes", "JOB_OUT": str(tmp_path / "o")}
    )
    assert out.returncode != 0
    assert "ACCELERATE_INCREMENTAL must be the checkpoint directory or URL" in out.stderr


def test_example_resumes_after_sigkill(tmp_path: Path) -> None:
    """examples/accelerate_example.py, single process: SIGKILLed after a committed checkpoint and
    rerun with the same command, it prints the uninterrupted run's weights checksum."""
    example = ROOT / "examples" / "accelerate_example.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def run(store: str, *extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(example), "--dir", store, "--epochs", "2", *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    def checksum(out: subprocess.CompletedProcess[str]) -> str:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        return next(line for line in out.stdout.splitlines() if line.startswith("weights"))

    reference = checksum(run(str(tmp_path / "a")))
    killed = run(str(tmp_path / "b"), "--crash-at", "12")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run(str(tmp_path / "b"))
    assert "resumed at step 10" in resumed.stdout
    assert checksum(resumed) == reference
