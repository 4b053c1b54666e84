"""Preemption end to end: real signals to a real Lightning job cost zero steps — the ranks stop
at one step, that step is committed, the processes exit 143, and the same command run again
resumes from that step and ends bit-identical (weights and optimizer state) to an uninterrupted
run. One process gets SIGTERM twice; a 2-rank ``torchrun`` job gets signals as a cluster
delivers them (tests/deliveries.py): the agent and every worker, two or three deliveries each,
in a seeded random order and rhythm. Each job is preempted again and again in one sequence of
launches — during training, during a validation, SLURM's SIGUSR1 — each run resuming from the
last one's stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.runtime.policy.preemption import EXIT_PREEMPTED
from tests import deliveries

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "preempt_job.py"
SIGNAL_AFTER_STEP = 15


def _command(world: int, store: Path, out: Path, validate: bool) -> list[str]:
    job = [str(JOB), "--dir", str(store), "--out", str(out)]
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
    storm: Callable[[subprocess.Popen], list[str]] | None = None,
    env_extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the job; with ``signal_at``, SIGTERM it (``storm``: call it instead) once step
    ``signal_at`` is done (with ``in_validation``: once validating at such a step)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        **(env_extra or {}),
    )
    log = (out / "job.log").open("a")
    proc = subprocess.Popen(
        _command(world, store, out, validate or in_validation),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    signalled = None
    sent: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            due = _steps(out, 0, validation=in_validation) >= (signal_at or 0)
            if signal_at is not None and signalled is None and due:
                signalled = time.monotonic()
                if storm is not None:
                    sent = storm(proc)
                else:  # torchrun's agent forwards it to the workers
                    proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    exited = time.monotonic() - signalled if signalled is not None else None
    return {"rc": rc, "exited_s": exited, "log": (out / "job.log").read_text(), "sent": sent}


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


Storm = Callable[[subprocess.Popen], list[str]]


def _twice(then: int) -> Storm:
    """SIGTERM to one process, then ``then`` a moment later (a wrapper forwarding it once more,
    a Ctrl-C)."""

    def storm(proc: subprocess.Popen) -> list[str]:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.15)
        if proc.poll() is None:
            proc.send_signal(then)
        return ["SIGTERM", f"+0.15s {signal.Signals(then).name}"]

    return storm


def _cluster(seed: int, signals: tuple[int, ...]) -> Storm:
    """The agent and every worker, two or three deliveries each (tests/deliveries.py)."""

    def storm(proc: subprocess.Popen) -> list[str]:
        return deliveries.deliver(proc, JOB.name, seed, signals=signals)

    return storm


def _preempted_again_and_again(
    tmp_path: Path, world: int, storms: list[tuple[int, bool, Storm, dict[str, str]]]
) -> str:
    """One run of 24 steps (validating every 4) preempted once per ``storms`` entry — ``(after,
    in_validation, storm, env)``: ``storm`` sends the signals once ``after`` steps passed since
    the last stop (in a validation with ``in_validation``), the launch runs with ``env`` added —
    then run to its end. Each time the ranks stop at one step, that step commits, each exits 143,
    the next run resumes from it; the last run ends bit-identical to an uninterrupted one."""
    reference = _run(world, tmp_path / "ref_store", tmp_path / "ref", validate=True)
    assert reference["rc"] == 0, reference["log"][-4000:]

    store, previous, report = tmp_path / "store", 0, []
    for number, (after, in_validation, storm, env) in enumerate(storms):
        out = tmp_path / f"run{number}"
        if previous:  # the progress so far: the step this run resumes from
            out.mkdir()
            for rank in range(world):
                (out / f"progress_rank{rank}.txt").write_text(f"{previous}\n")
        run = _run(
            world,
            store,
            out,
            signal_at=previous + after,
            in_validation=in_validation,
            validate=True,
            storm=storm,
            env_extra=env,
        )
        text, why = run["log"], "\n".join(run["sent"]) + "\n" + run["log"][-6000:]
        assert run["exited_s"] is not None, "the run ended before it could be signalled"
        if world == 1:
            assert run["rc"] == EXIT_PREEMPTED, why
        assert text.count(f"exiting with code {EXIT_PREEMPTED}") >= world, why
        stopped = [_steps(out, r) for r in range(world)]
        assert len(set(stopped)) == 1, f"the ranks stopped at different steps: {stopped}\n{why}"
        with CheckpointStore(store) as reader:
            committed = reader.steps()[-1]
        assert committed == stopped[0] >= previous + after, (committed, stopped, why)
        assert text.count(f"preempted at step {committed}") == world, why
        for rank in range(world):  # resumed from the previous stop: no step trained twice or lost
            lines = (out / f"progress_rank{rank}.txt").read_text().split()
            trained = [int(line) for line in lines if not line.startswith("val")]
            assert trained[1 if previous else 0] == previous + 1, (rank, trained[:3], why)
        where = "in a validation" if in_validation else "in training"
        report.append(f"step {committed} ({where}, exited {run['exited_s']:.1f}s after)")
        previous = committed

    final_out = tmp_path / "final"
    final = _run(world, store, final_out, validate=True)
    assert final["rc"] == 0, final["log"][-4000:]
    for rank in range(world):
        result = json.loads((final_out / f"result_rank{rank}.json").read_text())
        assert result["resumed_from"] == previous, "the rerun must resume from the agreed step"
        _assert_same(_final(final_out, rank), _final(tmp_path / "ref", rank))
    return ", ".join(report)


def test_one_process_a_signal_delivered_twice_costs_no_step(tmp_path: Path) -> None:
    """One process, SIGTERM then SIGTERM again during training, then SIGTERM and SIGINT during a
    validation (which runs to its end: its random draws are part of the run)."""
    storms = [
        (SIGNAL_AFTER_STEP, False, _twice(signal.SIGTERM), {}),
        (2, True, _twice(signal.SIGINT), {}),
    ]
    report = _preempted_again_and_again(tmp_path, 1, storms)
    print(f"\none process: stopped and committed at {report}")


def test_torchrun_signals_delivered_again_and_again_cost_no_step(tmp_path: Path) -> None:
    """Lightning DDP, ``torchrun`` with 2 ranks, signalled as a cluster signals: the agent (which
    forwards) and every worker, two or three deliveries each in a seeded random order and rhythm
    — once during training, once during a validation (SIGTERM and SIGINT), once SLURM-style
    (SIGUSR1 to every process; the agent forwards it as ``TORCHELASTIC_SIGNALS_TO_HANDLE``
    says)."""
    both = (signal.SIGTERM, signal.SIGINT)
    slurm = {
        "SLURM_JOB_ID": "4711",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    }
    storms = [
        (3, False, _cluster(1, both), {}),
        (2, True, _cluster(2, both), {}),
        (3, False, _cluster(3, (signal.SIGUSR1,)), slurm),
    ]
    report = _preempted_again_and_again(tmp_path, 2, storms)
    print(f"\ntorchrun, 2 ranks: stopped and committed at {report}")


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
