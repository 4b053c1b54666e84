"""What IncrementalCheckpointIO reads of ModelCheckpoint's best/last paths as recorded in the
checkpoint dict it saves (whether a stage is running: :func:`._compat.trainer_stage_running`)."""

from __future__ import annotations

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
