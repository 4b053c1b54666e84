"""The checks and conversions :class:`~.callback.IncrementalCheckpoint` makes around a ``fit``:
its arguments as a :class:`~lightning_incremental.core.StoreConfig`, a directory shared with a
ModelCheckpoint, LightningModule hooks that run after the checkpoint, and what data-parallel
replicas must hold identically."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_incremental.core import ConfigError, StoreConfig


def replicated_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What data-parallel replicas must hold identically: the parameters and the optimizers'
    state. Not the buffers: under DDP each rank updates running statistics (BatchNorm) from its
    own batch, and DDP broadcasts rank 0's at the next forward, so they legitimately differ.
    The tensors share storage with the live ones (a repair writes into them)."""
    module = trainer.lightning_module
    return {
        "model": {name: p.detach() for name, p in module.named_parameters()},
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
    }


def callbacks_of(trainer: pl.Trainer) -> list[Callback]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return callbacks


def store_config(
    keep_last: int | None,
    full_every: int | None,
    max_chain: int | None,
    allow_pickle: bool,
    store_options: dict[str, Any] | None,
    optimizer_state: str = "exact",
) -> StoreConfig:
    """The engine's configuration from the callback's arguments (validated by StoreConfig)."""
    if store_options is not None and not isinstance(store_options, dict):
        raise TypeError(f"store_options must be a dict, got {type(store_options).__name__}")
    options = dict(store_options or {})
    named = {"keep_last": keep_last, "full_every": full_every, "max_chain": max_chain}
    repeated = sorted(k for k, v in named.items() if v is not None and k in options)
    repeated += [k for k in ("allow_pickle", "optimizer_state") if k in options]
    if repeated:
        raise ConfigError(
            f"store_options repeats {', '.join(repeated)}: pass it as an argument of "
            "IncrementalCheckpoint"
        )
    options.update({k: v for k, v in named.items() if v is not None})
    return StoreConfig().replace(
        allow_pickle=allow_pickle, optimizer_state=optimizer_state, **options
    )


def local_path(url: str) -> str | None:
    """A local path's canonical form; None for remote URLs."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        return None
    return os.path.realpath(os.path.expanduser(url))


def warn_late_module_hooks(pl_module: pl.LightningModule) -> None:
    """Lightning calls a LightningModule's ``on_train_batch_end`` / ``on_validation_end`` after
    the callbacks' hooks of the same event: what they change at a checkpointed step is not in
    that checkpoint, and a resume does not replay them."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    late = [h for h in ("on_train_batch_end", "on_validation_end") if is_overridden(h, pl_module)]
    if late:
        rank_zero_warn(
            f"{type(pl_module).__name__} overrides {' and '.join(late)}, which Lightning runs "
            "after IncrementalCheckpoint has taken the checkpoint of that step: state changed "
            "there (e.g. an EMA, a counter, random draws) is not in the checkpoint, so a resume "
            "is not bit-exact for it. Move that work into training_step, or into a Callback "
            "(callbacks run before IncrementalCheckpoint).",
            category=PossibleUserWarning,
        )


def check_model_checkpoints(trainer: pl.Trainer, url: str) -> None:
    """Raises ConfigError when a ModelCheckpoint of ``trainer`` writes into the store ``url``."""
    mine = local_path(url)
    for cb in callbacks_of(trainer):
        # getattr: dirpath is set per instance, and a Mock(spec=ModelCheckpoint) has none
        theirs = getattr(cb, "dirpath", None) if isinstance(cb, ModelCheckpoint) else None
        if theirs and mine is not None and local_path(os.fspath(theirs)) == mine:
            raise ConfigError(
                f"IncrementalCheckpoint and ModelCheckpoint share the directory {mine}: "
                "ModelCheckpoint writes plain .ckpt files there, which the incremental "
                "store does not manage. Give them different directories."
            )


def dirpath(value: object) -> str | None:
    """The callback's ``dirpath``: a path or URL string, or None for the default location."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"dirpath must be a path or URL string, got {type(value).__name__}")
    path = os.fspath(value)
    if not path:
        raise ConfigError("dirpath must not be empty; pass None for the default location")
    return str(path)


def flags(**values: object) -> None:
    for name, flag in values.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")


def storage_options(value: object) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"storage_options must be a dict, got {type(value).__name__}")
    return value


def reachable_by_every_rank(url: str, world_size: int) -> None:
    if world_size > 1 and url.startswith("memory://"):
        raise ConfigError(
            f"dirpath {url} is in-process memory, which other ranks cannot read: "
            "use a path or URL every rank can reach"
        )


def fresh_unless_resuming(url: str, newest: int | None, *, resume: bool) -> None:
    if not resume and newest is not None:
        raise ConfigError(
            f"IncrementalCheckpoint(resume=False) but {url} already holds checkpoints "
            f"(newest: step {newest}); a new run cannot write steps it already holds. "
            "Use an empty dirpath for a new run, or resume=True to continue that one."
        )
