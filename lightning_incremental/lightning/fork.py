"""``IncrementalCheckpoint(fork_from="SRC[@STEP]")``: global rank 0 forks the source's step into
the run's store at setup, before any rank opens it
(:func:`~lightning_incremental.runtime.session.fork.ensure_fork`); every rank learns the outcome,
and the resume that follows loads the forked step.

With ``fork_weights_only=True`` the step becomes the store's delta base instead of a step of it:
while the store holds no checkpoint of its own, every rank loads the step's model weights
(``state_dict``) from the source into the module and the run starts at step 0, with a fresh
optimizer and loops; its first checkpoint references the weights that did not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.cluster.coordinate import coordinated
from lightning_incremental.runtime.session.fork import (
    check_source,
    ensure_fork,
    forked_weights,
    split_step,
)


@dataclass(frozen=True)
class ForkOptions:
    source: str | None  # "SRC[@STEP]"
    weights_only: bool = False


def options(fork_from: Any, weights_only: Any, *, resume: bool) -> ForkOptions:
    return ForkOptions(
        check_source(fork_from, resume=resume, weights_only=weights_only), weights_only
    )


def before_open(
    trainer: pl.Trainer, url: str, fork: ForkOptions, storage_options: dict[str, Any] | None
) -> None:
    """Fork into ``url`` on global rank 0 when ``fork_from`` is set (a collective)."""
    source = fork.source
    if source is None:
        return
    coordinated(
        lambda: ensure_fork(url, source, storage_options, weights_only=fork.weights_only),
        what=f"fork {source} into {url}",
        is_coordinator=trainer.is_global_zero,
        broadcast=trainer.strategy.broadcast,
    )


def load_weights(
    module: pl.LightningModule,
    url: str,
    fork: ForkOptions,
    newest: int | None,
    storage_options: dict[str, Any] | None,
    *,
    sharded: bool,
) -> None:
    """A fork of weights only whose store holds no checkpoint yet (``newest`` is None): load the
    forked step's ``state_dict`` from the source into ``module`` (every rank, before the
    strategy wraps it)."""
    if fork.source is None or not fork.weights_only or newest is not None:
        return
    if sharded:
        raise ConfigError(
            "fork_weights_only=True is not supported under sharded strategies (FSDP, "
            "ModelParallelStrategy) yet; fork the whole checkpoint, or load the weights from "
            f"{split_step(fork.source)[0]} yourself with CheckpointStore.load(keys='state_dict')"
        )
    weights = forked_weights(url, "state_dict", storage_options)
    module.load_state_dict(weights, strict=module.strict_loading)
