"""The fencing generation an :class:`~accelerate_incremental.IncrementalCheckpointer` claims
when it is created with more than one process (or under torchrun): checkpoints a previous
incarnation of the job writes afterwards are never visible."""

from __future__ import annotations

from typing import Any

from lightning_incremental.core.commit import fencing
from lightning_incremental.runtime.coordinate import coordinated


def claim(store: Any, is_main_process: bool) -> int:
    """A new fencing generation of ``store``, claimed by the main process, known to every
    process; a failed claim closes the store.

    Raises:
        CoordinatorError: on the other processes, the claim failed (the main process raises
            its own error).
    """
    try:
        return coordinated(
            lambda: store.claim_generation(fencing.restart_count()),
            what=f"claim a fencing generation in {store.url}",
            is_coordinator=is_main_process,
        )
    except BaseException:
        store.close()
        raise
