"""The parts of one store, built and wired together: what ``CheckpointStore`` delegates to.

None of them refers back to the store, so a store dropped without ``close`` is collected at
once (its finalizer releases the writer lease, and its executors' threads end).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

from lightning_incremental.core.chunks.delta_base import DeltaBase
from lightning_incremental.core.commit import fencing, writer
from lightning_incremental.core.commit.committer import Committer
from lightning_incremental.core.commit.group import Alone, GlooGroup, Group
from lightning_incremental.core.commit.history import History, read_manifest
from lightning_incremental.core.commit.lease import Lease
from lightning_incremental.core.commit.location import location
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.load.loader import Loader
from lightning_incremental.core.maintain.retention import Collector, KeepLast, Maintainer
from lightning_incremental.core.save.queue import SaveQueue
from lightning_incremental.core.save.saver import Saver
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.workers import WorkerPool, free_cores, restore_cores

log = logging.getLogger("lightning_incremental")


@dataclass(frozen=True)
class Engine:
    """One store's parts. ``lock`` is held while a save writes and commits, and while gc or
    compact deletes or rewrites: objects a save is about to reference are never swept from
    under it. It is the process's lock of the location (:mod:`.commit.location`), shared by
    every store object there, as the writer lease is."""

    group: Group
    lock: threading.RLock
    pool: WorkerPool
    writer: WorkerPool
    reader: WorkerPool
    queue: SaveQueue
    generation: fencing.Generation
    fencing: fencing.Fencing
    history: History
    base: DeltaBase
    lease: Lease
    committer: Committer
    collector: Collector
    retention: KeepLast
    loader: Loader
    saver: Saver
    maintainer: Maintainer

    def claim(self, minimum: int) -> int:
        """Claim a new fencing generation (:meth:`.fencing.Generation.claim`)."""
        # Not under the location's lock: a claim deletes nothing, and a claim through one store
        # object must not wait for a save held up in another (the claim is what fences it).
        with self.history.lock:
            return self.generation.claim(minimum, self.fencing, self.lease, self.history)

    def acquire_writer(self, claim: int | None) -> int:
        """Claim a generation (at least ``claim``, unless None), take the writer lease and
        probe that the store can be written (:func:`.commit.writer.acquire`); returns the
        generation this store writes as."""

        def admit() -> None:
            if claim is not None:
                self.claim(claim)
            with self.lock:  # as a save admits itself
                self.generation.admit(self.fencing, self.lease, self.history)

        writer.acquire(self.lease, admit)
        return self.generation.value

    def shutdown(self) -> None:
        """Stop the background threads, drop the delta base, release the lease and the group
        (after the pending saves were waited for)."""
        self.queue.shutdown()
        self.pool.shutdown(wait=True)
        self.writer.shutdown(wait=True)
        self.reader.shutdown(wait=True)
        self.base.clear()
        self.lease.release()
        if isinstance(self.group, GlooGroup):
            self.group.close()


def assemble(
    storage: Storage, config: StoreConfig, *, distributed: bool, collective_timeout_s: float
) -> Engine:
    """Build the parts of a store over ``storage`` (with ``distributed``: its own gloo group,
    a collective every rank enters)."""
    group: Group = GlooGroup(collective_timeout_s) if distributed else Alone()
    if config.optimizer_state != "exact":
        log.warning(
            "store %s keeps optimizer moments as %s (optimizer_state=%r): fewer bytes, but a "
            "resume from its checkpoints is not bit-exact",
            storage.url,
            config.optimizer_state,
            config.optimizer_state,
        )
    place = location(storage.url)
    lock = place.lock
    # Threads exist only while there is work (they end after a short idle time), at a lower
    # priority than training's (workers.py: background work yields to training).
    nice = config.background_nice
    automatic = config.workers is None
    workers = free_cores() if config.workers is None else config.workers
    pool = WorkerPool(workers, "li-worker", nice=nice)
    # Pack writes on threads of their own: a write blocks in fsync, and on a worker it would
    # leave a core idle that could encode meanwhile. Two, so that one pack's copy into the page
    # cache overlaps another's fsync (one writer fell behind two encoders on large states).
    # With ``workers=1`` asked for, the worker writes too: one background thread does all of a
    # save's work, in order (the least CPU a store takes, and storage calls in a fixed order).
    writer = WorkerPool(2, "li-writer", nice=nice) if automatic or workers > 1 else pool
    # Restores decode on every core, at the caller's priority: the caller waits for them
    # (``restore_cores``). An explicit ``workers`` bounds them too.
    reader = WorkerPool(restore_cores() if automatic else workers, "li-reader")
    queue = SaveQueue(config.max_in_flight, nice=nice)
    generation = fencing.Generation(storage, config.generation)
    # A function of the storage, not a bound method: no reference cycle.
    fence = fencing.Fencing(storage, functools.partial(read_manifest, storage))
    history = History(storage, fence)
    base = DeltaBase(config)
    base.rewrites_seen = place.rewrites  # what other store objects rewrote before (rewrites.py)
    # One writing process per store (lease.py).
    lease = Lease(storage, config.lease_ttl_s)
    committer = Committer(
        storage,
        config,
        pool,
        writer=writer,
        fencing=fence,
        lease=lease,
        history=history,
        base=base,
        location=place,
    )
    collector = Collector(
        storage,
        fence,
        history,
        base,
        min_age_s=config.min_object_age_s,
        guard=functools.partial(generation.check_current, fence, lease, "retention stopped"),
        location=place,
    )
    retention = KeepLast(config.keep_last, collector, lock)
    saver = Saver(
        storage,
        config,
        group=group,
        distributed=distributed,
        queue=queue,
        committer=committer,
        lease=lease,
        history=history,
        base=base,
        after_commit=retention.after_commit,
        generation=generation,
        lock=lock,
    )
    maintainer = Maintainer(
        committer,
        pool,
        collector,
        lease=lease,
        history=history,
        base=base,
        generation=generation,
        lock=lock,
    )
    return Engine(
        group=group,
        lock=lock,
        pool=pool,
        writer=writer,
        reader=reader,
        queue=queue,
        generation=generation,
        fencing=fence,
        history=history,
        base=base,
        lease=lease,
        committer=committer,
        collector=collector,
        retention=retention,
        loader=Loader(storage, config, reader, history),
        saver=saver,
        maintainer=maintainer,
    )
