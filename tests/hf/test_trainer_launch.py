"""A user's ``transformers.Trainer`` script (``tests/jobs/hf_trainer_job.py``, no line of ours)
under ``accelerate launch ... -m accelerate_incremental --dirpath STORE``, on 1 and 2 CPU processes:
checkpoints go to the store at the Trainer's cadence; SIGKILLed mid-epoch and run again with the
same command, it resumes by itself and ends bit-identical (weights, optimizer and scheduler) to an
uninterrupted run; signalled again and again as a cluster signals (SIGTERM, SIGINT, SLURM's
SIGUSR1 to the launcher and every process), it loses no step; and each checkpoint after the
first writes fewer bytes than the Trainer's own ``checkpoint-N`` folder of the same run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.runtime.memory.steps import job_of
from lightning_incremental.runtime.memory.tier import MemoryTier
from tests import deliveries
from tests.multiprocess.test_accelerate_launch import _free_port, _why

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "hf_trainer_job.py"
SAVES = [8, 16, 24, 30]  # save_steps=8, max_steps=30 (the Trainer also saves at the end)
CRASH_AFTER = 20  # newest committed: step 16, mid-epoch on 1 process (12 batches an epoch: epoch
# 1, batch 4) and on 2 (6 batches an epoch per process: epoch 2, batch 4)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_INCREMENTAL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def launch(
    tmp: Path, processes: int, *job_args: str, config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The job under the launch flag: ``--dirpath tmp/store``, or ``--config config``."""
    store = ["--config", str(config)] if config else ["--dirpath", str(tmp / "store")]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        *(["--multi_gpu"] if processes > 1 else []),
        "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "accelerate_incremental", *store,
        str(JOB), "--output-dir", str(tmp / "out"), "--out", str(tmp / "result.pt"), *job_args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)


def finished(
    tmp: Path, processes: int, *job_args: str, config: Path | None = None
) -> dict[str, Any]:
    done = launch(tmp, processes, *job_args, config=config)
    assert done.returncode == 0, _why(done) + done.stderr[-3000:]
    assert done.stdout.count("JOB DONE") == processes, done.stdout[-2000:]
    result: dict[str, Any] = torch.load(tmp / "result.pt", weights_only=False)
    result["log"] = done.stdout + done.stderr
    return result


def killed_then_rerun(
    tmp: Path, processes: int, *job_args: str, rerun: tuple[str, ...] = ()
) -> dict[str, Any]:
    """SIGKILLed at step ``CRASH_AFTER``, then the same command again (plus ``rerun``)."""
    killed = launch(tmp, processes, "--crash-after", str(CRASH_AFTER), *job_args)
    assert killed.returncode != 0, "the interrupted run should have died"
    assert not (tmp / "result.pt").exists()
    assert CheckpointStore(tmp / "store").steps() == [8, 16]
    return finished(tmp, processes, *job_args, *rerun)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"] == 30
    for part in ("model", "optimizer", "scheduler"):
        assert _same(a[part], b[part]), f"{part} differs"


def test_two_processes_killed_resume_from_the_memory_tier(
    tmp_path: Path, two: dict[str, Any]
) -> None:
    """The launch flag's JSON config with the memory tier every step (both processes on one
    node, one copy of the weights and optimizer in the first process's part): SIGKILLed at step
    20 (the store's newest committed step 16), the same command resumes from memory step 19,
    the second process's part merged with the first's, and ends bit-identical to the
    uninterrupted run; the finished run leaves no memory behind."""
    config = tmp_path / "incremental.json"
    memory = tmp_path / "mem"
    settings = {"dirpath": str(tmp_path / "store"), "memory_every_n_steps": 1}
    config.write_text(json.dumps({**settings, "memory_dir": str(memory)}))
    killed = launch(tmp_path, 2, "--crash-after", str(CRASH_AFTER), "--limit", "2", config=config)
    assert killed.returncode != 0, "the interrupted run should have died"
    store = CheckpointStore(tmp_path / "store")
    assert store.steps() == [8, 16]
    tier = MemoryTier(memory, job=job_of(str(store.url)), generation=0, world_size=2)
    held = {(h.rank, h.step, h.layout) for h in tier.inventory()}
    assert held == {(0, CRASH_AFTER - 1, 2), (1, CRASH_AFTER - 1, 2)}, held  # one copy a node
    resumed = finished(tmp_path, 2, "--limit", "2", config=config)
    line = f"from step {CRASH_AFTER - 1} of the memory tier (own node's memory)"
    assert f"RESUMING the Trainer {line}" in resumed["log"], resumed["log"][-4000:]
    assert_identical(two, resumed)
    assert not list(memory.rglob("header.json")), "a finished run's memory parts stay"


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The script run as ``python hf_trainer_job.py``: the Trainer's own checkpoints."""
    tmp = tmp_path_factory.mktemp("own")
    cmd = [sys.executable, str(JOB), "--output-dir", str(tmp / "out"), "--out", str(tmp / "r.pt")]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, torch.load(tmp / "r.pt", weights_only=False)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("one")
    return tmp, finished(tmp, 1)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("two")
    result = finished(tmp, 2, "--limit", "2")
    assert CheckpointStore(tmp / "store").steps() == [24, 30]
    return result


def test_the_launch_flag_routes_the_trainers_checkpoints_through_the_store(
    one: tuple[Path, dict[str, Any]], own: tuple[Path, dict[str, Any]]
) -> None:
    tmp, result = one
    assert CheckpointStore(tmp / "store").steps() == SAVES
    for step in SAVES:
        folder = tmp / "out" / f"checkpoint-{step}"
        names = {p.name for p in folder.iterdir()}
        assert {"incremental_checkpoint.json", "trainer_state.json", "config.json"} <= names
        assert not any(n.endswith((".safetensors", ".pt", ".pth", ".bin")) for n in names - {
            "training_args.bin"})  # fmt: skip
    assert "Trainer checkpoints go to" in result["log"]
    assert_identical(result, own[1])  # checkpointing does not change the training


