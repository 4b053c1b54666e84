"""A process's global random state (torch, CUDA, numpy, Python) as plain checkpoint data.

Framework-free: every adapter uses it to save and restore each rank's random streams, so that a
resumed run draws the same dropout masks, augmentations and shuffles as an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The global random state of torch (CPU and, when initialised, every CUDA device), numpy's
    legacy global generator and Python's ``random`` module. Every value is plain data (tensors,
    arrays, ints, floats, tuples) that a checkpoint store holds without pickling."""
    return {**capture_torch(), "numpy": np.random.get_state(), "python": random.getstate()}


def capture_torch() -> dict[str, Any]:
    """The global random state of torch alone: ``"torch"`` (the CPU generator) and, when CUDA is
    initialised, ``"cuda"`` (every device's generator)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_torch(state: dict[str, Any]) -> None:
    """Make ``state`` (holding :func:`capture_torch`'s keys) torch's global random state; the
    CUDA generators only where ``state`` holds them and CUDA is available."""
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def restore(state: dict[str, Any]) -> None:
    """Make ``state`` (from :func:`capture`, possibly through a checkpoint) the global random
    state of this process.

    Raises:
        ValueError: ``state`` is not a captured random state.
    """
    try:
        torch_state = state["torch"]
        numpy_state = state["numpy"]
        python_state = state["python"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a captured random state (missing {exc})") from exc
    restore_torch({"torch": torch_state, "cuda": state.get("cuda")})
    np.random.set_state(tuple(numpy_state))
    version, internal, gauss = python_state
    random.setstate((version, tuple(internal), gauss))


def same_generator_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two ``torch.Generator.get_state()`` values are the same state."""
    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
