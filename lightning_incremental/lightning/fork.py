"""``IncrementalCheckpoint(fork_from="SRC[@STEP]")``: global rank 0 forks the source's step into
the run's store at setup, before any rank opens it (:func:`~lightning_incremental.runtime.fork.
ensure_fork`); every rank learns the outcome, and the resume that follows loads the forked step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_incremental.runtime.coordinate import coordinated
from lightning_incremental.runtime.fork import ensure_fork


def before_open(
    trainer: pl.Trainer, url: str, fork_from: str | None, storage_options: dict[str, Any] | None
) -> None:
    """Fork into ``url`` on global rank 0 when ``fork_from`` is set (a collective)."""
    if fork_from is None:
        return
    coordinated(
        lambda: ensure_fork(url, fork_from, storage_options),
        what=f"fork {fork_from} into {url}",
        is_coordinator=trainer.is_global_zero,
        broadcast=trainer.strategy.broadcast,
    )
