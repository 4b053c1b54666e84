"""``ModelCheckpoint``'s state in a memory step, made to name only checkpoints that exist.

A memory step is taken every step and holds every callback's state, ``ModelCheckpoint``'s
included: its top-k (``best_k_models``), ``best_model_path``, ``kth_best_model_path`` and
``last_model_path``. Its saves finish later: through ``IncrementalCheckpointIO`` the pointer
file is written at once and its step commits in the background (as through Lightning's
``AsyncCheckpointIO`` the file is written in the background). A process that dies
with such a save in flight leaves a memory step naming a checkpoint that never came to be.

At a resume from memory, before Lightning hands the states to the callbacks, the checkpoints
that cannot be loaded are taken out: out of the top-k, and ``best_model_path`` and the kth
recomputed from what is left, as ``ModelCheckpoint`` computes them (``last_model_path`` stays:
see ``_PATHS``). Rank 0 decides (``ModelCheckpoint`` writes its files from rank 0,
and other nodes may not see them) and every rank applies the same. The files themselves are
left where they are, named in a warning: a pointer file's writer may still be running.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_incremental.core import CheckpointError, CheckpointNotFoundError
from lightning_incremental.lightning.path_resolution import check_step
from lightning_incremental.lightning.pointers import Pointer, looks_like_pointer

__all__ = ["drop_unsaved", "named", "without"]

log = logging.getLogger("lightning_incremental.lightning.callback")

# last_model_path is left as it is: Lightning writes the next last checkpoint over that name
# (cleared, it would write "last-v1.ckpt" beside a file that stays), and ckpt_path="last"
# lists the files, not this state
_PATHS = ("best_model_path", "kth_best_model_path")


def drop_unsaved(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> list[str]:
    """Every rank together: takes the checkpoints that cannot be loaded out of the
    ``ModelCheckpoint`` states in ``checkpoint`` (in place); returns their paths."""
    states = checkpoint.get("callbacks")
    modes = {  # states of ModelCheckpoint's shape (IncrementalCheckpoint's names no files)
        cb.state_key: cb.mode
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint)
        and isinstance(states, dict)
        and isinstance(states.get(cb.state_key), dict)
        and "best_k_models" in states[cb.state_key]
    }
    gone: list[str] | None = None
    if trainer.is_global_zero:  # never raises: every rank reaches the broadcast
        paths = {p for key in modes for p in named(states[key])}
        gone = _unloadable(trainer, paths)
    gone = trainer.strategy.broadcast(gone, src=0)
    if not gone:
        return []
    for key, mode in modes.items():
        states[key] = without(states[key], set(gone), mode)
    rank_zero_warn(
        "IncrementalCheckpoint: resumed from a memory step whose ModelCheckpoint state names "
        f"checkpoints whose saves never finished (the process died first): {', '.join(gone)}. "
        "They are out of its top-k and best paths; any file left there cannot be loaded and "
        "can be deleted"
    )
    return gone


def named(state: Any) -> set[str]:
    """The checkpoint paths a ``ModelCheckpoint`` state names."""
    if not isinstance(state, dict):
        return set()
    paths = {state.get(key) for key in _PATHS}
    best_k = state.get("best_k_models")
    if isinstance(best_k, dict):
        paths.update(best_k)
    return {p for p in paths if isinstance(p, str) and p}


def without(state: dict[str, Any], gone: set[str], mode: str) -> dict[str, Any]:
    """``state`` with the checkpoints in ``gone`` taken out: the top-k without them, its best
    and kth recomputed as ``ModelCheckpoint._update_best_and_save`` does (the kth of a top-k
    that is no longer full is not read until it fills again, when it is recomputed). Without
    a monitor (the newest is the best, no top-k) a lost best becomes no best."""
    state = dict(state)
    best_k = state.get("best_k_models")
    if isinstance(best_k, dict):
        best_k = {p: s for p, s in best_k.items() if p not in gone}
        state["best_k_models"] = best_k
    else:
        best_k = {}
    better, worse = (min, max) if mode == "min" else (max, min)
    if state.get("best_model_path") in gone:
        best = better(best_k, key=best_k.__getitem__) if best_k else ""
        state["best_model_path"] = best
        state["best_model_score"] = best_k[best] if best else None
    if state.get("kth_best_model_path") in gone:
        kth = worse(best_k, key=best_k.__getitem__) if best_k else ""
        state["kth_best_model_path"] = kth
        if kth:
            state["kth_value"] = best_k[kth]
        elif "kth_value" in state:  # as ModelCheckpoint starts it
            state["kth_value"] = _like(state["kth_value"], math.inf if mode == "min" else -math.inf)
    return state


def _like(value: Any, number: float) -> Any:
    return torch.tensor(number) if isinstance(value, torch.Tensor) else number


def _unloadable(trainer: pl.Trainer, paths: set[str]) -> list[str]:
    """The ``paths`` that do not load: through IncrementalCheckpointIO, a pointer file whose
    step (or the step it replaced, which a load falls back to) is not committed, or a missing
    file; through any other CheckpointIO, a missing file. A check that fails keeps the path (a
    load says what is wrong) and the stores opened only to check are closed."""
    from lightning_incremental.lightning.checkpoint_io import IncrementalCheckpointIO
    from lightning_incremental.lightning.removal import close_unsaved

    io = trainer.strategy.checkpoint_io
    ours = isinstance(io, IncrementalCheckpointIO)
    try:
        loads = partial(_pointer_loads, io) if ours else _exists
        return sorted(p for p in paths if not loads(p))
    except Exception as exc:  # a storage backend's own error: nothing is taken out
        log.warning("IncrementalCheckpoint: ModelCheckpoint's checkpoints not checked: %r", exc)
        return []
    finally:
        if ours:
            close_unsaved(io._lock, io._stores)


def _exists(path: str) -> bool:
    try:
        return bool(get_filesystem(path).exists(path))
    except Exception:  # cannot tell: kept, and a load says what is wrong
        return True


def _pointer_loads(io: Any, path: str) -> bool:
    try:
        source = io._linked_file(path)
        head = source.head()
        if head is None:
            return False
        if not looks_like_pointer(head):
            return True
        pointer = Pointer.parse(source.read(), source.display)
        url = source.store_url(pointer.store)
        return any(
            _committed(io, url, step, ident, pointer.store, source.display)
            for step, ident in _steps(pointer)
        )
    except (CheckpointError, OSError, ValueError):  # cannot tell: kept, and a load says why
        return True


def _steps(pointer: Pointer) -> Iterable[tuple[int, str | None]]:
    yield pointer.step, pointer.id
    if pointer.previous is not None:
        yield pointer.previous, pointer.previous_id


def _committed(io: Any, url: str, step: int, ident: str | None, store: str, shown: str) -> bool:
    try:
        check_step(io._store_of, url, step, ident, store, shown)
    except CheckpointNotFoundError:
        return False
    return True
