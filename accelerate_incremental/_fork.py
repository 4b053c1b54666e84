"""``IncrementalCheckpointer(fork_from="SRC[@STEP]")``: the main process forks the source's step
into the checkpointer's store before any process opens it (:func:`~lightning_incremental.runtime.
fork.ensure_fork`); every process learns the outcome, and :meth:`load` then finds the forked step.
"""

from __future__ import annotations

from typing import Any

from lightning_incremental.runtime.coordinate import coordinated
from lightning_incremental.runtime.fork import check_source, ensure_fork


def before_open(
    is_main_process: bool, dirpath: str, fork_from: Any, storage_options: dict[str, Any] | None
) -> None:
    """Fork into ``dirpath`` on the main process when ``fork_from`` is set (a collective)."""
    source = check_source(fork_from)
    if source is None:
        return
    coordinated(
        lambda: ensure_fork(str(dirpath), source, storage_options),
        what=f"fork {source} into {dirpath}",
        is_coordinator=is_main_process,
    )
