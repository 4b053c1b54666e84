"""Describe the machine and software a benchmark ran on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# A child process: wait for a shared start time, run a fixed pure-Python loop, print its seconds.
_BURN = """
import sys, time
start, n = float(sys.argv[1]), int(sys.argv[2])
while time.time() < start:
    pass
t = time.perf_counter()
s = 0
for i in range(n):
    s += i * i
print(time.perf_counter() - t)
"""


def _burn(processes: int, work: int) -> list[float]:
    start = time.time() + 0.3  # every child has started (and imported nothing) by then
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _BURN, repr(start), str(work)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    return [float(child.communicate(timeout=60)[0]) for child in children]


def parallel_scaling(work: int = 4_000_000, processes: int | None = None) -> float | None:
    """How many times one process's work ``processes`` processes (default: the CPUs available)
    get done at once: each runs the same Python loop, started together, and the figure is
    ``processes`` x the time of one alone / their mean time together. On a machine with
    that many free cores it is about ``processes``; with shared or busy cores (virtual CPUs
    whose host is loaded, other jobs) less: two vCPUs of the reference machine gave 1.2-1.5x
    on some days and 1.8-2.2x on others. Speed figures measured "on two threads" read against
    it. None where child processes cannot run."""
    if processes is None:
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        processes = len(available) if available is not None else os.cpu_count() or 1
    try:
        alone = min(_burn(1, work)[0] for _ in range(2))
        together = _burn(processes, work)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return processes * alone / (sum(together) / len(together))


def describe() -> dict[str, Any]:
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ram = _ram_bytes()
    from lightning_incremental import __version__ as li_version

    return {
        "cpu_count": os.cpu_count(),
        "cpu_available": len(affinity) if affinity is not None else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_bytes": ram,
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "numpy": _version("numpy"),
        "zstandard": _version("zstandard"),
        "xxhash": _version("xxhash"),
        "lightning": _version("lightning"),
        "accelerate": _version("accelerate"),
        "lightning_incremental": li_version,
        "git_commit": _git_commit(Path(__file__).resolve().parents[2]),
    }
