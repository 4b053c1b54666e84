"""What IncrementalCheckpointIO reads of the Trainer, which Lightning does not hand to a
``CheckpointIO``: whether a stage is running when ``Trainer.save_checkpoint`` is called, and
ModelCheckpoint's best/last paths as recorded in the checkpoint dict it saves."""

from __future__ import annotations

import sys
from typing import Any

#: The ModelCheckpoint paths that can be materialized: ``<kind>_model_path``.
MATERIALIZE = ("best", "last")


def marks_of(checkpoint: Any) -> dict[str, dict[str, str]]:
    """ModelCheckpoint's ``best_model_path`` / ``last_model_path`` in a Lightning checkpoint
    dict (its ``callbacks`` section), per callback state key."""
    callbacks = checkpoint.get("callbacks") if isinstance(checkpoint, dict) else None
    found: dict[str, dict[str, str]] = {}
    if not isinstance(callbacks, dict):
        return found
    for key, value in callbacks.items():
        if not isinstance(value, dict):
            continue
        paths = {
            kind: value[f"{kind}_model_path"]
            for kind in MATERIALIZE
            if isinstance(value.get(f"{kind}_model_path"), str) and value[f"{kind}_model_path"]
        }
        if paths:
            found[str(key)] = paths
    return found


def trainer_stage_running() -> bool | None:
    """Whether the ``Trainer.save_checkpoint`` call this save comes from happens while the
    trainer runs ``fit/validate/test/predict``; None when the save does not come from
    ``Trainer.save_checkpoint`` (a direct call, a strategy's launcher).

    Lightning gives a ``CheckpointIO`` no view of the trainer, so the call's own frame is read:
    the innermost ``Trainer.save_checkpoint`` frame on this thread's stack and its ``self``.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import TrainerStatus

    code = Trainer.save_checkpoint.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, Trainer):
                return bool(trainer.state.status == TrainerStatus.RUNNING)
        frame = frame.f_back  # type: ignore[assignment]
    return None
