"""``IncrementalCheckpointer(fork_from="SRC[@STEP]")``: the main process forks the source's step
into the checkpointer's store before any process opens it (:func:`~lightning_incremental.runtime.
fork.ensure_fork`); every process learns the outcome, and :meth:`load` then finds the forked step.

With ``fork_weights_only=True`` the step becomes the store's delta base, not a step of it: while
the store holds no checkpoint of its own, :meth:`load` puts the step's model weights (``models``)
from the source into the prepared models and restores nothing else (the run starts at step 0
with its own optimizer, schedulers and counters); its checkpoints are deltas of those weights.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from accelerate_incremental import _compat
from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.cluster.coordinate import coordinated
from lightning_incremental.runtime.session.fork import check_source, ensure_fork, forked_weights


class WeightsFrom(NamedTuple):
    """A fork of weights only: the store it was made into, whose source step holds the weights
    the run starts from."""

    dirpath: str
    storage_options: dict[str, Any] | None

    def load(self, key: str) -> Any:
        """The source step's top-level ``key`` (the model's weights), on the CPU."""
        return forked_weights(self.dirpath, key, self.storage_options)


def before_open(
    is_main_process: bool,
    dirpath: str,
    fork_from: Any,
    storage_options: dict[str, Any] | None,
    weights_only: Any = False,
) -> WeightsFrom | None:
    """Fork into ``dirpath`` on the main process when ``fork_from`` is set (a collective);
    returns where a fork of weights only reads its weights, else None."""
    source = check_source(fork_from, weights_only=weights_only)
    if source is None:
        return None
    coordinated(
        lambda: ensure_fork(str(dirpath), source, storage_options, weights_only=weights_only),
        what=f"fork {source} into {dirpath}",
        is_coordinator=is_main_process,
    )
    return WeightsFrom(str(dirpath), storage_options) if weights_only else None


def start(
    accelerator: Any,
    dirpath: str,
    options: dict[str, Any] | None,
    fork_from: Any,
    weights_only: Any,
) -> WeightsFrom | None:
    """:func:`before_open` for :class:`~accelerate_incremental.IncrementalCheckpointer`."""
    return before_open(accelerator.is_main_process, dirpath, fork_from, options, weights_only)


def load_weights(accelerator: Any, fork: WeightsFrom | None, *, sharded: bool) -> None:
    """A fork of weights only whose store holds no checkpoint: every process loads the forked
    step's model weights from the source into the prepared models (nothing else)."""
    if fork is None:
        return
    if sharded:
        raise ConfigError(
            "fork_weights_only=True is not supported under FSDP yet; fork the whole checkpoint"
        )
    saved = fork.load("models")
    models = list(_compat.models(accelerator))
    if len(saved) != len(models):
        raise ConfigError(
            f"the step forked into {fork.dirpath} holds {len(saved)} models, this run prepared "
            f"{len(models)}"
        )
    for model, weights in zip(models, saved, strict=True):
        accelerator.unwrap_model(model).load_state_dict(weights)
