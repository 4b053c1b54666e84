"""``IncrementalCheckpointer(fork_from="SRC[@STEP]")``: the main process forks the source's step
into the checkpointer's store before any process opens it (:func:`~lightning_incremental.runtime.
fork.ensure_fork`); every process learns the outcome, and :meth:`load` then finds the forked step.

With ``fork_weights_only=True`` the step becomes the store's delta base, not a step of it: while
the store holds no checkpoint of its own, :meth:`load` puts the step's model weights (``models``)
from the source into the prepared models and restores nothing else (the run starts at step 0
with its own optimizer, schedulers and counters); its checkpoints are deltas of those weights.
"""

from __future__ import annotations

from typing import Any

from accelerate_incremental import _compat
from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.core.maintain.pool import open_location, read_links
from lightning_incremental.runtime.coordinate import coordinated
from lightning_incremental.runtime.fork import check_source, ensure_fork


def before_open(
    is_main_process: bool,
    dirpath: str,
    fork_from: Any,
    storage_options: dict[str, Any] | None,
    weights_only: Any = False,
) -> tuple[str, dict[str, Any] | None] | None:
    """Fork into ``dirpath`` on the main process when ``fork_from`` is set (a collective);
    returns what :func:`load_weights` needs for a fork of weights only, else None."""
    if not isinstance(weights_only, bool):
        raise TypeError(f"fork_weights_only must be a bool, got {weights_only!r}")
    source = check_source(fork_from)
    if source is None:
        if weights_only:
            raise ConfigError("fork_weights_only=True needs fork_from='SRC[@STEP]'")
        return None
    coordinated(
        lambda: ensure_fork(str(dirpath), source, storage_options, weights_only=weights_only),
        what=f"fork {source} into {dirpath}",
        is_coordinator=is_main_process,
    )
    return (str(dirpath), storage_options) if weights_only else None


def start(
    accelerator: Any,
    dirpath: str,
    options: dict[str, Any] | None,
    fork_from: Any,
    weights_only: Any,
) -> tuple[str, dict[str, Any] | None] | None:
    """:func:`before_open` for :class:`~accelerate_incremental.IncrementalCheckpointer`."""
    return before_open(accelerator.is_main_process, dirpath, fork_from, options, weights_only)


def source_weights(fork: tuple[str, dict[str, Any] | None], key: str) -> Any:
    """The top-level ``key`` of the step a fork of weights only was made from, read from its
    source (on the CPU)."""
    dirpath, storage_options = fork
    links = read_links(open_location(dirpath, storage_options))
    origin = links.forked_from if links is not None else None
    if not origin:
        raise ConfigError(f"{dirpath} records no fork: drop fork_weights_only")
    with CheckpointStore(origin["url"], storage_options=storage_options) as store:
        return store.load(origin["step"], keys=key, map_location="cpu")[key]


def load_weights(
    accelerator: Any, fork: tuple[str, dict[str, Any] | None] | None, *, sharded: bool
) -> None:
    """A fork of weights only whose store holds no checkpoint: every process loads the forked
    step's model weights from the source into the prepared models (nothing else)."""
    if fork is None:
        return
    if sharded:
        raise ConfigError(
            "fork_weights_only=True is not supported under FSDP yet; fork the whole checkpoint"
        )
    saved = source_weights(fork, "models")
    models = list(_compat.models(accelerator))
    if len(saved) != len(models):
        raise ConfigError(
            f"the step forked into {fork[0]} holds {len(saved)} models, this run prepared "
            f"{len(models)}"
        )
    for model, weights in zip(models, saved, strict=True):
        accelerator.unwrap_model(model).load_state_dict(weights)
