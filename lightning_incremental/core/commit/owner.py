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
    cannot listen on one); a SLURM job by its job id (kept when it is requeued).
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run not in ("", "none"):
        return run
    slurm = os.environ.get("SLURM_JOB_ID", "")
    if slurm:
        return f"slurm:{slurm}"
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if run == "none" and addr and port:
        return f"torchrun:{addr}:{port}"
    return None


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
