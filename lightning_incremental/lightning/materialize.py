"""``IncrementalCheckpointIO(materialize=...)``: real ``torch.save`` files where tools read
``.ckpt`` files themselves. When ``fit`` ends, the pointer files at ModelCheckpoint's
``best_model_path`` / ``last_model_path`` (as of the newest save) are replaced by the complete
checkpoints they name (tensors on the CPU), and their steps are released from the store unless
another pointer file names them."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

from lightning_incremental.core import ConfigError
from lightning_incremental.lightning import pointer_lifecycle
from lightning_incremental.lightning.pointer_lifecycle import OpenStore
from lightning_incremental.lightning.pointers import CheckpointFile, Pointer, looks_like_pointer
from lightning_incremental.lightning.trainer import MATERIALIZE

log = logging.getLogger(__name__)


def materialize_option(value: Any) -> tuple[str, ...]:
    """``materialize`` as the tuple of kinds it asks for (empty: off).

    Raises:
        ConfigError: anything but a bool, ``"best"``, ``"last"`` or a collection of them.
    """
    if value is False or value is None:
        return ()
    if value is True:
        return MATERIALIZE
    kinds = (value,) if isinstance(value, str) else value
    if not isinstance(kinds, (tuple, list, set, frozenset)) or not all(
        k in MATERIALIZE for k in kinds
    ):
        raise ConfigError(
            f"materialize must be True, False, 'best', 'last' or a list of them, got {value!r}"
        )
    return tuple(k for k in MATERIALIZE if k in kinds)


def materialize(
    marks: dict[str, dict[str, str]],
    kinds: tuple[str, ...],
    *,
    file_of: Callable[[str], CheckpointFile],
    load: Callable[[str], tuple[dict[str, Any], int | None]],
    entry_of: Callable[[str], OpenStore],
    fsync: bool,
) -> None:
    """Replace the pointer files at the ``kinds`` of ``marks`` (each ModelCheckpoint's best/last
    paths) by plain ``torch.save`` files of their checkpoints, and release their steps.
    ``file_of``: the file a path names (links resolved: ``save_last="link"``); ``load``: the
    checkpoint a path holds, on the CPU, and its step; ``entry_of``: the open store at a URL."""
    import torch

    paths: list[str] = []
    for mark in marks.values():
        paths.extend(p for kind, p in mark.items() if kind in kinds)
    done: set[str] = set()
    for path in paths:
        target = file_of(path)
        if target.key in done:
            continue
        done.add(target.key)
        head = target.head()
        if head is None or not looks_like_pointer(head):
            continue  # removed meanwhile, or already a plain file
        pointer = Pointer.parse(target.read(), target.display)
        state, loaded = load(target.key)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        del state
        target.write_atomic(buffer.getvalue(), fsync=fsync)
        log.info("IncrementalCheckpointIO: wrote %s as a plain checkpoint", target.display)
        entry = entry_of(target.store_url(pointer.store))
        for step in dict.fromkeys((loaded, pointer.step, pointer.previous)):
            if step is not None:  # the file no longer names them
                pointer_lifecycle.release(target, entry, pointer.store, step)
