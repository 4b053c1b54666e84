"""A run's start as the writer of its store, the same for every adapter.

Before a run resumes or takes its first training step, the coordinator (rank 0, the process
that commits) checks that it can write the store: it takes the writer lease and probes the
store (:meth:`~lightning_incremental.core.CheckpointStore.acquire_writer`), claiming a new
fencing generation first where the job claims one (:func:`~lightning_incremental.core.commit.
fencing.should_claim`: several processes, torchrun, a requeued SLURM job), so that a restarted
job takes over from its previous incarnation. Every rank learns the outcome
(:func:`~lightning_incremental.runtime.cluster.coordinate.coordinated`): the generation, or the same
error — the coordinator's own, a ``WriterLeaseError`` or ``StoreNotWritableError`` on the
others too (:class:`~lightning_incremental.runtime.cluster.coordinate.CoordinatorError` subclasses)
— so no rank trains on, or waits in a collective, for a run that cannot save.

A run that only reads (Lightning's ``validate``/``test``/``predict``, loading a checkpoint)
makes no such check: reading needs no lease.
"""

from __future__ import annotations

from typing import Any

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.commit import fencing
from lightning_incremental.runtime.cluster.coordinate import Broadcast, coordinated


def begin(store: CheckpointStore, *, claim: bool) -> int | None:
    """On the coordinator: claim a generation (with ``claim``: at least the launcher's restart
    count), take the writer lease and probe the store. Returns the generation claimed, None
    when ``claim`` is False.

    Raises:
        WriterLeaseError: another process writes the store (naming it, and what to do).
        StoreNotWritableError: the store cannot be written.
    """
    generation = store.acquire_writer(claim=fencing.restart_count() if claim else None)
    return generation if claim else None


def begin_everywhere(
    store: CheckpointStore | None,
    *,
    claim: bool,
    is_coordinator: bool,
    broadcast: Broadcast | None = None,
    what: Any = None,
) -> int | None:
    """:func:`begin` on the coordinator (``store``: its store; the other ranks may pass None),
    its outcome on every rank: a collective. ``broadcast``: the group's (default the
    runtime's); ``what``: the store's URL for the other ranks' messages (default its own).

    Raises:
        WriterLeaseError, StoreNotWritableError: on the coordinator; on the other ranks their
            :class:`~lightning_incremental.runtime.cluster.coordinate.CoordinatorError` twins.
        CoordinatorError: on the other ranks, any other failure of the coordinator.
    """
    url = what if what is not None else (store.url if store is not None else "the store")

    def action() -> int | None:
        assert store is not None, "the coordinator checks its own store"
        return begin(store, claim=claim)

    generation: int | None = coordinated(
        action,
        what=f"start writing the checkpoint store {url}",
        is_coordinator=is_coordinator,
        broadcast=broadcast,
    )
    return generation
