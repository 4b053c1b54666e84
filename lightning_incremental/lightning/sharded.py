"""Sharded strategies: what the adapters save and restore when the model and optimizer state
are split over the ranks.

Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallel) and
``FSDPStrategy`` (FSDP1) hold each rank's shards only. There IncrementalCheckpoint saves the
*sharded* state dicts of ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=False``) through a store opened on every
rank with ``distributed=True``: each rank writes its own pieces, rank 0 the plain values and the
one manifest. Nothing is gathered to one rank, whichever ``save_distributed_checkpoint`` /
``state_dict_type`` the strategy was given (those choose how the strategy's *own* checkpoints
are written). A resume fills the live shards in place from the overlapping stored pieces (any
number of ranks) and sets them with ``set_model_state_dict`` / ``set_optimizer_state_dict``:
these strategies restore after ``setup`` and their own ``load_model_state_dict`` /
``load_optimizer_state_dict`` do nothing.

:func:`layout` sorts a strategy into ``REPLICATED`` (every rank holds the whole state: single
device, DDP, DataParallel), ``SHARDED`` (the two above) or refuses it with the reason.

IncrementalCheckpointIO and these strategies
--------------------------------------------
Lightning calls a ``CheckpointIO`` only from strategies that save one full checkpoint on global
rank 0: single device, DDP (all its launchers, ``ddp_spawn`` included) and similar. Lightning
gives a ``CheckpointIO`` no setup hook, so it cannot see the strategy; these are *not* covered:

- ``DeepSpeedStrategy``: saves and loads with DeepSpeed's own checkpointing, never calling the
  plug-in (its checkpoints stay DeepSpeed directories);
- ``FSDPStrategy``/``ModelParallelStrategy`` with sharded state (their default): the same, with
  ``torch.distributed.checkpoint``;
- ``FSDPStrategy(state_dict_type="full")`` / ``ModelParallelStrategy(save_distributed_checkpoint
  =False)``: gathers the whole state to rank 0 and saves it through the plug-in (a complete
  checkpoint, saved as any other), but loads paths itself with ``torch.load(path, mmap=True)``,
  which fails on a pointer file ("mmap can only be used with files saved with torch.save").

The plug-in warns where it can tell: at the first save a full-state sharded strategy makes
through it (``materialize`` makes the best/last files plain ones when ``fit`` ends), and at the
end of a ``fit`` under ``FSDPStrategy`` that saved nothing through it
(``ModelParallelStrategy`` does not even call a CheckpointIO's ``teardown``, so nothing tells
the plug-in there). See :mod:`lightning_incremental.lightning.sharded`.

The ``IncrementalCheckpoint`` callback covers these strategies where it can.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy

from lightning_incremental.core import ConfigError
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning.compat import raw_optimizer

REPLICATED = "replicated"
SHARDED = "sharded"

_SUPPORTED = (
    "Supported: single-device, DDP (ddp, ddp_spawn, ddp_fork, ddp_notebook), DataParallel, "
    "ModelParallelStrategy (FSDP2 / tensor parallel) and FSDPStrategy."
)


def layout(strategy: Strategy) -> str:
    """``REPLICATED`` or ``SHARDED``: how ``strategy`` holds the training state.

    Raises:
        ConfigError: a strategy that saves and restores its state itself in a way
            IncrementalCheckpoint cannot take part in (DeepSpeed: its engine owns the sharded
            optimizer and writes its own files; XLA FSDP; any other strategy that restores
            after setup), naming it.
    """
    if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
        return SHARDED
    if strategy.restore_checkpoint_after_setup or not strategy.lightning_restore_optimizer:
        name = type(strategy).__name__
        why = (
            "DeepSpeed's engine owns the partitioned optimizer state and saves and loads it "
            "itself (its own files per rank), outside of the state dicts IncrementalCheckpoint "
            "saves"
            if "DeepSpeed" in name
            else "it saves and restores the model or optimizer state itself, after setup, in a "
            "way IncrementalCheckpoint cannot take part in"
        )
        raise ConfigError(f"IncrementalCheckpoint does not support {name}: {why}. {_SUPPORTED}")
    return REPLICATED


def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, strict=strict)


def _model(trainer: pl.Trainer) -> Any:
    model = trainer.strategy.model  # the wrapped module (FSDP1) or the LightningModule
    assert model is not None
    return model


def model_state(trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's sharded model state dict (DTensors / ShardedTensors sharing the live
    parameters' memory; the engine copies them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(_model(trainer), options=_options())


def optimizer_state(trainer: pl.Trainer, optimizer: Any) -> dict[str, Any]:
    """This rank's sharded state dict of ``optimizer`` (keyed by parameter names). A fresh
    optimizer's state is created first (torch's ``_init_optim_state``), so that a resume has
    tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_model(trainer), raw_optimizer(optimizer), options=_options())


