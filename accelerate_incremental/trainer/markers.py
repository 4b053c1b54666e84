"""The marker a ``checkpoint-N`` folder holds when its checkpoint lives in the incremental store.

A Trainer checkpoint saved through the store leaves a small folder behind: the Trainer's own
``trainer_state.json`` (which ``train(resume_from_checkpoint=...)``, ``save_total_limit`` rotation
and ``best_model_checkpoint`` read, as ever) and :data:`NAME`, a JSON record naming the store and
the step whose weights, optimizer, scheduler, scaler and random states it holds. A folder without
the record is a checkpoint the Trainer wrote itself, loaded the Trainer's way.

The record is written when the save starts, before its commit: the store, not the record, says
whether the checkpoint exists (see :mod:`accelerate_incremental.trainer.checkpointer`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

NAME = "incremental_checkpoint.json"
FORMAT = "accelerate_incremental.trainer_marker/1"


@dataclass(frozen=True)
class Marker:
    """A ``checkpoint-N`` folder's record: the checkpoint is step ``step`` of the store ``store``
    (its URL as the store prints it)."""

    folder: str
    store: str
    step: int


def read(folder: str | os.PathLike[str]) -> Marker | None:
    """The record of ``folder``; None when it has none (a checkpoint the Trainer wrote itself, or
    no folder).

    Raises:
        ValueError: the record exists but is not one (naming the file).
    """
    path = os.path.join(folder, NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
        return Marker(str(folder), str(data["store"]), int(data["step"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path} is not a readable incremental checkpoint record ({exc}); delete the folder "
            "or resume from another checkpoint"
        ) from exc


def write(folder: str | os.PathLike[str], store: str, step: int) -> None:
    """Create ``folder`` (if needed) and its record for step ``step`` of ``store``."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, NAME)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as fh:
        json.dump({"format": FORMAT, "store": store, "step": step}, fh)
        fh.write("\n")
    os.replace(temporary, path)


def folder_of(run_dir: str, prefix: str, step: int) -> str:
    """``run_dir/{prefix}-{step}``: where the Trainer puts checkpoint ``step``."""
    return os.path.join(run_dir, f"{prefix}-{step}")


def steps_with_folders(run_dir: str, store: str) -> set[int]:
    """The steps of ``store`` that a folder in ``run_dir`` still records (rotation deleted the
    others' folders)."""
    found: set[int] = set()
    if not os.path.isdir(run_dir):
        return found
    for entry in os.listdir(run_dir):
        try:
            marker = read(os.path.join(run_dir, entry))
        except ValueError:
            continue
        if marker is not None and marker.store == store:
            found.add(marker.step)
    return found
