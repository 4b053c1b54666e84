"""What an :class:`~accelerate_incremental.IncrementalCheckpointer` does at its creation, its
start as the writer of its store (:mod:`lightning_incremental.runtime.cluster.writing`): the main
process
takes the writer lease and probes the store, before anything is loaded or trained, claiming a
new fencing generation first with more than one process (or under torchrun, or in a requeued
SLURM job): checkpoints a previous incarnation of the job writes afterwards are never visible."""

from __future__ import annotations

from typing import Any

from lightning_incremental.core import ConfigError
from lightning_incremental.core.commit import fencing
from lightning_incremental.runtime.cluster import writing


def start(store: Any, accelerator: Any, *, read_only: bool) -> int | None:
    """Start writing ``store`` on every process (the main process acts, every process learns
    the outcome); returns the generation claimed (None: none). Nothing with ``read_only``. A
    failed start closes the store.

    Raises:
        WriterLeaseError: another job writes the store (naming its host, pid and job).
        StoreNotWritableError: the store cannot be written.
        CoordinatorError: on the other processes, another failure of the main process.
    """
    if read_only:
        return None
    try:
        return writing.begin_everywhere(
            store,
            claim=fencing.should_claim(accelerator.num_processes),
            is_coordinator=accelerator.is_main_process,
        )
    except BaseException:
        store.close()
        raise


def refuse_save(read_only: bool, url: str) -> None:
    """Raise when a checkpointer created ``read_only`` is asked to save.

    Raises:
        ConfigError: ``read_only``.
    """
    if read_only:
        raise ConfigError(
            f"this IncrementalCheckpointer of {url} was created with read_only=True: it loads "
            "checkpoints and never saves; create it without read_only to save (it then checks "
            "at its creation that it can write the store)"
        )
