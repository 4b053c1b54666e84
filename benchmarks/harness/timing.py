"""Timing helpers the benchmarks share: the best of repeated calls, and the plain checkpoint
(``torch.save`` + fsync) their figures are ratios to."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (robust to other load on the machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def torch_save(state: Any, path: Path) -> float:
    """Seconds of ``torch.save`` of ``state`` into ``path`` and its ``fsync``: a plain
    checkpoint, durable."""
    start = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - start
