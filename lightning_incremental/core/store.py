"""CheckpointStore: the engine's public entry point, a facade over the parts that own the work.

- :mod:`.save_queue`: the background saver, back-pressure and save handles;
- :mod:`.commit`: write a part's objects, then commit the one manifest (fenced);
- :mod:`.delta_base`: what the next save is encoded against;
- :mod:`.history`: committed steps, quarantine, trusted objects;
- :mod:`.retention`: gc, and the ``keep_last`` policy run after each commit;
- :mod:`.loader`: restore with fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from lightning_incremental.core import fencing, inflight
from lightning_incremental.core import manifest as mf
from lightning_incremental.core.collective import Alone, GlooGroup, Group
from lightning_incremental.core.commit import Committer, Part, rewrite_as_base, save_result
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.delta_base import DeltaBase, Parent
from lightning_incremental.core.errors import CheckpointError, ConfigError
from lightning_incremental.core.format import Manifest
from lightning_incremental.core.history import History, check_step_type, read_manifest
from lightning_incremental.core.lease import Lease
from lightning_incremental.core.loader import Loaded, Loader, Selection
from lightning_incremental.core.maintenance import verify_manifest
from lightning_incremental.core.materialise import MapLocation
from lightning_incremental.core.restore import check_keys
from lightning_incremental.core.results import GcReport, SaveResult, VerifyReport
from lightning_incremental.core.retention import Collector, KeepLast, Plan
from lightning_incremental.core.save_queue import SaveHandle, SaveQueue, drain_at_exit
from lightning_incremental.core.sharded import commit_sharded, rank_result
from lightning_incremental.core.storage import LocalStorage, Storage, open_storage
from lightning_incremental.core.tree import Flat, Leaf, flatten_state
from lightning_incremental.core.workers import WorkerPool

log = logging.getLogger("lightning_incremental")


class CheckpointStore:
    """Incremental, verified checkpoints of nested state dicts on any fsspec URL.

    ``save`` blocks only for a snapshot of the state's tensors to host memory; hashing, delta
    encoding, compression and writing run in the background and commit a manifest last. ``load``
    returns exactly what was saved (bit-identical tensors) or raises.

    Args:
        url: a local path, ``file://``, ``memory://``, ``s3://`` or any fsspec URL; or a
            :class:`~lightning_incremental.core.storage.Storage` instance.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...). They are
            never written to manifests or logs.
        config: a :class:`StoreConfig`; keyword ``options`` override its fields.
        distributed: every rank of a ``torch.distributed`` job opens the store (at the same
            time: it creates its own gloo group, a collective) and calls ``save`` with the same
            state structure and step. Each rank snapshots, encodes and writes only the arrays it
            holds (its pieces of DTensors and ``ShardedTensor`` objects, one of each set of
            replicas; rank 0 also the plain tensors and values, identical on every rank), then
            rank 0 commits one manifest once every rank's part is durable, and every rank's
            handle returns or raises the same error. Rank 0 alone holds the writer lease and
            runs retention. ``load`` needs no collective: each rank reads what it needs.
        collective_timeout_s: with ``distributed``, how long a save waits for the other ranks
            before it fails (a dead or hung rank). Default 600.

    Raises:
        ConfigError: an invalid option, URL or protocol; ``distributed`` without an initialised
            process group.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Storage,
        *,
        storage_options: dict[str, Any] | None = None,
        config: StoreConfig | None = None,
        distributed: bool = False,
        collective_timeout_s: float = 600.0,
        **options: Any,
    ) -> None:
        if config is not None and not isinstance(config, StoreConfig):
            raise ConfigError(f"config must be a StoreConfig, got {type(config).__name__}")
        base = config or StoreConfig()
        self.config = base.replace(**options) if options else base
        self.storage = url if isinstance(url, Storage) else open_storage(url, storage_options)
        if isinstance(self.storage, LocalStorage):
            self.storage.fsync = self.config.fsync
        self.url = self.storage.url
        if not isinstance(distributed, bool):
            raise ConfigError(f"distributed must be True or False, got {distributed!r}")
        self.distributed = distributed
        self._group: Group = GlooGroup(collective_timeout_s) if distributed else Alone()
        if self.config.optimizer_state != "exact":
            log.warning(
                "store %s keeps optimizer moments as %s (optimizer_state=%r): fewer bytes, but a "
                "resume from its checkpoints is not bit-exact",
                self.url,
                self.config.optimizer_state,
                self.config.optimizer_state,
            )
        # Held while a save writes and commits, and while gc or compact deletes or rewrites:
        # objects a save is about to reference are never swept from under it.
        self._write_lock = threading.RLock()
        # Threads exist only while there is work (they end after a short idle time).
        self._pool = WorkerPool(self.config.workers, "li-worker")
        self._queue = SaveQueue(self.config.max_in_flight)
        self._initialised = False
        self._closed = False
        self.loaded_step: int | None = None  # the step the latest successful load returned
        self._generation: int | None = self.config.generation  # None: joins the newest claim
        # A function of the storage, not a bound method: no reference cycle, so a store dropped
        # without close() is collected at once and its executors' threads end.
        self._fencing = fencing.Fencing(
            self.storage, functools.partial(read_manifest, self.storage)
        )
        self._history = History(self.storage, self._fencing)
        self._base = DeltaBase(self.config)
        # One writing process per store (lease.py); released on close, or when this store is
        # dropped without close (the finalizer holds the lease, not the store).
        self._lease = Lease(self.storage, self.config.lease_ttl_s)
        weakref.finalize(self, self._lease.release)
        self._committer = Committer(
            self.storage,
            self.config,
            self._pool,
            fencing=self._fencing,
            lease=self._lease,
            history=self._history,
            base=self._base,
        )
        self._collector = Collector(self.storage, self._fencing, self._history, self._base)
        self._retention = KeepLast(self.config.keep_last, self._collector, self._write_lock)
        self._loader = Loader(self.storage, self.config, self._pool, self._history)
        drain_at_exit(self)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        state: dict[str, Any],
        step: int,
        *,
        metadata: dict[str, Any] | None = None,
        world_size: int = 1,
    ) -> SaveHandle:
        """Snapshot ``state`` and save it as checkpoint ``step`` in the background.

        Blocks only to copy the state's tensors to host memory (and, under back-pressure, while
        ``max_in_flight`` saves are pending). Mutating ``state`` afterwards does not change what
        is saved.

        Args:
            state: a dict (any nesting of dict/list/tuple) of tensors and plain values. It may
                hold DTensors (FSDP2, tensor parallel) and ``ShardedTensor`` objects, e.g. the
                sharded state dicts of ``torch.distributed.checkpoint.state_dict``'s
                ``get_model_state_dict`` / ``get_optimizer_state_dict``: they are stored as the
                pieces the ranks hold, with their global shapes (a store opened with
                ``distributed=True`` on every rank; a single process may save DTensors of a
                one-process mesh).
            step: a non-negative int, greater than every step already saved in this store.
            metadata: plain JSON values recorded in the manifest's audit trail (e.g. loss).
            world_size: processes of the job this state comes from, for the audit trail
                (with ``distributed``: the process group's size).

        Raises:
            TypeError: ``state`` is not a dict.
            StepError: ``step`` is not an int, or not greater than the newest saved step.
            UnsupportedValueError: a value that needs pickling, naming its key path; a tensor
                sharded over several processes in a store not opened with ``distributed``.
            Exception: the undelivered error of an earlier save (it is raised once).

        With ``distributed``, the handle's error is the same on every rank: this rank's own, or
        the one that stopped the commit (:class:`DistributedSaveError` when a rank died or did
        not report within ``collective_timeout_s``).
        """
        started = time.perf_counter()
        self._check_open()
        self._queue.raise_undelivered()
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict (e.g. {{'model': model.state_dict()}}), got "
                f"{type(state).__name__}"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        if self.distributed and world_size == 1:
            world_size = self._group.world
        audit = mf.audit_record(mf.plain_json(metadata, "metadata"), world_size)
        with self._history.lock:
            self._initialise()
            self._history.check_step(step)
            self._history.last_step = step
        reserved = False
        try:
            self._queue.reserve()
            reserved = True
            waited = time.perf_counter() - started
            self._queue.raise_undelivered()  # an earlier save may have failed while we waited
            flat = flatten_state(
                state,
                allow_pickle=self.config.allow_pickle,
                pool=self._base.pool,
                rank=self._group.rank if self.distributed else None,
            )
        except BaseException:
            if reserved:
                self._queue.cancel()
            self._history.rewind(self._queue.pending(exclude=step))
            raise
        snapshot_s = time.perf_counter() - started

        def run() -> SaveResult:
            if self.distributed or flat.sharded:
                return self._run_sharded_save(step, flat, audit, started, snapshot_s, waited)
            return self._run_save(
                step, flat.leaves, flat.skeleton, flat.pickled, audit, started, snapshot_s, waited
            )

        handle = self._queue.submit(step, run)
        inflight.track(self.url, handle._done)  # loads in this process wait for it
        return handle

    def wait(self) -> list[SaveResult]:
        """Wait for every pending save; returns their results, oldest first.

        Raises:
            Exception: the first error of a pending save that was not delivered yet.
        """
        return self._queue.wait()

    def _run_save(
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
            with self._write_lock:
                self._lease.acquire(self.generation)  # one writer per store
                self._history.write_marker()
                previous = self._base.parent
                part: Part = self._committer.write_part(step, leaves)
                if part.parent != (previous.step if previous else None):
                    previous = self._base.parent  # rebuilt on what is committed now
                committed = self._committer.commit(
                    step, [part], generation=self.generation, audit=audit, tree=tree,
                    pickled=pickled,
                )  # fmt: skip
                self._base.committed(committed.manifest, leaves)  # the next save's base
        except BaseException as exc:  # delivered through the handle, the next save and close
            self._base.release(leaves, step)
            self._history.rewind(self._queue.pending(exclude=step))
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
        return self._retention.after_commit(result)

    def _run_sharded_save(
        self,
        step: int,
        flat: Flat,
        audit: dict[str, Any],
        started: float,
        snapshot_s: float,
        waited: float,
    ) -> SaveResult:
        """One rank's side of a sharded save (:mod:`~lightning_incremental.core.sharded`)."""
        coordinator = self._group.rank == 0

        def write() -> Part:
            with self._write_lock:
                if coordinator:
                    self._lease.acquire(self.generation)  # one writer per store: rank 0
                    self._history.write_marker()
                return self._committer.write_part(step, flat.leaves)

        try:
            part, manifest, committed = commit_sharded(
                self._group,
                self._committer,
                step,
                flat,
                write,
                generation=self.generation,
                audit=audit,
            )
            with self._history.lock:
                self._history.committed = step
                self._history.trust(manifest.packs)
            self._base.committed(manifest, flat.leaves, part.tensors)  # this rank's next base
        except BaseException as exc:
            self._base.release(flat.leaves, step)
            self._history.rewind(self._queue.pending(exclude=step))
            # The ranks may have built on different parents: all start again from storage.
            newest = self._history.newest_readable()
            self._base.set(Parent(newest.step, newest) if newest is not None else None)
            log.error("checkpoint step %d failed on rank %d: %s", step, self._group.rank, exc)
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
            self._group.rank,
            result.bytes_written,
            result.bytes_logical,
            snapshot_s,
        )
        return self._retention.after_commit(result) if coordinator else result

    # ------------------------------------------------------------------ history

    def steps(self) -> list[int]:
        """Committed steps, oldest first: those visible under the newest generation's fence
        (a checkpoint an older, fenced-off generation wrote after the claim is not listed)."""
        return self._history.steps()

    @property
    def generation(self) -> int:
        """The fencing generation this store writes as: the one given or claimed, else the
        newest claimed in storage (0 when none was), fixed at first use."""
        if self._generation is None:
            fence = fencing.newest(self.storage)
            self._generation = fence.generation if fence is not None else 0
        return self._generation

    def claim_generation(self, minimum: int = 0) -> int:
        """Claim a new fencing generation for this writer: at least ``minimum`` (e.g. the
        launcher's restart count) and greater than every generation claimed or written in
        storage. Checkpoints that older generations write from now on are never visible, and
        their commits raise :class:`FencedError` (see :mod:`~lightning_incremental.core.fencing`).

        Call once per (re)start of a job, on the process that commits, before saving.

        Returns:
            The generation claimed.

        Raises:
            ConfigError: ``minimum`` is not an int >= 0.
            ManifestError: the newest fence record is malformed.
        """
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise ConfigError(f"minimum must be an int >= 0, got {minimum!r}")
        self._check_open()
        self.wait()
        with self._write_lock, self._history.lock:
            self._lease.acquire(self.generation, claiming=True)
            self._history.write_marker()
            self._generation = self._fencing.claim(minimum, self.steps)
            self._lease.acquire(self._generation)  # the record names the new generation
            return self._generation

    # ------------------------------------------------------------------ loading

    def load(
        self,
        step: int | None = None,
        *,
        map_location: MapLocation = None,
        strict: bool = False,
        into: Any = None,
        keys: str | Iterable[str] | None = None,
        strict_into: bool = True,
    ) -> dict[str, Any]:
        """Restore a checkpoint: bit-identical tensors (dtype, shape, bytes), same structure.

        Args:
            step: the step to load; None loads the newest committed checkpoint that verifies,
                falling back past corrupt ones with a warning naming what was bad.
            map_location: exactly ``torch.load``'s: None (the saved device), a device or
                device string, a ``{saved: target}`` dict, or a callable
                ``(cpu_storage, saved_location) -> storage`` whose None result means the saved
                device (see :func:`~lightning_incremental.core.materialise.place`).
            strict: with ``step=None``, raise on the newest checkpoint's corruption instead of
                falling back.
            into: a state (nested dicts/lists, e.g. ``{"model": model.state_dict()}``) whose
                tensors receive the checkpoint's values in place, matched by key path: decoded
                straight into their memory, without a second copy of the state. The returned
                state holds these very tensors (``map_location`` does not move them); tensors
                ``into`` lacks are returned as new ones. Shapes and dtypes are checked before
                anything is read.
            strict_into: False restores an ``into`` tensor of another shape or dtype as a new
                tensor instead of raising (for callers that report mismatches themselves, as
                ``load_state_dict`` does).
            keys: load only these top-level keys (e.g. ``"model"``): the objects of the others
                are not read. The returned dict holds just these keys.

        Raises:
            CheckpointNotFoundError: no store at the URL, an empty store, or a missing step.
            NotAStoreError: the location exists but is not a store.
            CorruptCheckpointError: the checkpoint (or with ``step=None`` every one) is corrupt.
            FormatVersionError: written by a newer version of this library.
            PickleNotAllowedError: it holds pickles and ``allow_pickle`` is off.
            ConfigError: a key of ``keys`` the checkpoint lacks; a tensor of ``into`` whose shape
                or dtype differs from the checkpoint's (naming its key).
            TypeError: ``keys`` is not a str or a list of str.

        Memory: the restore holds a bounded window of the checkpoint's objects at a time
        (``decoder.READ_AHEAD``), not the whole checkpoint; into ``into``'s host tensors it
        allocates nothing of the state's size. Every chunk is verified against its hash either
        way; a corrupt checkpoint may leave ``into``'s tensors partly overwritten (load another
        step into them, or the fallback does).

        Saves to the same location that this process started before the call (through this
        store or any other instance) are waited for first: a load sees them once committed.
        """
        inflight.wait(self.url)
        self._check_open()
        selection = Selection(check_keys(keys), into, strict_into)
        loaded = self._loader.load(step, map_location, selection, strict)
        if loaded.whole:  # every chunk verified: trusted, and a base the next save may build on
            self._history.trust(loaded.manifest.packs)
            self._adopt(loaded)
        self.loaded_step = loaded.step
        return loaded.state

    def _adopt(self, loaded: Loaded) -> None:
        """When the restored step is what the next save builds on (the newest committed one, no
        save pending), tell the delta base: a resumed job writes deltas from its first save
        on, their bases read from storage (``xor_base_from_storage``), not kept in memory."""
        with self._history.lock:
            if self._queue.pending():
                return
            self._initialise()
            if self._history.committed_last() != loaded.step:
                return
            self._base.adopt(loaded.step, loaded.manifest)
            self._history.committed = loaded.step

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of a committed checkpoint (default: the newest): its tensors,
        chunk recipes, statistics and audit trail (``.to_dict()``: its JSON). Read-only
        information for tools.

        Raises:
            CheckpointNotFoundError: empty store or missing step.
            CorruptCheckpointError: the manifest does not validate.
        """
        self._check_open()
        return self._history.read(self._history.resolve(step))

    # ------------------------------------------------------------------ maintenance

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check one checkpoint (default: the newest): read every object it needs, compare each
        object's size and content hash, decode every chunk and compare its hash.

        Raises:
            CheckpointNotFoundError: empty store or missing step.
        """
        self._check_open()
        step = self._history.resolve(step)
        report = VerifyReport(step=step)
        try:
            doc = self._history.read(step)
        except CheckpointError as exc:
            report.errors.append(str(exc))
        else:
            report.lossy = doc.lossy_tensors
            verify_manifest(self.storage, doc, report, f"step {step} of {self.url}")
        if not report.ok:
            self._history.saw_damage(step)
        return report

    def compact(self) -> SaveResult | None:
        """Rewrite the newest checkpoint as a full base (no chunk depends on a delta), so the
        checkpoints before it can be removed. Returns None when it already is one.

        A sharded checkpoint keeps its layout: every stored piece is rewritten as a piece of the
        same box, one at a time in this process (never gathered), so each rank's next save finds
        its own pieces as delta bases. Run it from one process while no distributed job saves
        to the store (e.g. ``lightning-incremental compact`` between runs): the ranks of a
        running job build on the checkpoint as they last saw it.

        Raises:
            CheckpointNotFoundError: empty store. CorruptCheckpointError: the newest is corrupt.
            ConfigError: a store opened with ``distributed=True`` (see above).
        """
        if self.distributed:
            raise ConfigError(
                f"compact {self.url} from one process while no distributed job saves to it "
                "(e.g. `lightning-incremental compact`), not from a store opened with "
                "distributed=True: the other ranks would build their next save on the "
                "checkpoint as it was before"
            )
        self.wait()
        with self._write_lock, self._history.lock:
            step = self._history.resolve(None)
            self._lease.acquire(self.generation)
            started = time.perf_counter()
            done = rewrite_as_base(self._committer, self._pool, step)
            if done is None:
                return None
            committed, part, leaves, before = done
            if committed.manifest.sharded:  # the ranks' pieces: bases read from storage
                self._base.set(Parent(step, committed.manifest), [x.data for x in leaves])
            else:
                self._base.committed(committed.manifest, leaves, part.tensors)
            result = save_result(
                [part], committed, previous=before, snapshot_s=0.0, wait_s=0.0, total_s=0.0
            )
            return dataclasses.replace(result, total_s=time.perf_counter() - started)

    def gc(
        self,
        keep_last: int | None = None,
        *,
        keep: Iterable[int] = (),
        grace_s: float = 0.0,
        dry_run: bool = False,
    ) -> GcReport:
        """Delete old checkpoints and every object no kept checkpoint needs.

        Args:
            keep_last: keep the newest ``keep_last`` checkpoints (None: keep every checkpoint
                and only remove unreferenced objects).
            keep: steps to keep in addition.
            grace_s: leave unreferenced objects younger than this many seconds (a save in
                another process may be about to reference them).
            dry_run: report what would be removed, remove nothing.

        Raises:
            ConfigError: bad arguments. CorruptCheckpointError: a kept manifest is unreadable
                (nothing is deleted then: the live set is unknown).
        """
        plan = Plan.for_gc(keep_last, keep, grace_s, dry_run)
        self.wait()
        with self._write_lock, self._history.lock:
            if plan.grace_s == 0 and not dry_run:
                # Without a grace period gc may remove what a running save is about to
                # reference: only the writer may do that.
                self._lease.acquire(self.generation)
            return self._collector.run(plan)

    def delete(self, step: int) -> GcReport:
        """Delete one committed checkpoint, then every object no remaining checkpoint needs.
        Later checkpoints never depend on it: each manifest names every object it needs.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed.
        """
        check_step_type(step)
        self.wait()
        with self._write_lock, self._history.lock:
            self._check_open()
            target = self._history.resolve(step)
            self._lease.acquire(self.generation)
            return self._collector.run(Plan(None, (), (target,), 0.0, False, thorough=False))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for pending saves, stop the background threads, raise any undelivered error.
        Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._queue.shutdown()
            self._pool.shutdown(wait=True)
            self._base.clear()
            self._lease.release()
            if isinstance(self._group, GlooGroup):
                self._group.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            log.exception("closing %s while handling another error also failed", self.url)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed; open a new CheckpointStore")

    def _initialise(self) -> None:
        """On first use: the newest committed checkpoint becomes the parent of the next save."""
        if self._initialised:
            return
        steps = self.steps()
        _ = self.generation  # fixed now: a later claim fences this writer off
        self._history.last_step = steps[-1] if steps else None
        newest = self._history.newest_readable(steps)
        self._base.set(Parent(newest.step, newest) if newest is not None else None)
        self._history.committed = newest.step if newest is not None else None
        self._initialised = True
