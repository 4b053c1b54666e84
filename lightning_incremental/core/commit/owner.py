"""Who holds a lease: the job (by its launcher's id, the same across restarts) and the machine
(host name, boot id and pid namespace), so that a record's pid is checked only where it means
this very process."""

from __future__ import annotations

import os
import socket
from typing import Any


def job_id() -> str | None:
    """The launcher's id of this job, the same across its restarts; None when unknown.

    torchrun's rendezvous id (a fresh uuid per single-node or ``--standalone`` job); a static
    multi-node torchrun job, whose id is ``"none"``, by its fixed master endpoint (two jobs
    cannot listen on one); a SLURM job by its job id (kept when it is requeued). Under SLURM the
    job step is part of the id (``slurm:4711.0``; the batch script, which has no step id, is
    ``slurm:4711``): the steps of one allocation share its job id, and two steps writing one
    store are two jobs. torchrun's id gets the step too, as it is often the SLURM job id
    (``--rdzv-id $SLURM_JOB_ID``). A requeued job is known by :func:`job_requeue`.
    """
    step = _slurm_step()
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run not in ("", "none"):
        return f"{run}{step}"
    slurm = os.environ.get("SLURM_JOB_ID", "")
    if slurm:
        return f"slurm:{slurm}{step}"
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if run == "none" and addr and port:
        return f"torchrun:{addr}:{port}{step}"
    return None


def job_requeue() -> tuple[str, int] | None:
    """This SLURM job's id and how often it was requeued (``SLURM_RESTART_COUNT``); None outside
    SLURM.

    A requeued job runs again under its job id with its steps numbered afresh, after SLURM ended
    every process of the previous run: a holder of the same job id with a lower count is a
    previous run of this very job, whichever its step.
    """
    slurm = os.environ.get("SLURM_JOB_ID", "")
    if not slurm:
        return None
    count = os.environ.get("SLURM_RESTART_COUNT", "0")
    return f"slurm:{slurm}", int(count) if count.isdigit() else 0


def _slurm_step() -> str:
    """``.<step id>`` inside a SLURM job step, else empty."""
    if not os.environ.get("SLURM_JOB_ID"):
        return ""
    step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID") or ""
    return f".{step}" if step else ""


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> str | None:
    """This boot of this host (Linux): with the host name and the pid namespace it says that a
    record's pid is a process of this very machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def same_machine(doc: dict[str, Any]) -> bool:
    """Whether the lease record ``doc`` was written on this machine, in this pid namespace
    (a record without a boot id, or on a host without one, never is: its pid cannot be
    checked here)."""
    boot = boot_id()
    return (
        boot is not None
        and doc.get("boot") == boot
        and doc.get("host") == socket.gethostname()
        and doc.get("pidns") == pid_namespace()
    )


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True
