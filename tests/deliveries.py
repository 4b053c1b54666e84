"""Signals delivered as a cluster delivers them, to a launcher and its workers.

SLURM's ``scancel``, a preemption or a time limit signal every process of a job step (the
``torchrun`` agent and its workers); the agent then forwards the signal to its workers again, and
a wrapper may forward once more. :func:`deliver` reproduces that from a seed: the launcher gets
one signal (which it forwards), each worker one or two more of its own, in a shuffled order with
a small random delay between any two, so that a delivery lands anywhere — inside a collective, a
save, a validation, between the agreement and the commit.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class Delivery:
    target: str  # "launcher" or "worker <pid>"
    signum: int
    after_s: float  # the delay before it

    def __str__(self) -> str:
        return f"+{self.after_s:.2f}s {signal.Signals(self.signum).name} to {self.target}"


def workers(launcher: subprocess.Popen, script: str) -> list[int]:
    """The pids of the launcher's processes that run ``script`` (the training processes)."""
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if any(script in part for part in child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(found)


def plan(
    seed: int,
    worker_pids: list[int],
    *,
    launcher: int | None,
    signals: tuple[int, ...],
    max_delay_s: float = 0.25,
) -> list[tuple[int, Delivery]]:
    """What :func:`deliver` sends, as ``(pid, delivery)``: one signal to the launcher (its
    first: the one it forwards), one or two to each worker, shuffled, each after a delay of up
    to ``max_delay_s``; the first delivery without delay."""
    rng = random.Random(seed)
    sends: list[tuple[int, str, int]] = []
    if launcher is not None:
        sends.append((launcher, "launcher", signals[0]))
    for pid in worker_pids:
        for _ in range(rng.choice((1, 2))):
            sends.append((pid, f"worker {pid}", rng.choice(signals)))
    rng.shuffle(sends)
    return [
        (pid, Delivery(target, signum, 0.0 if i == 0 else rng.uniform(0.0, max_delay_s)))
        for i, (pid, target, signum) in enumerate(sends)
    ]


def deliver(
    launcher: subprocess.Popen,
    script: str,
    seed: int,
    *,
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    to_launcher: bool = True,
) -> list[str]:
    """Send :func:`plan`'s signals; returns what was sent, for the test's messages (a process
    that already ended is skipped)."""
    pids = workers(launcher, script)
    assert pids, "no training process found under the launcher"
    sent = []
    for pid, delivery in plan(
        seed, pids, launcher=launcher.pid if to_launcher else None, signals=signals
    ):
        time.sleep(delivery.after_s)
        try:
            os.kill(pid, delivery.signum)
        except ProcessLookupError:
            sent.append(f"{delivery} (already ended)")
            continue
        sent.append(str(delivery))
    return sent


def slurm_env(tmp: Path) -> tuple[dict[str, str], Path]:
    """The environment of a SLURM-style run — a job id (SIGUSR1 is then a preemption signal, and
    a requeue is asked for), the launcher's agent forwarding SIGUSR1 too
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``), a fake ``scontrol`` first on PATH — and the file that
    records its calls."""
    calls = tmp / "scontrol.calls"
    script = tmp / "bin" / "scontrol"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(0o755)
    env = {
        "SLURM_JOB_ID": "4711",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "PATH": f"{script.parent}{os.pathsep}{os.environ['PATH']}",
    }
    return env, calls
