"""CheckpointStore: the engine's public entry point, a facade over the parts that own the work.

Its methods check their arguments and delegate to the parts :func:`.engine.assemble` wires
together: :mod:`.save.saver` (the body of a save, local or distributed), :mod:`.load.loader`
(restore with fallback), :mod:`.commit.history`, :mod:`.commit.fencing` (generations),
:mod:`.maintain.verify` (``verify``) and :class:`.maintain.retention.Maintainer` (``compact``,
``gc``, ``delete``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from lightning_incremental.core.commit.history import FORK_BASE, check_step_type, read_fork_base
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.engine import assemble
from lightning_incremental.core.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.load.loader import Selection
from lightning_incremental.core.load.materialise import MapLocation
from lightning_incremental.core.load.restore import check_keys
from lightning_incremental.core.maintain.pool import attach, fork
from lightning_incremental.core.maintain.retention import Plan
from lightning_incremental.core.maintain.verify import verify_step
from lightning_incremental.core.results import GcReport, SaveResult, VerifyReport
from lightning_incremental.core.save import inflight
from lightning_incremental.core.save.queue import SaveHandle, drain_at_exit
from lightning_incremental.core.storage import LocalStorage, Storage, open_storage

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
        pool: the URL of a shared object pool: the store keeps its data objects there (stores
            saving the same objects store them once) and its manifests, leases and fences at
            ``url``. Recorded at ``url``: the store reopens with or without it
            (:mod:`~lightning_incremental.core.maintain.pool`). ``pool_storage_options``
            open it (default: ``storage_options``).
        location_options: storage options by URL for the pool and the stores a fork reads
            objects from (default: ``pool_storage_options`` for the pool, ``storage_options``
            for the others): credentials per bucket.

    Raises:
        ConfigError: an invalid option, URL or protocol; ``distributed`` without an initialised
            process group.
        StorageError: the storage cannot be read: opening reads where the store keeps its
            objects (its pool or fork record), so an unreachable endpoint fails here.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Storage,
        *,
        storage_options: dict[str, Any] | None = None,
        config: StoreConfig | None = None,
        distributed: bool = False,
        collective_timeout_s: float = 600.0,
        pool: str | os.PathLike[str] | None = None,
        pool_storage_options: dict[str, Any] | None = None,
        location_options: dict[str, dict[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        if config is not None and not isinstance(config, StoreConfig):
            raise ConfigError(f"config must be a StoreConfig, got {type(config).__name__}")
        base = config or StoreConfig()
        self.config = base.replace(**options) if options else base
        self.storage = url if isinstance(url, Storage) else open_storage(url, storage_options)
        if isinstance(self.storage, LocalStorage):
            self.storage.fsync = self.config.fsync
        self.storage = attach(
            self.storage,
            pool,
            pool_options=pool_storage_options,
            options=storage_options,
            fsync=self.config.fsync,
            min_age_s=self.config.min_object_age_s,
            by_url=location_options,
        )
        self.url = self.storage.url
        if not isinstance(distributed, bool):
            raise ConfigError(f"distributed must be True or False, got {distributed!r}")
        self.distributed = distributed
        self._closed = False
        self.loaded_step: int | None = None  # the step the latest successful load returned
        self._engine = engine = assemble(
            self.storage,
            self.config,
            distributed=distributed,
            collective_timeout_s=collective_timeout_s,
        )
        # Released on close, or when this store is dropped without close (the finalizer holds
        # the lease, not the store; it may run inside garbage collection: see Lease.dropped).
        weakref.finalize(self, engine.lease.dropped)
        self._group, self._queue, self._pool = engine.group, engine.queue, engine.pool
        self._history, self._lease, self._fencing = engine.history, engine.lease, engine.fencing
        self._committer, self._retention = engine.committer, engine.retention
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
        return self._engine.saver.submit(state, step, audit, started)

    def wait(self) -> list[SaveResult]:
        """Wait for every pending save; returns their results, oldest first.

        Raises:
            Exception: the first error of a pending save that was not delivered yet.
        """
        return self._queue.wait()

    # ------------------------------------------------------------------ history

    def steps(self) -> list[int]:
        """Committed steps, oldest first: those visible under the newest generation's fence
        (a checkpoint an older, fenced-off generation wrote after the claim is not listed)."""
        return self._history.steps()

    @property
    def generation(self) -> int:
        """The fencing generation this store writes as: the one given or claimed, else the
        newest claimed in storage (0 when none was), fixed at first use."""
        return self._engine.generation.value

    def claim_generation(self, minimum: int = 0) -> int:
        """Claim a new fencing generation for this writer: at least ``minimum`` (e.g. the
        launcher's restart count), at least 1 (0 is the generation of writers that joined before
        any claim) and greater than every generation claimed or written in storage.
        Checkpoints that older generations write from now on are never visible, and their
        commits raise :class:`FencedError` (see :mod:`~lightning_incremental.core.commit.fencing`).

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
        return self._engine.claim(minimum)

    def acquire_writer(self, *, claim: int | None = None) -> int:
        """Check, before a run depends on it, that this process can write the store: take the
        writer lease (or confirm it holds it), then write and delete a small temporary object
        where the store writes (:mod:`~lightning_incremental.core.commit.writer`). The adapters
        call it when a run starts, on the process that commits (rank 0). ``claim``: claim a
        fencing generation of at least this first (:meth:`claim_generation`: a restarted job
        takes over from its previous incarnation); None claims nothing. Returns the generation
        this store writes as.

        Raises:
            WriterLeaseError: another process holds the lease (naming its host, pid and job,
                and what to do); nothing was written.
            StoreNotWritableError: the store cannot be written (naming the location and the
                storage's error); the lease is not kept.
            FencedError: this process was fenced off. ConfigError: a bad ``claim``.
        """
        if claim is not None and (
            isinstance(claim, bool) or not isinstance(claim, int) or claim < 0
        ):
            raise ConfigError(f"claim must be an int >= 0 or None, got {claim!r}")
        self._check_open()
        self.wait()
        return self._engine.acquire_writer(claim)

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
                device (see :func:`~lightning_incremental.core.load.materialise.place`).
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
            CheckpointNotFoundError: no store at the URL, an empty store, or a missing step
                (also one deleted by retention while it was read; with ``step=None`` the load
                goes on with the newest committed step instead, unless checkpoints keep
                vanishing faster than they are read).
            NotAStoreError: the location exists but is not a store.
            CorruptCheckpointError: the checkpoint (or with ``step=None`` every one) is corrupt.
            FormatVersionError: written by a newer version of this library.
            PickleNotAllowedError: it holds pickles and ``allow_pickle`` is off.
            ConfigError: a key of ``keys`` the checkpoint lacks; a tensor of ``into`` whose shape
                or dtype differs from the checkpoint's (naming its key); tensors of ``into``
                that share memory but would receive different checkpoint tensors.
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
        loaded = self._engine.loader.load(step, map_location, selection, strict)
        if loaded.whole:
            self._engine.saver.adopt(loaded.step, loaded.manifest)
        self.loaded_step = loaded.step
        return loaded.state

    def load_fork_base(
        self, *, keys: str | Iterable[str] | None = None, map_location: MapLocation = None
    ) -> dict[str, Any]:
        """Restore the step a fork of weights only was made from (``fork(..., as_base=True)``),
        its delta base: read through this store's copy of that step's manifest and from where
        its objects lie now, so it loads whatever became of the step in the source (deleted,
        collected, the source gone: the fork's pool or pin keeps the objects). ``keys`` and
        ``map_location`` as in :meth:`load`.

        Raises:
            CheckpointNotFoundError: this store holds no fork base (it is no fork of weights
                only, or the base went with its pin: ``unpin(..., force=True)``).
            CorruptCheckpointError: an object is missing or damaged.
        """
        self._check_open()
        doc = read_fork_base(self.storage)
        if doc is None:
            raise CheckpointNotFoundError(f"{self.url} holds no fork base ({FORK_BASE})")
        where = f"the fork base (step {doc.step} of its source) of {self.url}"
        selection = Selection(check_keys(keys))
        return self._engine.loader.restore(doc, where, map_location, selection).state

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
        return verify_step(self.storage, self._history, step)

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
        return self._engine.maintainer.compact()

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
                another process may be about to reference them). Objects younger than the
                store's ``min_object_age_s`` stay whatever it says.
            dry_run: report what would be removed, remove nothing.

        Raises:
            ConfigError: bad arguments. CorruptCheckpointError: a kept manifest is unreadable
                (nothing is deleted then: the live set is unknown).
            WriterLeaseError, FencedError: this store writes, and it lost the writer lease or
                a newer generation took over: it deletes nothing.
        """
        plan = Plan.for_gc(keep_last, keep, grace_s, dry_run)
        self.wait()
        return self._engine.maintainer.gc(plan)

    def delete(self, step: int) -> GcReport:
        """Delete one committed checkpoint, then every object no remaining checkpoint needs.
        Later checkpoints never depend on it: each manifest names every object it needs.
        Deleting the newest steps lets their steps be saved again (steps need only be newer
        than every step that remains).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed.
        """
        check_step_type(step)
        self.wait()
        self._check_open()
        return self._engine.maintainer.delete(step)

    @staticmethod
    def fork(src_url: str, dst_url: str, step: int | None = None, **options: Any) -> int:
        """Start a store at ``dst_url`` from checkpoint ``step`` (default: the newest) of
        ``src_url``, referencing its objects (those in another pool than the fork's are copied
        into its pool); returns the step. The source step is pinned (its retention keeps it and
        its objects) until :func:`unpin`.
        ``options``: those of :func:`~lightning_incremental.core.maintain.pool.fork`."""
        return fork(src_url, dst_url, step, **options)

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
            self._engine.shutdown()

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
