"""Preemption under Accelerate, end to end: real signals cost zero steps — every process stops
at one batch boundary, that step is committed, the processes exit 143, and the same command run
again resumes from that step and ends bit-identical (weights and optimizer state) to an
uninterrupted run.

* ``accelerate launch --multi_gpu --num_processes 2 -m accelerate_incremental --dirpath STORE``
  over the unmodified tests/jobs/plain_accelerate_job.py (two gloo processes on CPU, see
  test_accelerate_launch.py): signals as a cluster delivers them (tests/deliveries.py) — the
  launcher, whose agent forwards them, and every process, two or three deliveries each — and
  SLURM-style, SIGUSR1 to every process.
* tests/jobs/accelerate_job.py alone (one process, ``IncrementalCheckpointer`` with
  ``iterate`` and ``maybe_save``): the SIGTERM goes to the process.
"""

from __future__ import annotations

import os
import re
import signal
import socket
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
from tests.accelerate_results import assert_identical

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "tests" / "jobs" / "plain_accelerate_job.py"
API = ROOT / "tests" / "jobs" / "accelerate_job.py"
SIGNAL_AFTER_STEP = 7  # mid-epoch in both jobs (epochs of 5 batches with 2 processes, 10 alone)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(extra: dict[str, str]) -> dict[str, str]:
    skip = ("ACCELERATE_INCREMENTAL", "JOB_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra)
    return env


def _steps(progress: Path, rank: int) -> list[int]:
    path = Path(f"{progress}.rank{rank}")
    return [int(s) for s in path.read_text().split()] if path.exists() else []


def _run(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    *,
    progress: Path | None = None,
    after: int = SIGNAL_AFTER_STEP,
    storm: Callable[[subprocess.Popen], list[str]] | None = None,
) -> dict[str, Any]:
    """Run ``cmd``; with ``progress``, SIGTERM it (``storm``: call it instead) once process 0
    finished step ``after``."""
    sent: list[str] = []
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        signalled = None
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                steps = _steps(progress, 0) if progress is not None else []
                if signalled is None and steps and steps[-1] >= after:
                    signalled = time.monotonic()
                    if storm is not None:
                        sent = storm(proc)
                    else:
                        proc.send_signal(signal.SIGTERM)
                time.sleep(0.02)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    exited = time.monotonic() - signalled if signalled is not None else None
    return {"rc": rc, "exited_s": exited, "log": log.read_text(), "sent": sent}


def _committed_after(log: str) -> list[float]:
    """The seconds from the request to the commit each process logged."""
    found = re.findall(
        rf"committed ([0-9.]+)s after the request; exiting with code {EXIT_PREEMPTED}", log
    )
    return [float(s) for s in found]


def _launch(store: Path, out: Path, *script_args: str) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "accelerate_incremental", "--dirpath", str(store),
        str(PLAIN), "--out", str(out), *script_args,
    ]  # fmt: skip


