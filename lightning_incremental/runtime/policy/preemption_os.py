"""The operating-system side of preemption: the watcher thread a signal handler wakes (without a
lock or an allocation) and SLURM's requeue, run after the last checkpoint commits."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("lightning_incremental")


class _Watcher:
    """The named daemon thread that does, outside the signal handler, what a delivery calls for:
    it logs it and starts the grace's countdown. The handler wakes it by writing one byte to a
    non-blocking pipe — no lock, no allocation of a thread, nothing that can wait."""

    def __init__(self, noticed: Callable[[], None]) -> None:
        self._noticed = noticed
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="li-preemption", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """From the signal handler: a write that never blocks (a full pipe is awake already)."""
        try:
            os.write(self._write, b"\0")
        except OSError:  # full (BlockingIOError) or closed: nothing to add
            pass

    def _run(self) -> None:
        while True:
            try:
                os.read(self._read, 512)
            except OSError:
                return
            if self._stopping:
                return
            self._noticed()

    def stop(self) -> None:
        self._stopping = True
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if not self._thread.is_alive():
            os.close(self._read)
        os.close(self._write)


def requeue_slurm_job(environ: Mapping[str, str] | None = None) -> bool:
    """``scontrol requeue`` this SLURM job (an array task by its array job and task id); whether
    it succeeded. Never raises: a failed requeue is logged, the checkpoint is committed anyway."""
    env = os.environ if environ is None else environ
    array = env.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{env.get('SLURM_ARRAY_TASK_ID')}" if array else env.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job or ""):
        log.warning("not requeueing: no SLURM job id in the environment")
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not requeue SLURM job %s: %s", job, exc)
        return False
    if result.returncode != 0:
        log.warning("scontrol requeue %s failed with exit code %d", job, result.returncode)
        return False
    log.info("requeued SLURM job %s", job)
    return True
