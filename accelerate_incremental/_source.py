"""Where :meth:`~accelerate_incremental.IncrementalCheckpointer.load` finds the state to
restore: the memory tier's agreed step when it is on and holds one at least as new as the
store's (:mod:`~._memory`), else the store's newest committed checkpoint."""

from __future__ import annotations

from typing import Any

from accelerate_incremental import _memory
from lightning_incremental.core import CheckpointNotFoundError
from lightning_incremental.runtime.cluster.coordinate import coordinated


def newest(
    accelerator: Any,
    store: Any,
    memory: _memory.AccelerateMemory | None,
    into: Any,
    location: Any,
) -> tuple[int, dict[str, Any], str] | None:
    """Every process together: ``(step, state, tier)`` (tier ``"memory"``, ``"peer"`` or
    ``"store"``), or None when there is nothing to resume from. The main process picks the
    store's step (decoding it into ``into``) and broadcasts it; the others load that step."""
    found = _memory.load(memory, store) if memory is not None else None
    if found is not None:  # every process: its own part, from its memory or a peer's
        return found
    state: dict[str, Any] | None = None

    def pick() -> int | None:
        nonlocal state
        try:
            state = store.load(map_location=location, into=into, strict_into=False)
        except CheckpointNotFoundError:
            return None
        return int(store.loaded_step)

    step = coordinated(
        pick,
        what=f"load a checkpoint from {store.url}",
        is_coordinator=accelerator.is_main_process,
    )
    if step is None:
        return None
    _memory.log_store(memory, step, store.url)
    if state is None:
        state = store.load(step, map_location=location, into=into, strict_into=False)
    return step, state, "store"
