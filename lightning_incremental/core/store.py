"""CheckpointStore: the engine's public entry point."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from lightning_incremental.core import fencing, inflight, retention
from lightning_incremental.core import manifest as mf
from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.decoder import restore_arrays
from lightning_incremental.core.encoder import Encoded, Parent, encode, next_parent
from lightning_incremental.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FencedError,
    ManifestError,
    NotAStoreError,
    PickleNotAllowedError,
    StepError,
)
from lightning_incremental.core.lease import Lease
from lightning_incremental.core.maintenance import damaged_objects, verify_manifest
from lightning_incremental.core.materialise import MapLocation, materialise
from lightning_incremental.core.restore import (
    allocating,
    check_keys,
    finish_inplace,
    plan,
    prune,
)
from lightning_incremental.core.results import (
    GcReport,
    SaveHandle,
    SaveResult,
    VerifyReport,
)
from lightning_incremental.core.storage import LocalStorage, Storage, open_storage
from lightning_incremental.core.tree import Leaf, flatten, unflatten
from lightning_incremental.core.workers import WorkerPool

log = logging.getLogger("lightning_incremental")

# Saves still running when the interpreter exits must finish: Python stops thread pools from
# accepting work at shutdown, so the stores drain first. Hooks registered with
# threading._register_atexit run before concurrent.futures' own (they run in reverse order).
_OPEN_STORES: weakref.WeakSet[CheckpointStore] = weakref.WeakSet()


def _drain_at_exit() -> None:
    for store in list(_OPEN_STORES):
        try:
            store.close()
        except Exception as exc:  # the process is ending: say what was lost, loudly
            log.error("a checkpoint of %s failed while the process was exiting: %s", store.url, exc)


threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]


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

    Raises:
        ConfigError: an invalid option, URL or protocol.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Storage,
        *,
        storage_options: dict[str, Any] | None = None,
        config: StoreConfig | None = None,
        **options: Any,
    ) -> None:
        if config is not None and not isinstance(config, StoreConfig):
            raise ConfigError(f"config must be a StoreConfig, got {type(config).__name__}")
        self.config = (
            (config or StoreConfig()).replace(**options) if options else (config or StoreConfig())
        )
        self.storage = url if isinstance(url, Storage) else open_storage(url, storage_options)
        if isinstance(self.storage, LocalStorage):
            self.storage.fsync = self.config.fsync
        self.url = self.storage.url
        self._lock = threading.RLock()  # guards the history state below
        # Held while a save writes and commits, and while gc or compact deletes or rewrites:
        # objects a save is about to reference are never swept from under it.
        self._write_lock = threading.RLock()
        # Threads exist only while there is work (they end after a short idle time).
        self._pool = WorkerPool(self.config.workers, "li-worker")
        self._saver = WorkerPool(1, "li-save")
        self._slots = threading.BoundedSemaphore(self.config.max_in_flight)
        self._handles: list[SaveHandle] = []
        self._parent: Parent | None = None
        self._buffers = BufferPool()  # snapshot memory recycled from replaced XOR bases
        self._initialised = False
        self._last_step: int | None = None  # newest step saved or being saved
        self._committed: int | None = None  # newest step committed (and not known corrupt)
        self._quarantined: set[int] = set()
        self._marker_written = False
        self._closed = False
        self.loaded_step: int | None = None  # the step the latest successful load returned
        self._generation: int | None = self.config.generation  # None: joins the newest claim
        # A function of the storage, not a bound method: no reference cycle, so a store dropped
        # without close() is collected at once and its executors' threads end.
        self._fencing = fencing.Fencing(
            self.storage, functools.partial(read_manifest, self.storage)
        )
        # One writing process per store (lease.py); released on close, or when this store is
        # dropped without close (the finalizer holds the lease, not the store).
        self._lease = Lease(self.storage, self.config.lease_ttl_s)
        weakref.finalize(self, self._lease.release)
        # Objects this store wrote, or read back whole and found intact, since it last saw
        # damage: what a save may reuse by hash without reading it first.
        self._trusted: set[str] = set()
        _OPEN_STORES.add(self)

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
            state: a dict (any nesting of dict/list/tuple) of tensors and plain values.
            step: a non-negative int, greater than every step already saved in this store.
            metadata: plain JSON values recorded in the manifest's audit trail (e.g. loss).
            world_size: processes of the job this state comes from, for the audit trail.

        Raises:
            TypeError: ``state`` is not a dict.
            StepError: ``step`` is not an int, or not greater than the newest saved step.
            UnsupportedValueError: a value that needs pickling, naming its key path.
            Exception: the undelivered error of an earlier save (it is raised once).
        """
        started = time.perf_counter()
        self._check_open()
        self._raise_undelivered()
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict (e.g. {{'model': model.state_dict()}}), got "
                f"{type(state).__name__}"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        meta = mf.audit_record(mf.plain_json(metadata, "metadata"), world_size)
        with self._lock:
            self._initialise()
            self._check_step(step)
            self._last_step = step
        acquired = False
        try:
            self._slots.acquire()
            acquired = True
            waited = time.perf_counter() - started
            self._raise_undelivered()  # an earlier save may have failed while we waited
            skeleton, leaves, pickled = flatten(
                state, allow_pickle=self.config.allow_pickle, pool=self._buffers
            )
        except BaseException:
            if acquired:
                self._slots.release()
            self._rewind_last_step(step)
            raise
        handle = SaveHandle(step)
        snapshot_s = time.perf_counter() - started
        with self._lock:
            self._handles = [
                h for h in self._handles if not h.done() or (h._error and not h._delivered)
            ] + [handle]
        self._saver.submit(
            self._run_save, handle, skeleton, leaves, pickled, meta, started, snapshot_s, waited
        )
        inflight.track(self.url, handle._done)  # loads in this process wait for it
        return handle

    def wait(self) -> list[SaveResult]:
        """Wait for every pending save; returns their results, oldest first.

        Raises:
            Exception: the first error of a pending save that was not delivered yet.
        """
        with self._lock:
            handles = list(self._handles)
        results = []
        for handle in handles:
            handle._done.wait()
        self._raise_undelivered()
        for handle in handles:
            if handle._result is not None:
                results.append(handle._result)
        return results

    def _run_save(
        self,
        handle: SaveHandle,
        skeleton: Any,
        leaves: list[Leaf],
        pickled: list[str],
        meta: dict[str, Any],
        started: float,
        snapshot_s: float,
        waited: float,
    ) -> None:
        try:
            with self._write_lock:
                result = self._commit(
                    handle.step, skeleton, leaves, pickled, meta, started, snapshot_s, waited
                )
        except BaseException as exc:  # delivered through the handle, the next save and close
            with self._lock:
                # Buffers that became the next save's XOR base are not free, whatever failed.
                based = self._parent is not None and self._parent.step == handle.step
            if not based:
                self._buffers.give([leaf.data for leaf in leaves if not leaf.is_numpy])
            self._rewind_last_step(handle.step)
            log.error("checkpoint step %d failed: %s", handle.step, exc)
            handle._finish(None, exc)
        else:
            handle._finish(self._retain(result), None)
        finally:
            self._slots.release()

    def _commit(
        self,
        step: int,
        skeleton: Any,
        leaves: list[Leaf],
        pickled: list[str],
        meta: dict[str, Any],
        started: float,
        snapshot_s: float,
        waited: float,
    ) -> SaveResult:
        self._lease.acquire(self.generation)  # one writer per store
        self._write_marker()
        parent, full_base, enc = self._encode(step, leaves)
        body = {
            "format": mf.FORMAT,
            "version": mf.VERSION,
            "step": step,
            "parent": parent.step if parent else None,
            "generation": self.generation,
            "since_base": 0 if full_base else parent.manifest["since_base"] + 1,  # type: ignore[union-attr]
            "chunk_size": self.config.chunk_size,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "audit": meta,
            "pickled": pickled,
            "tree": skeleton,
            "tensors": enc.tensors,
            "chunks": enc.chunks,
            "packs": enc.packs,
        }
        bytes_logical = sum(t["nbytes"] for t in enc.tensors)
        body["stats"] = {
            "bytes_logical": bytes_logical,
            "bytes_data": enc.bytes_written,
            "chunks_total": enc.chunks_total,
            "chunks_reused": enc.chunks_reused,
            "chunks_delta": enc.chunks_delta,
            "chunks_full": enc.chunks_full,
            "full_base": full_base,
        }
        data = mf.dumps(body)
        write_start = time.perf_counter()
        self._fencing.check(step, self.generation, "not committed")  # before touching others'
        self._lease.check()
        self._unquarantine(step)
        if not self.storage.put(mf.manifest_path(step), data):
            self._fencing.check(step, self.generation, "not committed")  # a newer one holds it
            self._fencing.displace(step, self.steps)
            if not self.storage.put(mf.manifest_path(step), data):
                raise StepError(
                    f"step {step} is already committed in {self.url} (another writer saved it); "
                    "checkpoints are create-only — use a newer step"
                )
        # A claim that landed between the check above and the write makes this commit invisible
        # (the fence decides on every read); tell the writer. If the check itself cannot be
        # made, the step is committed all the same: that is a warning, not the save's error.
        unconfirmed: tuple[str, ...] = ()
        try:
            self._fencing.check(
                step, self.generation, "committed after it was fenced off, so it is not visible"
            )
        except FencedError:
            raise
        except Exception as exc:
            unconfirmed = (
                f"step {step} is committed, but whether a newer generation fenced this writer "
                f"off meanwhile could not be checked: {type(exc).__name__}: {exc}",
            )
            warnings.warn(unconfirmed[0], stacklevel=1)
            log.warning(unconfirmed[0])
        write_s = enc.write_s + time.perf_counter() - write_start
        with self._lock:
            self._set_parent(*next_parent(step, body, leaves, enc.tensors, self.config))
            self._committed = step
            self._trusted.update(enc.packs)  # written now, or read back and checked
        total_s = time.perf_counter() - started
        result = SaveResult(
            step=step,
            bytes_logical=bytes_logical,
            bytes_written=enc.bytes_written + len(data),
            snapshot_s=snapshot_s,
            wait_s=waited,
            encode_s=enc.encode_s,
            write_s=write_s,
            total_s=total_s,
            full_base=full_base,
            chunks_total=enc.chunks_total,
            chunks_reused=enc.chunks_reused,
            chunks_delta=enc.chunks_delta,
            chunks_full=enc.chunks_full,
            objects_written=sum(
                1 for p in enc.packs if p not in (parent.manifest["packs"] if parent else {})
            ),
            warnings=unconfirmed,
        )
        log.info(
            "checkpoint step %d committed: %d of %d bytes written (%.1fx), %.3fs blocked",
            step,
            result.bytes_written,
            bytes_logical,
            result.ratio,
            snapshot_s,
        )
        return result

    def _retain(self, result: SaveResult) -> SaveResult:
        """``keep_last`` retention after a commit. The checkpoint is committed whatever happens
        here: a failure is a warning (also in ``result.warnings``), never the save's error, and
        it leaves the next save's XOR base alone."""
        if self.config.keep_last is None:
            return result
        try:
            with self._write_lock, self._lock:
                self._gc(self.config.keep_last, (), 0.0, False, thorough=False)
        except Exception as exc:
            message = (
                f"retention after step {result.step} failed, nothing was deleted past the "
                f"failure and the checkpoint is committed: {type(exc).__name__}: {exc}"
            )
            warnings.warn(message, stacklevel=1)
            log.warning(message)
            return dataclasses.replace(result, warnings=(*result.warnings, message))
        return result

    # ------------------------------------------------------------------ loading

    def steps(self) -> list[int]:
        """Committed steps, oldest first: those visible under the newest generation's fence
        (a checkpoint an older, fenced-off generation wrote after the claim is not listed)."""
        return self._fencing.partition(self._written_steps())[0]

    def _written_steps(self) -> list[int]:
        """Every manifest in storage, visible or not, oldest first."""
        steps = []
        for path in self.storage.list(mf.MANIFEST_DIR):
            step = mf.step_of(path.rsplit("/", 1)[-1])
            if step is not None and path.count("/") == 1:
                steps.append(step)
        return sorted(steps)

    # ------------------------------------------------------------------ fencing

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
        with self._write_lock, self._lock:
            self._lease.acquire(self.generation, claiming=True)
            self._write_marker()
            self._generation = self._fencing.claim(minimum, self.steps)
            self._lease.acquire(self._generation)  # the record names the new generation
            return self._generation

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
        selection = Selection(check_keys(keys), into, strict_into)
        if step is not None:
            step = self._resolve_step(step)
            try:
                return self._load_step(step, map_location, selection)
            except CorruptCheckpointError:
                self._saw_damage(step)  # a new history may replace it
                raise
        newest = self._resolve_step(None)
        problems = []
        for candidate in reversed([s for s in self.steps() if s <= newest]):
            try:
                state = self._load_step(candidate, map_location, selection)
            except CorruptCheckpointError as exc:
                if strict:
                    self._saw_damage(candidate)
                    raise
                problems.append(str(exc))
                self._saw_damage(candidate)
                message = f"checkpoint step {candidate} in {self.url} is unusable: {exc}"
                log.warning(message)
                warnings.warn(message + " — falling back to an older checkpoint", stacklevel=2)
                continue
            if problems:
                log.warning(
                    "restored step %d after skipping %d corrupt checkpoint(s)",
                    candidate,
                    len(problems),
                )
            return state
        raise CorruptCheckpointError(
            f"no intact checkpoint in {self.url}; every committed one is corrupt:\n  "
            + "\n  ".join(problems)
        )

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """The validated manifest of a committed checkpoint (default: the newest): its tensors,
        chunk recipes, statistics and audit trail. Read-only information for tools.

        Raises:
            CheckpointNotFoundError: empty store or missing step.
            CorruptCheckpointError: the manifest does not validate.
        """
        step = self._resolve_step(step)
        return self._read_manifest(step)

    def _resolve_step(self, step: int | None) -> int:
        """``step``, or the newest committed one when None; checked to be committed."""
        self._check_open()
        if step is not None:
            _check_step_type(step)
        steps = self.steps()
        if not steps:
            self._raise_empty()
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at step {step} in {self.url}; committed steps: "
                f"{_summary(steps)}"
            )
        return step

    def _read_manifest(self, step: int) -> dict[str, Any]:
        return read_manifest(self.storage, step)

    def _load_step(
        self, step: int, map_location: MapLocation, selection: Selection | None = None
    ) -> dict[str, Any]:
        selection = selection or Selection(None, None, True)
        doc = self._read_manifest(step)
        where = f"step {step} of {self.url}"
        skeleton, wanted = prune(doc["tree"], selection.keys, where)
        if doc["pickled"] and not self.config.allow_pickle:
            raise PickleNotAllowedError(
                f"checkpoint {where} holds pickled objects at {', '.join(doc['pickled'][:5])}; "
                "loading them executes code — open the store with allow_pickle=True only if "
                "you trust this checkpoint"
            )
        destinations, targets = plan(doc, wanted, selection.into, where, strict=selection.strict)
        # No copy of the state is kept for the next save: it reads its XOR bases from storage
        # (StoreConfig.xor_base_from_storage), so a restore needs no memory beyond the state.
        restore_arrays(self.storage, doc, self._pool, where, targets)
        finish_inplace(destinations)
        values = [
            holder if mine or holder is None else materialise(holder, entry, map_location)
            for holder, mine, entry in zip(
                destinations.holders, destinations.inplace, doc["tensors"]
            )
        ]
        try:
            state = unflatten(skeleton, values, allow_pickle=self.config.allow_pickle)
        except PickleNotAllowedError as exc:
            raise PickleNotAllowedError(f"checkpoint {where}: {exc}") from exc
        except ManifestError as exc:
            raise ManifestError(f"manifest {where}: {exc}") from exc
        if not isinstance(state, dict):
            raise ManifestError(f"manifest {where}: the state is not a dict")
        if wanted is None:  # every chunk verified: trusted, and a parent to build on
            with self._lock:
                self._trusted.update(doc["packs"])
            self._adopt_loaded(step, doc)
        self.loaded_step = step
        return state

    def _adopt_loaded(self, step: int, doc: dict[str, Any]) -> None:
        """When ``step`` is what the next save builds on, make it the parent (unless it is
        already, with its bytes in memory): a resumed job writes deltas from its first save on,
        their bases read from storage (``xor_base_from_storage``), not kept in memory."""
        with self._lock:
            if any(not h.done() for h in self._handles):
                return
            self._initialise()
            if self._committed_last() != step:
                return
            if self._parent is None or self._parent.step != step:
                self._set_parent(Parent(step, doc), [])
            self._committed = step

    # ------------------------------------------------------------------ maintenance

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check one checkpoint (default: the newest): read every object it needs, compare each
        object's size and content hash, decode every chunk and compare its hash.

        Raises:
            CheckpointNotFoundError: empty store or missing step.
        """
        step = self._resolve_step(step)
        report = VerifyReport(step=step)
        try:
            doc = self._read_manifest(step)
        except CheckpointError as exc:
            report.errors.append(str(exc))
        else:
            verify_manifest(self.storage, doc, report, f"step {step} of {self.url}")
        if not report.ok:
            self._saw_damage(step)
        return report

    def compact(self) -> SaveResult | None:
        """Rewrite the newest checkpoint as a full base (no chunk depends on a delta), so the
        checkpoints before it can be removed. Returns None when it already is one.

        Raises:
            CheckpointNotFoundError: empty store. CorruptCheckpointError: the newest is corrupt.
        """
        self.wait()
        with self._write_lock, self._lock:
            steps = self.steps()
            if not steps:
                self._raise_empty()
            self._lease.acquire(self.generation)
            step = steps[-1]
            started = time.perf_counter()
            doc = self._read_manifest(step)
            if all(r["depth"] == 0 for r in doc["chunks"].values()):
                return None
            where = f"step {step} of {self.url}"
            try:
                buffers = [allocating(t, where, _flat_buffer)[1] for t in doc["tensors"]]
                restore_arrays(self.storage, doc, self._pool, where, list(buffers))
            except CorruptCheckpointError:
                self._saw_damage(step)
                raise
            leaves = [
                Leaf(
                    path=t["path"],
                    data=torch.from_numpy(raw),
                    dtype=t["dtype"],
                    shape=t["shape"],
                    device=t["device"],
                    width=t["width"],
                    is_numpy=t["numpy"],
                    parameter=t["param"],
                    requires_grad=t["requires_grad"],
                )
                for t, raw in zip(doc["tensors"], buffers)
            ]
            enc = encode(
                leaves,
                Parent(step, doc),
                full_base=True,
                config=self.config,
                storage=self.storage,
                pool=self._pool,
            )
            body = dict(
                doc,
                tensors=enc.tensors,
                chunks=enc.chunks,
                packs=enc.packs,
                since_base=0,
                chunk_size=self.config.chunk_size,  # what the chunks were cut with now
            )
            body["audit"] = dict(
                doc["audit"], compacted=datetime.datetime.now(datetime.timezone.utc).isoformat()
            )
            data = mf.dumps(body)
            self._lease.check()
            self.storage.put(mf.manifest_path(step), data, overwrite=True)
            self._set_parent(*next_parent(step, body, leaves, enc.tensors, self.config))
            self._trusted.update(enc.packs)
            elapsed = time.perf_counter() - started
            return SaveResult(
                step=step,
                bytes_logical=sum(t["nbytes"] for t in enc.tensors),
                bytes_written=enc.bytes_written + len(data),
                snapshot_s=0.0,
                wait_s=0.0,
                encode_s=enc.encode_s,
                write_s=enc.write_s,
                total_s=elapsed,
                full_base=True,
                chunks_total=enc.chunks_total,
                chunks_reused=enc.chunks_reused,
                chunks_delta=0,
                chunks_full=enc.chunks_full,
                objects_written=len(set(enc.packs) - set(doc["packs"])),
            )

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
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        keep = tuple(keep)
        for step in keep:
            _check_step_type(step)
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
            raise ConfigError(f"grace_s must be a number >= 0, got {grace_s!r}")
        self.wait()
        with self._write_lock, self._lock:
            if grace_s == 0 and not dry_run:
                # Without a grace period gc may remove what a running save is about to
                # reference: only the writer may do that.
                self._lease.acquire(self.generation)
            return self._gc(keep_last, keep, float(grace_s), dry_run, thorough=True)

    def delete(self, step: int) -> GcReport:
        """Delete one committed checkpoint, then every object no remaining checkpoint needs.
        Later checkpoints never depend on it: each manifest names every object it needs.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed.
        """
        _check_step_type(step)
        self.wait()
        with self._write_lock, self._lock:
            target = self._resolve_step(step)
            self._lease.acquire(self.generation)
            return self._gc(None, (), 0.0, False, drop=(target,), thorough=False)

    def _gc(
        self,
        keep_last: int | None,
        keep: tuple[int, ...],
        grace_s: float,
        dry_run: bool,
        drop: tuple[int, ...] = (),
        *,
        thorough: bool,
    ) -> GcReport:
        # What the next save builds on stays, even if its checkpoint goes.
        pinned = set(self._parent.manifest["packs"]) if self._parent else set()
        report = retention.collect(
            retention.Plan(keep_last, keep, drop, grace_s, dry_run, thorough),
            storage=self.storage,
            fence=self._fencing,
            written=self._written_steps(),
            read=self._read_manifest,
            intact=self._intact,
            pinned=pinned,
        )
        parent = self._parent
        if not dry_run and parent is not None and parent.step in report.removed_steps:
            # Its objects are pinned by this call only: another process's gc may collect them at
            # any time, so the next save must not name them. It writes a full base.
            self._set_parent(None, [])
        return report

    def _intact(self, step: int, doc: dict[str, Any], thorough: bool) -> bool:
        """Whether checkpoint ``step`` (manifest ``doc``) restores, for retention. Thorough:
        read and check everything (``verify``). Otherwise: not known damaged, and every object
        it names was written or checked by this store (objects it does not know are read back
        whole and checked now)."""
        if thorough:
            report = verify_manifest(self.storage, doc, VerifyReport(step=step), f"step {step}")
            if not report.ok:
                self._saw_damage(step)
            return report.ok
        with self._lock:
            if step in self._quarantined:
                return False
            unknown = set(doc["packs"]) - self._trusted
        bad = damaged_objects(self.storage, {p: doc["packs"][p] for p in unknown})
        if bad:
            self._saw_damage(step)
            return False
        with self._lock:
            self._trusted.update(unknown)
        return True

    def _saw_damage(self, step: int | None = None) -> None:
        """Corruption was found: stop trusting objects unread since (the next save reads back
        what it reuses), and let a new history replace ``step``."""
        with self._lock:
            self._trusted.clear()
            if step is not None:
                self._quarantined.add(step)

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
            self._saver.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._parent = None
            self._buffers.clear()
            self._lease.release()

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

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed; open a new CheckpointStore")

    def _raise_undelivered(self) -> None:
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            error = handle._undelivered_error()
            if error is not None:
                raise error

    def _initialise(self) -> None:
        """On first use: the newest committed checkpoint becomes the parent of the next save."""
        if self._initialised:
            return
        steps = self.steps()
        _ = self.generation  # fixed now: a later claim fences this writer off
        self._last_step = steps[-1] if steps else None
        self._parent = self._newest_readable(steps)
        self._committed = self._parent.step if self._parent else None
        self._initialised = True

    def _newest_readable(self, steps: list[int]) -> Parent | None:
        for step in reversed(steps):
            try:
                return Parent(step, self._read_manifest(step))
            except CheckpointError as exc:
                log.warning("not building on checkpoint step %d: %s", step, exc)
                self._quarantined.add(step)
        return None

    def _encode(self, step: int, leaves: list[Leaf]) -> tuple[Parent | None, bool, Encoded]:
        """Encode and write a save's data on top of the parent; returns the parent used, whether
        this is a full base, and the encoding, once everything it names is durable.

        Chunks are reused by hash from the parent only while their objects are known intact:
        an object this store neither wrote nor checked since it last saw damage is read back
        whole and checked first; the chunks of a damaged one are encoded again from the state.
        """
        parent = self._parent
        full_base = parent is None or parent.manifest["since_base"] + 1 >= self.config.base_every
        avoid: set[str] = set()
        reloaded = False
        while True:
            enc = encode(
                leaves,
                parent,
                full_base=full_base,
                config=self.config,
                storage=self.storage,
                pool=self._pool,
                avoid=avoid,
            )
            adopted = {p: enc.packs[p] for p in set(enc.packs) - enc.written}
            vanished = sorted(p for p in adopted if not self.storage.exists(p))
            if vanished:
                if reloaded:
                    raise CorruptCheckpointError(
                        f"step {step} not committed: objects it would reuse are missing from "
                        f"{self.url} ({', '.join(vanished[:3])}); another process is deleting "
                        "objects of this store — give gc a grace period (grace_s) while "
                        "training runs"
                    )
                # Another process compacted and collected this store since our parent was
                # read: build on what is committed now, as a full base, not on what is gone.
                log.warning(
                    "objects of checkpoint step %s vanished (%s): another process ran gc or "
                    "compact on %s; writing step %d as a full base",
                    parent.step if parent else None,
                    ", ".join(vanished[:3]),
                    self.url,
                    step,
                )
                parent, full_base, avoid, reloaded = self._reload_parent(), True, set(), True
                continue
            with self._lock:
                unknown = {p: info for p, info in adopted.items() if p not in self._trusted}
            damaged = damaged_objects(self.storage, unknown)
            if not damaged:
                with self._lock:
                    self._trusted.update(unknown)
                return parent, full_base, enc
            log.warning(
                "step %d: objects it would reuse are damaged (%s); encoding their chunks again "
                "from the state being saved",
                step,
                ", ".join(sorted(damaged)[:3]),
            )
            self._saw_damage()
            avoid |= damaged

    def _reload_parent(self) -> Parent | None:
        """The newest committed checkpoint, read afresh from storage (no XOR base)."""
        with self._lock:
            parent = self._newest_readable(self.steps())
            self._set_parent(parent, [])
            return parent

    def _set_parent(self, parent: Parent | None, spare: list[torch.Tensor]) -> None:
        """Make ``parent`` the base of the next save; recycle the buffers no longer needed."""
        with self._lock:
            old, self._parent = self._parent, parent
            self._buffers.give(spare + (old.buffers if old is not None else []))

    def _rewind_last_step(self, failed: int) -> None:
        """A save of ``failed`` did not commit: the newest step is again the newest committed or
        still pending one."""
        with self._lock:
            pending = [h.step for h in self._handles if not h.done() and h.step != failed]
            known = [s for s in (self._committed, *pending) if s is not None]
            self._last_step = max(known) if known else None

    def _committed_last(self) -> int | None:
        steps = [s for s in self.steps() if s not in self._quarantined]
        return steps[-1] if steps else None

    def _check_step(self, step: Any) -> None:
        _check_step_type(step)
        last = self._last_step
        if last is not None and last in self._quarantined:
            last = self._committed_last()
        if last is not None and step <= last:
            raise StepError(
                f"step {step} is not newer than step {last}, already saved in {self.url}. "
                "Steps must increase: checkpoints are immutable. Resume from the newest "
                "checkpoint, or save to a new location to start a separate history."
            )

    def _unquarantine(self, step: int) -> None:
        """Move corrupt checkpoints at or after ``step`` out of the way of the new history."""
        with self._lock:
            stale = sorted(s for s in self._quarantined if s >= step)
        for old in stale:
            source = mf.manifest_path(old)
            try:
                data = self.storage.get(source)
            except FileNotFoundError:
                data = None
            if data is not None:
                self.storage.put(f"{mf.QUARANTINE_DIR}/{old:020d}.json", data, overwrite=True)
                self.storage.delete(source)
                log.warning("moved corrupt checkpoint step %d to %s/", old, mf.QUARANTINE_DIR)
            with self._lock:
                self._quarantined.discard(old)

    def _write_marker(self) -> None:
        if not self._marker_written:
            self.storage.put(mf.MARKER, mf.marker_bytes())
            self._marker_written = True

    def _raise_empty(self) -> None:
        try:
            marker = self.storage.get(mf.MARKER)
        except FileNotFoundError:
            marker = None
        if marker is not None:
            mf.check_marker(marker, f"{self.url}/{mf.MARKER}")
            raise CheckpointNotFoundError(f"the store {self.url} holds no committed checkpoint yet")
        if self.storage.exists(""):
            raise NotAStoreError(
                f"{self.url} exists but is not a lightning-incremental checkpoint store (it has "
                f"no {mf.MARKER} and no manifests); pass the location checkpoints were saved to"
            )
        raise CheckpointNotFoundError(f"there is no checkpoint store at {self.url}")


@dataclass(frozen=True)
class Selection:
    """What a ``load`` restores: top-level ``keys`` (None: all), ``into`` the caller's tensors."""

    keys: tuple[str, ...] | None
    into: Any
    strict: bool


def read_manifest(storage: Storage, step: int) -> dict[str, Any]:
    """The validated manifest of ``step``.

    Raises:
        CheckpointNotFoundError: there is none. CorruptCheckpointError: it does not validate.
    """
    where = f"step {step} of {storage.url}"
    try:
        data = storage.get(mf.manifest_path(step))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint {where} does not exist") from exc
    doc = mf.loads(data, where)
    if doc["step"] != step:
        raise ManifestError(f"manifest {where} records step {doc['step']}")
    return doc


def _check_step_type(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise StepError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise StepError(f"step must be >= 0, got {step}")
    if step > mf.MAX_STEP:
        raise StepError(
            f"step must be < 10**20 (manifest names hold 20 digits), got {step}; count steps "
            "from 0 (the global step, a sample count)"
        )


def _flat_buffer(entry: dict[str, Any]) -> tuple[None, np.ndarray]:
    return None, np.empty(entry["nbytes"], np.uint8)


def _summary(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"