def dump_checkpoint(trainer: pl.Trainer, sharded: bool) -> dict[str, Any]:
    """The trainer's checkpoint dump; ``sharded``, with this rank's sharded state dicts in place
    of the strategy's (which may gather the whole state to rank 0)."""
    if not sharded:
        return _compat.dump_checkpoint(trainer)
    return _compat.dump_checkpoint(
        trainer,
        model_state=lambda: model_state(trainer),
        optimizer_state=lambda optimizer: optimizer_state(trainer, optimizer),
    )


def live_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The sharded tensors a resume fills in place, under the keys Lightning's checkpoint
    uses (``state_dict``, ``optimizer_states``). Every rank calls it (FSDP1's optimizer state
    dict is a collective)."""
    return {
        "state_dict": model_state(trainer),
        "optimizer_states": [optimizer_state(trainer, opt) for opt in trainer.optimizers],
    }


def apply(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Set the model's and the optimizers' state from ``checkpoint`` (loaded into
    :func:`live_state`'s tensors), as the strategy's own ``load_checkpoint`` would. Every rank
    calls it.

    Raises:
        ConfigError: the checkpoint holds another number of optimizers than the trainer.
        RuntimeError: torch's, for keys that do not match (with ``strict_loading``).
    """
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _model(trainer)
    strict = bool(getattr(trainer.lightning_module, "strict_loading", True))
    set_model_state_dict(model, checkpoint["state_dict"], options=_options(strict))
    saved = checkpoint.get("optimizer_states", [])
    if len(saved) != len(trainer.optimizers):
        raise ConfigError(
            f"the checkpoint holds {len(saved)} optimizer states and the trainer has "
            f"{len(trainer.optimizers)} optimizers"
        )
    for optimizer, state in zip(trainer.optimizers, saved):
        set_optimizer_state_dict(model, raw_optimizer(optimizer), state, options=_options(strict))


# --- IncrementalCheckpointIO under these strategies ---------------------------------------------
#
# Lightning routes a sharded strategy's checkpoints through a CheckpointIO only in full-state
# mode: ``ModelParallelStrategy(save_distributed_checkpoint=False)`` and
# ``FSDPStrategy(state_dict_type="full")`` gather the whole state to rank 0, which calls
# ``checkpoint_io.save_checkpoint`` (one full checkpoint: the plug-in saves it as any other).
# Their ``load_checkpoint`` reads the path itself (``torch.load(path, mmap=True)`` of a file,
# or ``torch.distributed.checkpoint`` of a directory), never through the CheckpointIO, so a
# pointer file cannot be resumed from. In sharded mode (their default) every rank saves with
# ``torch.distributed.checkpoint`` and the plug-in is never called: no hook tells it (and
# ``ModelParallelStrategy.teardown`` does not even call its ``teardown``).

_USE_CALLBACK = (
    "For incremental checkpoints of sharded training use the IncrementalCheckpoint callback, "
    "which saves every rank's shards through the engine and resumes from them."
)


def plugin_save_warning(strategy: Strategy, materialize: tuple[str, ...]) -> str | None:
    """Why a checkpoint ``strategy`` saves through IncrementalCheckpointIO cannot be resumed
    from with ``fit(ckpt_path=...)`` as it stands; None when it can."""
    if not isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
        return None
    name = type(strategy).__name__
    files = (
        f"only the files materialize={materialize!r} rewrites when fit ends are plain files it "
        "can read"
        if materialize
        else "pass materialize='last' (or 'best', True) to have those files rewritten as plain "
        "torch.save files when fit ends"
    )
    return (
        f"IncrementalCheckpointIO under {name}: its full-state mode gathers the whole state to "
        "rank 0 and saves it through this plug-in (a complete checkpoint, saved incrementally), "
        f"but {name} loads checkpoint paths itself with torch.load, not through the "
        "CheckpointIO, so fit(ckpt_path=<pointer file>) fails on the pointer files written "
        f"here; {files}. lightning_incremental.load_from_checkpoint and the CLI's export read "
        f"them. {_USE_CALLBACK}"
    )


def plugin_unused_warning(strategy: Strategy) -> str:
    """What to tell a user whose IncrementalCheckpointIO ``strategy`` bypassed."""
    return (
        f"IncrementalCheckpointIO saved nothing during this fit: {type(strategy).__name__} "
        "saves sharded checkpoints with torch.distributed.checkpoint on every rank and never "
        f"calls a CheckpointIO. {_USE_CALLBACK}"
    )


def bypasses_checkpoint_io(strategy: Strategy) -> bool:
    """Whether ``strategy`` may save without calling its CheckpointIO (sharded mode)."""
    return isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))