def test_launch_flag_two_processes_signalled_again_and_again_lose_no_step(
    tmp_path: Path,
) -> None:
    """Preempted twice, by signals as a cluster delivers them: the launcher (its agent forwards)
    and every process, two or three deliveries each (SIGTERM and SIGINT, seeded random order
    and rhythm), then SLURM-style (SIGUSR1 to every process, forwarded by the agent as
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` says; rank 0 requeues after the commit). Each time both
    processes stop at one step, that step commits, both exit 143; the next run resumes from
    it, and the last ends bit-identical to an uninterrupted run."""
    ref_out = tmp_path / "ref.pt"
    reference = _run(_launch(tmp_path / "ref_store", ref_out), _env({}), tmp_path / "ref.log")
    assert reference["rc"] == 0, reference["log"][-4000:]

    store, out, progress = tmp_path / "store", tmp_path / "out.pt", tmp_path / "progress"
    cmd = _launch(store, out, "--slow", "0.3", "--progress", str(progress))
    slurm, calls = deliveries.slurm_env(tmp_path)
    previous, report = 0, []
    for name, after, seed, signals, extra in [
        ("storm", 4, 21, (signal.SIGTERM, signal.SIGINT), {}),
        ("slurm", 3, 22, (signal.SIGUSR1,), slurm),
    ]:

        def storm(proc: subprocess.Popen, seed: int = seed, signals: Any = signals) -> list[str]:
            return deliveries.deliver(proc, PLAIN.name, seed, signals=signals)

        run = _run(
            cmd, _env(extra), tmp_path / f"{name}.log", progress=progress,
            after=previous + after, storm=storm,
        )  # fmt: skip
        text = run["log"]
        why = "\n".join(run["sent"]) + "\n" + text[-6000:]
        assert run["exited_s"] is not None, "the run ended before it could be signalled"
        assert not out.exists(), why
        if previous:
            assert f"starting at global step {previous}" in text, why
        stopped = [_steps(progress, r)[-1] for r in range(2)]
        assert stopped[0] == stopped[1] >= previous + after, f"stopped at {stopped}\n{why}"
        with CheckpointStore(str(store)) as reader:
            newest = reader.steps()[-1]
            state = reader.load(newest, map_location="cpu")
        assert state["custom"][0]["step"] == stopped[0], (newest, state["custom"], why)
        done = f"preempted: checkpoint {newest} (accelerator.save_state) committed"
        assert text.count(done) == 2 == len(_committed_after(text)), why  # both processes
        report.append(f"{name}: step {stopped[0]} {_committed_after(text)} s after the request")
        previous = stopped[0]
    assert calls.read_text().split() == ["requeue", "4711"], "rank 0 requeues, once"

    final = _run(cmd, _env({}), tmp_path / "final.log")
    assert final["rc"] == 0, final["log"][-4000:]
    assert final["log"].count("JOB DONE") == 2
    assert f"starting at global step {previous}" in final["log"]
    resumed = torch.load(out, weights_only=False)
    assert resumed["step"] == 15
    assert_identical(torch.load(ref_out, weights_only=False), resumed)
    print("\n2 processes (launch flag): " + "; ".join(report))


def test_api_one_process_a_sigterm_costs_no_step(tmp_path: Path) -> None:
    cmd = [sys.executable, str(API)]
    ref_env = {"JOB_MODE": "api", "JOB_STORE": str(tmp_path / "ref_store")}
    reference = _run(cmd, _env({**ref_env, "JOB_OUT": str(tmp_path / "ref.pt")}), tmp_path / "r")
    assert reference["rc"] == 0, reference["log"][-4000:]

    store, out, progress = tmp_path / "store", tmp_path / "out.pt", tmp_path / "progress"
    env = _env(
        {
            "JOB_MODE": "api",
            "JOB_STORE": str(store),
            "JOB_OUT": str(out),
            "JOB_PROGRESS": str(progress),
            "JOB_SLOW": "0.2",
        }
    )
    first = _run(cmd, env, tmp_path / "first.log", progress=progress)
    assert first["rc"] == EXIT_PREEMPTED, first["log"][-4000:]
    assert not out.exists()
    stopped = _steps(progress, 0)[-1]
    with CheckpointStore(str(store)) as reader:
        committed = reader.steps()[-1]
    assert committed == stopped >= SIGNAL_AFTER_STEP, (committed, stopped)
    assert f"preempted: step {committed} committed" in first["log"], first["log"][-4000:]

    second = _run(cmd, env, tmp_path / "second.log")
    assert second["rc"] == 0, second["log"][-4000:]
    resumed = torch.load(out, weights_only=False)
    assert resumed["resumed"] == committed
    assert resumed["step"] == 30
    assert_identical(torch.load(tmp_path / "ref.pt", weights_only=False), resumed)
    print(
        f"\n1 process (API): SIGTERM after step {SIGNAL_AFTER_STEP}, stopped and committed at "
        f"step {committed} {_committed_after(first['log'])} s after the request, exited "
        f"{first['exited_s']:.1f}s after the signal"
    )