def test_one_process_killed_mid_epoch_resumes_bit_identical(
    tmp_path: Path, one: tuple[Path, dict[str, Any]]
) -> None:
    resumed = killed_then_rerun(tmp_path, 1)
    assert "RESUMING the Trainer from" in resumed["log"]
    assert "checkpoint-16 (step 16 of" in resumed["log"]
    assert_identical(one[1], resumed)
    assert CheckpointStore(tmp_path / "store").steps() == SAVES


def test_resume_from_checkpoint_true_as_users_pass_it(
    tmp_path: Path, one: tuple[Path, dict[str, Any]]
) -> None:
    resumed = killed_then_rerun(tmp_path, 1, rerun=("--resume", "true"))
    assert "checkpoint-16 (step 16 of" in resumed["log"]
    assert_identical(one[1], resumed)


def test_bytes_per_checkpoint_against_the_trainers_own(
    one: tuple[Path, dict[str, Any]], own: tuple[Path, dict[str, Any]]
) -> None:
    """The first checkpoint is full size; every later one writes what changed (the frozen
    embeddings are referenced, the rest delta-encoded), well under the Trainer's own folder."""
    root = one[0] / "store"
    store = CheckpointStore(root)
    manifests = {p.stem.lstrip("0"): p.stat().st_size for p in (root / "manifests").glob("*.json")}
    ours = {
        step: int(store.manifest(step).stats["bytes_data"]) + manifests[str(step)] for step in SAVES
    }
    theirs = {step: _folder_bytes(own[0] / "out" / f"checkpoint-{step}") for step in SAVES}
    print("bytes per checkpoint (ours, the Trainer's):", {s: (ours[s], theirs[s]) for s in SAVES})
    assert ours[8] < 1.2 * theirs[8]
    for step in SAVES[1:]:
        assert ours[step] < 0.65 * theirs[step], (step, ours[step], theirs[step])


def _preempted(
    tmp: Path, name: str, after: int, seed: int, signals: tuple[int, ...], env: dict[str, str]
) -> dict[str, Any]:
    """The 2-process launch (``--limit 2``, slowed down), signalled as a cluster signals (the
    launcher and every worker: tests/deliveries.py) once process 0 finished step ``after``."""
    progress = tmp / "progress"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "accelerate_incremental", "--dirpath", str(tmp / "store"),
        str(JOB), "--output-dir", str(tmp / "out"), "--out", str(tmp / "result.pt"),
        "--limit", "2", "--slow", "0.25", "--progress", str(progress),
    ]  # fmt: skip
    log = tmp / f"{name}.log"
    sent: list[str] = []
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env={**_env(), **env}, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if not sent and _last_step(progress, 0) >= after:
                    sent = deliveries.deliver(proc, JOB.name, seed, signals=signals)
                time.sleep(0.02)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    why = "\n".join(sent) + "\n" + text[-6000:]
    assert sent, "the run ended before it could be signalled:\n" + why
    stopped = [_last_step(progress, rank) for rank in range(2)]
    return {"rc": rc, "log": text, "why": why, "stopped": stopped}


def _last_step(progress: Path, rank: int) -> int:
    path = Path(f"{progress}.rank{rank}")
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-1]) if lines else 0


def test_two_processes_killed_then_signalled_again_and_again_lose_no_step(
    tmp_path: Path, two: dict[str, Any]
) -> None:
    """Two processes with save_total_limit=2, SIGKILLed mid-epoch (the newest committed step
    16), then preempted twice by signals as a cluster delivers them: the launcher and every
    worker, two or three deliveries each (SIGTERM and SIGINT, seeded random order and rhythm),
    then SLURM-style (SIGUSR1 to every process; the launcher's agent forwards it as
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` says; rank 0 requeues after the commit). Each preemption
    stops both processes at one step, that step commits, both exit 143; each run resumes from
    the last one's newest committed step, and the last ends bit-identical to the uninterrupted
    run. The store keeps exactly the checkpoints whose folders the Trainer's rotation kept."""
    killed = launch(tmp_path, 2, "--crash-after", str(CRASH_AFTER), "--limit", "2")
    assert killed.returncode != 0, "the interrupted run should have died"
    assert CheckpointStore(tmp_path / "store").steps() == [8, 16]
    slurm, calls = deliveries.slurm_env(tmp_path)
    previous = 16
    for name, after, seed, signals, env in [
        ("storm", 2, 11, (signal.SIGTERM, signal.SIGINT), {}),
        ("slurm", 2, 12, (signal.SIGUSR1,), slurm),
    ]:
        run = _preempted(tmp_path, name, previous + after, seed, signals, env)
        why, stopped = run["why"], run["stopped"]
        assert f"checkpoint-{previous} (step {previous} of" in run["log"], why
        assert stopped[0] == stopped[1] >= previous + after, (stopped, why)
        assert CheckpointStore(tmp_path / "store").steps()[-1] == stopped[0], why
        assert run["log"].count(f"preempted: step {stopped[0]} committed") == 2, why
        assert run["log"].count("JOB DONE") == 0, why
        previous = stopped[0]
    assert calls.read_text().split() == ["requeue", "4711"], "rank 0 requeues, once"

    resumed = finished(tmp_path, 2, "--limit", "2")
    assert f"checkpoint-{previous} (step {previous} of" in resumed["log"]
    assert_identical(two, resumed)
    assert CheckpointStore(tmp_path / "store").steps() == [24, 30]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "checkpoint-24",
        "checkpoint-30",
    ]
