"""The save side of one store: what runs once ``CheckpointStore.save`` has checked its
arguments.

On the caller's thread, :meth:`Saver.submit` checks the step, waits for a place in the save
queue (back-pressure) and takes the snapshot (:mod:`~lightning_incremental.core.save.snapshot`).
In the background, a local save writes its one part and commits the manifest
(:mod:`~lightning_incremental.core.commit.committer`); a distributed or sharded one runs
:func:`~lightning_incremental.core.commit.sharded.commit_sharded`. Either way the delta base
learns what the next save builds on, and ``after_commit`` (retention, wired by
:mod:`~lightning_incremental.core.engine`) runs after the commit (on the coordinator).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_incremental.core.chunks.delta_base import DeltaBase, Parent
from lightning_incremental.core.commit import rewrites
from lightning_incremental.core.commit.committer import Committer, Part
from lightning_incremental.core.commit.fencing import Generation
from lightning_incremental.core.commit.figures import save_result
from lightning_incremental.core.commit.group import Group
from lightning_incremental.core.commit.history import History, read_fork_base
from lightning_incremental.core.commit.lease import Lease
from lightning_incremental.core.commit.sharded import commit_sharded, rank_result
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.format.tree import Flat, Leaf
from lightning_incremental.core.results import SaveResult
from lightning_incremental.core.save import inflight
from lightning_incremental.core.save.queue import SaveHandle, SaveQueue
from lightning_incremental.core.save.snapshot import flatten_state, wait_ready
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")


class Saver:
    """Runs the saves of one store over its parts (none of which refers back to the store, so
    a store dropped without ``close`` is collected at once).

    Args:
        group: the store's process group (:class:`~.commit.group.Alone` unless ``distributed``).
        lock: the store's write lock, held while a save writes and commits (gc and compact
            hold it too: objects a save is about to reference are never swept from under it).
    """

    def __init__(
        self,
        storage: Storage,
        config: StoreConfig,
        *,
        group: Group,
        distributed: bool,
        queue: SaveQueue,
        committer: Committer,
        lease: Lease,
        history: History,
        base: DeltaBase,
        after_commit: Callable[[SaveResult], SaveResult],
        generation: Generation,
        lock: threading.RLock,
    ) -> None:
        self.storage, self.config, self.group, self.distributed = (
            storage,
            config,
            group,
            distributed,
        )
        self.queue, self.committer, self.lease = queue, committer, lease
        self.history, self.base, self.after_commit = history, base, after_commit
        self.generation, self.lock = generation, lock
        self.initialised = False

    def initialise(self) -> None:
        """On first use: the newest committed checkpoint becomes the parent of the next save.
        The caller holds the history's lock."""
        if self.initialised:
            return
        steps = self.history.steps()
        _ = self.generation.value  # fixed now: a later claim fences this writer off
        self.history.last_step = steps[-1] if steps else None
        newest = self.history.newest_readable(steps)
        if newest is None:  # a fork of weights only: its first save builds on the source's step
            self.base.set(Parent.of(read_fork_base(self.storage)))
        else:
            self.base.set(Parent.of(newest))
        self.history.committed = newest.step if newest is not None else None
        self.initialised = True

    def submit(
        self, state: dict[str, Any], step: int, audit: dict[str, Any], started: float
    ) -> SaveHandle:
        """Check ``step``, take the snapshot of ``state`` and queue its save (``started``: when
        the caller's ``save`` began, for the timings)."""
        with self.history.lock:
            self.initialise()
            self.history.check_step(step)
            self.history.last_step = step
        self.committer.effort.started(busy=bool(self.queue.pending()))
        reserved = False
        try:
            self.queue.reserve()
            reserved = True
            waited = time.perf_counter() - started
            self.queue.raise_undelivered()  # an earlier save may have failed while we waited
            flat = flatten_state(
                state,
                allow_pickle=self.config.allow_pickle,
                pool=self.base.pool,
                rank=self.group.rank if self.distributed else None,
            )
        except BaseException:
            if reserved:
                self.queue.cancel()
            self.history.rewind(self.queue.pending(exclude=step))
            raise
        snapshot_s = time.perf_counter() - started

        def run() -> SaveResult:
            wait_ready(flat)  # the device copies, on the side stream (snapshot.py)
            if self.distributed or flat.sharded:
                return self._run_sharded(step, flat, audit, started, snapshot_s, waited)
            return self._run_local(
                step, flat.leaves, flat.skeleton, flat.pickled, audit, started, snapshot_s, waited
            )

        handle = self.queue.submit(step, run)
        inflight.track(self.storage.url, handle._done)  # loads in this process wait for it
        return handle

    def admit(self) -> None:
        """Take the writer lease for this save (:meth:`.fencing.Generation.admit`)."""
        self.generation.admit(self.committer.fencing, self.lease, self.history)

    def adopt(self, step: int, manifest: Manifest) -> None:
        """After a restore of the whole of ``step`` that verified every chunk: its objects are
        trusted. When the restored step is what the next save builds on (the newest committed
        one, no save pending), tell the delta base: a resumed job writes deltas from its first
        save on, their bases read from storage (``xor_base_from_storage``), not kept in
        memory."""
        self.history.trust(manifest.packs)
        with self.history.lock:
            if self.queue.pending():
                return
            self.initialise()
            if self.history.committed_last() != step:
                return
            self.base.adopt(step, manifest)
            self.history.committed = step

    def _run_local(
        self,
        step: int,
        leaves: list[Leaf],
        tree: Any,
        pickled: list[str],
        audit: dict[str, Any],
        started: float,
        snapshot_s: float,
        waited: float,
    ) -> SaveResult:
        try:
            with self.lock:
                self.admit()  # one writer per store
                self.history.write_marker()
                rewrites.rebase_if_others(self.committer)  # compacted through another object?
                previous = self.base.parent
                # the manifest is prepared while the part's last writes run (commit waits)
                part: Part = self.committer.write_part(step, leaves, durable=False)
                if part.parent != (previous.step if previous else None):
                    previous = self.base.parent  # rebuilt on what is committed now
                committed = self.committer.commit(
                    step, [part], generation=self.generation.value, audit=audit, tree=tree,
                    pickled=pickled,
                )  # fmt: skip
                self.base.committed(committed.manifest, leaves)  # the next save's base
        except BaseException as exc:  # delivered through the handle, the next save and close
            self.base.release(leaves, step)
            self.history.rewind(self.queue.pending(exclude=step))
            log.error("checkpoint step %d failed: %s", step, exc)
            raise
        result = save_result(
            [part],
            committed,
            previous=previous.manifest if previous else None,
            snapshot_s=snapshot_s,
            wait_s=waited,
            total_s=time.perf_counter() - started,
        )
        log.info(
            "checkpoint step %d committed: %d of %d bytes written (%.1fx), %.3fs blocked",
            step,
            result.bytes_written,
            result.bytes_logical,
            result.ratio,
            snapshot_s,
        )
        return self.after_commit(result)

    def _run_sharded(
        self,
        step: int,
        flat: Flat,
        audit: dict[str, Any],
        started: float,
        snapshot_s: float,
        waited: float,
    ) -> SaveResult:
        """One rank's side of a sharded save (:mod:`~lightning_incremental.core.commit.sharded`)."""
        coordinator = self.group.rank == 0

        def write() -> Part:
            with self.lock:
                if coordinator:
                    self.admit()  # one writer per store: rank 0
                    self.history.write_marker()
                rewrites.rebase_if_others(self.committer)  # compacted through another object?
                return self.committer.write_part(step, flat.leaves)

        try:
            part, manifest, committed = commit_sharded(
                self.group,
                self.committer,
                step,
                flat,
                write,
                generation=lambda: self.generation.value,  # once admitted (it may claim)
                audit=audit,
            )
            with self.history.lock:
                self.history.committed = step
                self.history.trust(manifest.packs)
            self.base.committed(manifest, flat.leaves, part.tensors)  # this rank's next base
        except BaseException as exc:
            self.base.release(flat.leaves, step)
            self.history.rewind(self.queue.pending(exclude=step))
            # The ranks may have built on different parents: all start again from storage.
            self.base.set(Parent.of(self.history.newest_readable()))
            log.error("checkpoint step %d failed on rank %d: %s", step, self.group.rank, exc)
            raise
        result = rank_result(
            part,
            committed,
            snapshot_s=snapshot_s,
            wait_s=waited,
            total_s=time.perf_counter() - started,
        )
        log.info(
            "checkpoint step %d committed: rank %d wrote %d of its %d bytes, %.3fs blocked",
            step,
            self.group.rank,
            result.bytes_written,
            result.bytes_logical,
            snapshot_s,
        )
        return self.after_commit(result) if coordinator else result
