"""Describe the machine and software a benchmark ran on."""

from __future__ import annotations

import os
import platform
import subprocess
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
        "git_commit": _git_commit(Path(__file__).resolve().parent.parent),
    }
