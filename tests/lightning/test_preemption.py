"""Preemption end to end: a real SIGTERM to a real Lightning job — one process, and a 2-rank
``torchrun`` job (SIGTERM to the agent, which forwards it) — costs zero steps: the ranks stop at
one step, that step is committed, the process exits 143, and the same command run again resumes
from that step and ends bit-identical (weights and optimizer state) to an uninterrupted run."""

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
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.runtime.preemption import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "preempt_job.py"
SIGNAL_AFTER_STEP = 15


def _command(world: int, store: Path, out: Path, validate: bool, workers: int) -> list[str]:
    job = [str(JOB), "--dir", str(store), "--out", str(out), "--workers", str(workers)]
    job += ["--validate"] if validate else []
    if world == 1:
        return [sys.executable, *job]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--monitor-interval",
        "0.1",
        *job,
    ]


def _run(
    world: int,
    store: Path,
    out: Path,
    *,
    signal_at: int | None = None,
    in_validation: bool = False,
    validate: bool = False,
    workers: int = 0,
) -> dict[str, Any]:
    """Run the job; with ``signal_at``, SIGTERM it once step ``signal_at`` is done (with
    ``in_validation``: once validating at such a step)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    log = (out / "job.log").open("a")
    proc = subprocess.Popen(
        _command(world, store, out, validate or in_validation, workers),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    signalled = None
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            due = _steps(out, 0, validation=in_validation) >= (signal_at or 0)
            if signal_at is not None and signalled is None and due:
                proc.send_signal(signal.SIGTERM)  # torchrun's agent forwards it to the workers
                signalled = time.monotonic()
            time.sleep(0.02)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    exited = time.monotonic() - signalled if signalled is not None else None
    return {"rc": rc, "exited_s": exited, "log": (out / "job.log").read_text()}


def _steps(out: Path, rank: int, *, validation: bool = False) -> int:
    """The newest step in the progress file (``validation``: only once validating at it)."""
    path = out / f"progress_rank{rank}.txt"
    lines = path.read_text().split() if path.exists() else []
    if validation:
        lines = [line[3:] for line in lines if line.startswith("val")]
    return int(lines[-1].removeprefix("val")) if lines else 0


def _final(out: Path, rank: int) -> dict[str, Any]:
    return torch.load(out / f"final_rank{rank}.pt", weights_only=False)


def _assert_same(mine: Any, ref: Any) -> None:
    if isinstance(ref, torch.Tensor):
        assert torch.equal(mine, ref)
    elif isinstance(ref, dict):
        assert mine.keys() == ref.keys()
        for key in ref:
            _assert_same(mine[key], ref[key])
    elif isinstance(ref, (list, tuple)):
        assert len(mine) == len(ref)
        for a, b in zip(mine, ref):
            _assert_same(a, b)
    else:
        assert mine == ref


@pytest.mark.parametrize(
    ("world", "in_validation", "workers"),
    [(1, False, 0), (2, False, 0), (1, True, 0), (2, True, 0)],
    ids=[
        "one process",
        "torchrun, 2 ranks",
        "one process, in validation",
        "torchrun, in validation",
    ],
)
def test_a_sigterm_costs_no_step(
    tmp_path: Path, world: int, in_validation: bool, workers: int
) -> None:
    reference = _run(
        world, tmp_path / "ref_store", tmp_path / "ref", validate=in_validation, workers=workers
    )
    assert reference["rc"] == 0, reference["log"][-4000:]

    store, out = tmp_path / "store", tmp_path / "run"
    first = _run(
        world, store, out, signal_at=SIGNAL_AFTER_STEP, in_validation=in_validation, workers=workers
    )
    text = first["log"]
    if world == 1:
        assert first["rc"] == EXIT_PREEMPTED, text[-4000:]
    else:  # torchrun's agent forwards the signal, waits for its workers, then exits itself
        assert "Received 15 death signal, shutting down workers" in text, text[-6000:]
    assert text.count(f"exiting with code {EXIT_PREEMPTED}") >= world, text[-6000:]
    stopped = [_steps(out, r) for r in range(world)]
    assert len(set(stopped)) == 1, f"the ranks stopped at different steps: {stopped}"
    with CheckpointStore(store) as reader:
        committed = reader.steps()[-1]
    assert committed == stopped[0] >= SIGNAL_AFTER_STEP, (committed, stopped)
    assert text.count(f"preempted at step {committed}") == world, text[-6000:]

    second = _run(world, store, out, validate=in_validation, workers=workers)
    assert second["rc"] == 0, second["log"][-4000:]
    for rank in range(world):
        result = json.loads((out / f"result_rank{rank}.json").read_text())
        assert result["resumed_from"] == committed, "the rerun must resume from the agreed step"
        _assert_same(_final(out, rank), _final(tmp_path / "ref", rank))
    print(
        f"\n{world} process(es): SIGTERM after step {SIGNAL_AFTER_STEP}, stopped and committed at "
        f"step {committed}, exited {first['exited_s']:.1f}s after the signal"
    )


def test_the_slurm_requeue_runs_after_the_plugins_checkpoint_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's SLURM auto-requeue handler (SIGUSR1) saves ``hpc_ckpt_N.ckpt`` through the
    plug-in and calls ``scontrol requeue`` right after: the plug-in's save of that file returns
    only once committed, so the fake ``scontrol`` on PATH runs after the manifest landed (a
    storage that takes 0.5 s to write a manifest makes the order visible)."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from lightning_incremental import IncrementalCheckpointIO
    from lightning_incremental.core.storage import LocalStorage
    from tests.lightning.test_checkpoint_io import data, net, trainer

    calls = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$(date +%s.%N) $@" >> {calls}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    for key, value in {
        "SLURM_JOB_ID": "4711",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "job",
    }.items():
        monkeypatch.setenv(key, value)
    landed: list[float] = []
    put = LocalStorage.put

    def slow_manifests(self: LocalStorage, path: str, data_: Any, **kwargs: Any) -> bool:
        if path.startswith("manifests/"):
            time.sleep(0.5)
            done = put(self, path, data_, **kwargs)
            landed.append(time.time())
            return done
        return put(self, path, data_, **kwargs)

    monkeypatch.setattr(LocalStorage, "put", slow_manifests)

    class Requeue(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # handled before the next batch

    plugin = IncrementalCheckpointIO()
    t = trainer(tmp_path, plugin, [Requeue()], max_steps=6)
    t.strategy._cluster_environment = SLURMEnvironment(auto_requeue=True)  # as under srun
    t._accelerator_connector.cluster_environment = t.strategy._cluster_environment
    t.fit(net(), data())
    plugin.close()
    hpc = sorted(tmp_path.glob("hpc_ckpt_*.ckpt"))
    assert hpc, "Lightning's requeue handler saved no checkpoint"
    requeued = float(calls.read_text().split()[0])
    assert landed and min(landed) <= requeued, (landed, requeued)
    assert calls.read_text().split()[1:] == ["requeue", "4711"]
