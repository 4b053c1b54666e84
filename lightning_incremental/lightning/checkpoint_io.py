"""IncrementalCheckpointIO: a Lightning ``CheckpointIO`` that saves through the engine.

``Trainer(plugins=[IncrementalCheckpointIO()])`` makes every ``trainer.save_checkpoint`` —
ModelCheckpoint's top-k, ``save_last`` and periodic saves included — incremental, with no other
change to the user's code.

How it works, one module per job
--------------------------------
Each path Lightning saves to stays a real file: a small *pointer file* naming a step of the
engine store in the hidden sub-directory ``<dir>/.incremental`` (``store_name``), written as soon
as the state is snapshotted, the step committing in the background. The pointer files' lifecycle
(which step a save takes, what it replaces, when a step no longer named is released) is
:mod:`~.pointer_lifecycle`; what a path given to ``load_checkpoint`` means (a plain ``torch.save``
file, a store directory, a pointer, or the step it replaced when that one never committed), and
why a load is collective under DDP, is :mod:`~.path_resolution`; the background saves and
removals, their order and how their errors are delivered are :mod:`~.background_jobs`; what a
removal deletes, and the stores closed after a read, :mod:`~.removal`; plain ``torch.save`` files
(``materialize``) :mod:`~.materialize`. This class maps ``CheckpointIO``'s methods to them.

``trainer.save_checkpoint`` called outside of a running stage (after ``fit``) is synchronous: it
returns once the checkpoint committed (raising if it failed), as callers of ``save_checkpoint``
rely on, and closes the stores. ``teardown`` (Lightning calls it at the end of every
``fit/validate/test/predict``) waits for every pending save to commit and closes the stores; the
plug-in reopens them on next use.

What is covered
---------------
Strategies that save one full checkpoint on global rank 0 through a ``CheckpointIO`` (single
device, DDP and its launchers); not DeepSpeed, FSDP, ``ModelParallelStrategy``, which checkpoint
by themselves (see :mod:`~.sharded`; the ``IncrementalCheckpoint`` callback covers them).

Storage options and pickles
---------------------------
fsspec ``storage_options`` (credentials, endpoint) are given once, at construction, and used
for stores and pointer files. Passing them per call (``trainer.save_checkpoint(...,
storage_options=...)``) raises ``TypeError``, as ``TorchCheckpointIO`` does, rather than being
ignored. Checkpoints hold data only and load without executing code; a value that needs pickle
(e.g. an ``argparse.Namespace`` in ``hyper_parameters``) is an error naming its key, unless
``allow_pickle=True``.

One writer per directory: Lightning gives a ``CheckpointIO`` no call when ``fit`` starts, so the
first save into a directory (in each ``fit``) is the plug-in's start there: before it writes
anything it checks that it can write the store (:meth:`.pointer_lifecycle.OpenStore.
start_saving`); loading needs no lease. The plug-in saves in the background itself: wrapped in
Lightning's ``AsyncCheckpointIO``, its calls raise ``ConfigError``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from collections import deque
from dataclasses import replace
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_incremental.core import CheckpointStore, StoreConfig
from lightning_incremental.lightning import pointer_lifecycle
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.lightning.background_jobs import BackgroundJobs, raise_first
from lightning_incremental.lightning.compat import (
    PathLike,
    refuse_wrapping,
    saving_trainer,
    strategy_fitted,
    tearing_down_strategy,
    torch_load_checkpoint,
    trainer_stage_running,
)
from lightning_incremental.lightning.materialize import materialize, materialize_option
from lightning_incremental.lightning.path_resolution import (
    TO_CPU,
    Plan,
    load_from_store,
    resolve,
    to_cpu,
)
from lightning_incremental.lightning.plugin_arguments import check_plugin_arguments
from lightning_incremental.lightning.pointer_lifecycle import OpenStore
from lightning_incremental.lightning.pointers import (
    CheckpointFile,
    NotATorchCheckpointError,
    Pointer,
    PointerError,
)
from lightning_incremental.lightning.removal import close_unsaved, remove_step, take_pointer
from lightning_incremental.lightning.trainer import marks_of
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.cluster.coordinate import Outcome, coordinated
from lightning_incremental.runtime.policy.backpressure import wait_for_room
from lightning_incremental.runtime.policy.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    FailurePolicy,
    check_max_consecutive_failures,
)

log = logging.getLogger(__name__)
HPC_PREFIX = "hpc_ckpt_"  # the files Lightning's SLURM requeue handler saves (hpc_save_path)

# not pickled
_RUNTIME = (
    "_lock",
    "_stores",
    "_background",
    "_failures",
    "_marks",
    "_saved_in_stage",
    "_warned_strategy",
)

__all__ = ["IncrementalCheckpointIO", "NotATorchCheckpointError", "PointerError"]


class IncrementalCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing incremental, verified checkpoints through the engine.

    ``Trainer(plugins=[IncrementalCheckpointIO()])``: ModelCheckpoint and
    ``trainer.save_checkpoint`` keep their paths; each path becomes a small pointer file and the
    data goes to one :class:`~lightning_incremental.core.CheckpointStore` per directory, in
    ``<dir>/<store_name>``. See the module documentation for the mapping and what is covered.

    Args:
        storage_options: fsspec options (credentials, endpoint, ...) for checkpoint paths that
            are URLs (``s3://...``); used for the stores and the pointer files.
        allow_pickle: save values that only pickle can hold (and load checkpoints holding them).
            Loading a pickle executes code: only for checkpoints every reader trusts.
        store_name: name of the store directory created next to the checkpoint files.
        max_consecutive_failures: a save that fails to commit in the background (storage error,
            full disk) is logged and warned about (naming the path, the step, the store and the
            error) at the plug-in's next call, and training goes on from the previous
            checkpoint. This many failed saves in a row raise ``CheckpointError`` instead; a
            committed save resets the count. 1: stop at the first failure.
        materialize: also write real ``torch.save`` files, for tools that read ``.ckpt`` files
            themselves: ``True`` (or ``("best", "last")``), ``"best"`` or ``"last"``. When fit
            ends (at the plug-in's ``teardown``), the file at ModelCheckpoint's
            ``best_model_path`` / ``last_model_path`` (of every ModelCheckpoint) is replaced by
            the complete checkpoint (tensors on the CPU), and its step is released from the
            store unless another pointer file names it. Default ``False``: pointer files only.
        optimizer_state: ``"exact"`` (default: lossless, restored bit-exact), ``"bf16"`` or
            ``"int8"``: optimizer moments (``exp_avg``, ``exp_avg_sq``) stored quantized; a
            checkpoint loaded from them is not bit-exact (see
            :mod:`lightning_incremental.core.codecs.optimizer_state`). Weights stay lossless.
        **options: :class:`~lightning_incremental.core.StoreConfig` fields (``chunk_size``,
            ``full_every``, ``xor_base_memory``, ``max_in_flight``, ``fsync``, ...).
            ``keep_last`` is not accepted: what is kept is decided by ModelCheckpoint's
            ``save_top_k``, through ``remove_checkpoint``.

    Raises:
        TypeError: ``storage_options`` is not a dict or None, ``max_consecutive_failures`` not
            an int.
        ConfigError: an invalid option, ``store_name``, ``max_consecutive_failures`` or
            ``materialize``.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        store_name: str = ".incremental",
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        materialize: bool | str | tuple[str, ...] | list[str] = False,
        optimizer_state: str = "exact",
        **options: Any,
    ) -> None:
        super().__init__()
        check_plugin_arguments(storage_options, store_name, allow_pickle, options)
        self.materialize = materialize_option(materialize)
        self.storage_options = dict(storage_options) if storage_options else None
        self.allow_pickle = allow_pickle
        self.store_name = store_name
        self.max_consecutive_failures = check_max_consecutive_failures(max_consecutive_failures)
        self.config = StoreConfig(
            allow_pickle=allow_pickle, optimizer_state=optimizer_state
        ).replace(**options)
        self._init_runtime()

    def _init_runtime(self) -> None:  # the names are listed in _RUNTIME
        self._lock = threading.Lock()
        self._stores: dict[str, OpenStore] = {}
        self._background = BackgroundJobs()
        self._failures = FailurePolicy(
            "IncrementalCheckpointIO", None, self.max_consecutive_failures
        )
        # ModelCheckpoint's best/last paths as of the newest save, per ModelCheckpoint
        self._marks: dict[str, dict[str, str]] = {}
        self._saved_in_stage = False  # a save reached the plug-in since the last teardown
        self._warned_strategy = False  # the full-state strategy warning was given

    # ------------------------------------------------------------------ CheckpointIO

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` into the directory's store and write its pointer file at
        ``path`` (naming the new step, and the replaced one as ``previous``); the step commits
        in the background, then the replaced step is released.

        Called by ``Trainer.save_checkpoint`` outside of a running ``fit/validate/test/predict``
        (after ``fit``, say), it returns only once the checkpoint committed, and leaves no
        thread running: what the caller does next (another Trainer loading it, another process
        reading it, the script ending) finds it complete.

        Raises:
            TypeError: ``storage_options`` were passed (give them to the constructor).
            WriterLeaseError, StoreNotWritableError: at the first save into the directory.
            UnsupportedValueError: a value that needs pickle, without ``allow_pickle``.
            CheckpointError: outside of a running stage, the save failed to commit (the error's
                own type when it is one, e.g. ``StorageError``).
            Exception: the error of an earlier background save, not delivered yet.
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                "IncrementalCheckpointIO: pass fsspec options once, as "
                "IncrementalCheckpointIO(storage_options=...)"
            )
        refuse_wrapping(self)
        self._saved_in_stage = True
        self._warn_strategy()
        target = self._file(path)
        if self.store_name in target.parts:
            raise ValueError(
                f"cannot save a checkpoint file inside the store directory {self.store_name!r} "
                f"({target.display}); save it next to the store"
            )
        entry = self._store(target.store_url(self.store_name), saving=True)
        target.makedirs()  # at once, as TorchCheckpointIO: the file itself comes later
        # Back-pressure, as the engine's (max_in_flight): the oldest saves must finish first,
        # and commit, so that their errors are raised here, before this save.
        wait_for_room(entry.saving, self.config.max_in_flight)
        entry.saving = deque(job for job in entry.saving if not job.done())
        self._raise_failed()
        pointer, handle = pointer_lifecycle.snapshot(checkpoint, target, entry, self.store_name)
        step = pointer.step
        # The snapshot is taken: write the pointer now, naming the reserved step and the step of
        # the pointer it replaces, so that the path exists when this returns (ModelCheckpoint's
        # version counter and ``save_last="link"`` look for it at once).
        try:
            old_bytes, previous = pointer_lifecycle.replaced(target, entry, self.store_name)
            pointer = replace(
                pointer,
                previous=None if previous is None else previous[0],
                previous_id=None if previous is None else previous[1],
            )
            target.write_atomic(pointer.dumps(), fsync=self.config.fsync)
        except BaseException:
            # the step still commits, without a name (as after a crash before the pointer)
            job = self._background.submit(
                lambda: entry.finish_unnamed(handle, step), "saving", track=entry.store_url
            )
            entry.saving.append(job)
            raise

        finish, failure = pointer_lifecycle.finisher(
            handle, target, entry, pointer, old_bytes, self._restore, self._failures
        )
        job = self._background.submit(finish, f"saving {target.display}", track=entry.store_url)
        entry.saving.append(job)
        self._background.set_pending(target.key, job)
        with self._lock:
            self._marks.update(marks_of(checkpoint))
        if trainer_stage_running() is False:  # wait for the commit, raise its failure
            what = f"{target.display} (step {step} of {entry.store.url})"
            pointer_lifecycle.finish_now(job, failure, what, self._failures, self.close)
        elif target.name.startswith(HPC_PREFIX):
            # Lightning's SLURM requeue handler runs `scontrol requeue` right after this save:
            # it must have committed by then, or a kill right after the requeue loses it.
            job.exception()  # its failure is reported as any background save's

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Any | None = TO_CPU,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The complete checkpoint dict saved at ``path`` (bit-identical tensors).

        A save to the same store that this process started (through this plug-in or any other
        instance: the ``Trainer`` that just saved it) is waited for first.

        Args:
            path: a pointer file written by this plug-in, a plain ``torch.save`` checkpoint, or
                a store directory (its newest committed checkpoint).
            map_location: exactly ``torch.load``'s (None: the device each tensor was saved on;
                a device or str; a ``{saved: target}`` dict; a callable ``(storage, location)``
                returning a storage, or None for the saved device). Not given: every tensor on
                the CPU, as Lightning's ``TorchCheckpointIO`` by default.
            weights_only: ``True`` refuses pickled values even with ``allow_pickle``; passed
                through for plain ``torch.save`` files.

        Collective under DDP (``torch.distributed`` initialised, world size > 1): every rank
        must call it; global rank 0 decides what is loaded and the other ranks load the same.
        When rank 0 fails, it raises its own error and the other ranks ``CoordinatorError``
        naming it.

        Raises:
            FileNotFoundError: no file at ``path`` (``CheckpointNotFoundError`` when a pointer
                names a step that is not committed and has no committed ``previous``, or the
                store is missing or empty; its message says whether the step is not committed
                yet — its writer is still running — or its writer died or failed).
            PointerError: a malformed pointer, or one naming a store outside its directory.
            PickleNotAllowedError: the checkpoint holds pickles and they are not allowed.
            CorruptCheckpointError: the checkpoint cannot be restored bit-exactly.
        """
        refuse_wrapping(self)
        try:
            return self._load(path, map_location, weights_only)
        finally:  # a store only read here (ddp_spawn's main process) keeps no thread nor lease
            close_unsaved(self._lock, self._stores)

    def _load(self, path: PathLike, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        if not collectives.is_distributed():
            self.wait()
            return self._execute(
                resolve(path, self._linked_file, self._store_of), map_location, weights_only
            )[0]
        # Collective under DDP: only global rank 0 saves, so only it knows which saves are in
        # flight; it resolves what to load and every rank loads exactly that.
        coordinator = collectives.rank() == 0
        loaded: dict[str, Any] | None = None

        def decide() -> Plan:
            nonlocal loaded
            self.wait()
            plan = resolve(path, self._linked_file, self._store_of)
            if plan.step is None and plan.kind == "store":  # newest: fix the exact step
                loaded, step = self._execute(plan, map_location, weights_only)
                plan = plan._replace(step=step)
            return plan

        own = Outcome() if coordinator else Outcome.of(self.wait)  # raised after the collective
        plan = coordinated(decide, what=f"load {path}", is_coordinator=coordinator)
        own.result((None, None), what=f"load {path}")
        if loaded is not None:
            return loaded
        return self._execute(plan, map_location, weights_only)[0]

    @override
    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the file at ``path``, then its step unless another pointer file in the
        directory names it (what goes, ``min_object_age_s``, and when the store directory goes
        too: :mod:`~.removal`): in the background for a store this process saves to, else now,
        closing the store. A link is only unlinked, a ``torch.save`` file removed as
        ``TorchCheckpointIO`` would.

        Raises:
            Exception: the error of an earlier background save, not delivered yet.
        """
        refuse_wrapping(self)
        target = self._file(path)
        pending = self._background.pending(target.key)
        if pending is not None:
            pending.exception()  # its step must commit (or the old pointer be put back) first
        self._raise_failed()
        pointer = take_pointer(target)
        if pointer is None:
            return
        entry = self._store(target.store_url(pointer.store))
        if entry.saves:  # in the background, after this process's saves to that store
            removed = functools.partial(remove_step, target, entry, pointer, last=False)
            self._background.submit(removed, f"removing {target.display}")
            return
        try:  # a store only read or removed from here (ddp_spawn's main process): now
            remove_step(target, entry, pointer, last=True)
        finally:
            close_unsaved(self._lock, self._stores)

    @override
    def teardown(self) -> None:
        """Wait for every pending save to commit; with ``materialize``, write the best/last
        checkpoints as plain files; then :meth:`close`. Lightning calls it at the end of every
        ``fit/validate/test/predict``.

        Raises:
            Exception: the first background error (the others are logged).
        """
        strategy = tearing_down_strategy()
        if (
            strategy is not None
            and not self._saved_in_stage
            and _sharded.bypasses_checkpoint_io(strategy)
            and strategy_fitted(strategy)
        ):
            rank_zero_warn(_sharded.plugin_unused_warning(strategy))
        self._saved_in_stage = False
        errors: list[BaseException] = []
        try:
            self.wait()
            if self.materialize:
                self._materialize()
        except BaseException as exc:
            errors.append(exc)
        try:
            self.close()
        except BaseException as exc:
            errors.append(exc)
        raise_first(errors, "during teardown")

    def close(self) -> None:
        """Wait for every pending save to commit, close the stores and end the plug-in's
        threads (the plug-in reopens them on next use), then raise the first background error
        not delivered yet.

        Raises:
            Exception: the first background error (the others are logged).
        """
        errors: list[BaseException] = []
        try:
            self.wait()
        except BaseException as exc:
            errors.append(exc)
        errors.extend(self._background.undelivered())
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        self._background.shutdown()
        for entry in stores:
            try:
                entry.store.close()
            except BaseException as exc:
                errors.append(exc)
        raise_first(errors, "while closing")

    # ------------------------------------------------------------------ public helpers

    def wait(self) -> None:
        """Block until every background save committed (and released the step it replaced).

        Raises:
            Exception: the first background error not delivered yet.
        """
        self._background.wait()
        self._raise_failed()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` sends the Trainer to its workers): without open stores,
        threads and pending work, which the copy recreates on use."""
        self.wait()  # what is sent must not depend on saves still in flight
        state = dict(self.__dict__)
        for name in _RUNTIME:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return f"IncrementalCheckpointIO(store_name={self.store_name!r})"

    # ------------------------------------------------------------------ internals

    def _warn_strategy(self) -> None:
        """Once: a sharded strategy's full-state mode saves here but loads without the
        plug-in (see :func:`lightning_incremental.lightning.sharded.plugin_save_warning`)."""
        trainer = saving_trainer()
        if self._warned_strategy or trainer is None:
            return
        message = _sharded.plugin_save_warning(trainer.strategy, self.materialize)
        if message is not None:
            self._warned_strategy = True
            warnings.warn(message, UserWarning, stacklevel=3)

    def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
        """The engine store at ``url`` (an extension point, e.g. for instrumented storage)."""
        return CheckpointStore(url, storage_options=self.storage_options, config=config)

    def _store(self, url: str, *, saving: bool = False) -> OpenStore:
        with self._lock:
            entry = self._stores.get(url)
            if entry is None:
                entry = OpenStore(self._open_store(url, self.config), url)
                self._stores[url] = entry
        if saving:  # its first save checks that it can write the store (the plug-in's start)
            entry.start_saving()
        return entry

    def _file(self, path: PathLike, *, resolve: bool = False) -> CheckpointFile:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"a checkpoint path must be a str or path, got {type(path).__name__}")
        return CheckpointFile.of(os.fspath(path), self.storage_options, resolve=resolve)

    def _execute(
        self, plan: Plan, map_location: Any, weights_only: bool | None
    ) -> tuple[dict[str, Any], int | None]:
        """Load what :func:`~.path_resolution.resolve` decided; also returns the step loaded."""
        if plan.kind == "torch":
            state = torch_load_checkpoint(
                plan.location, to_cpu if map_location is TO_CPU else map_location, weights_only
            )
            return state, None
        return load_from_store(
            plan,
            "cpu" if map_location is TO_CPU else map_location,
            weights_only,
            store_of=self._store_of,
            open_reader=lambda url: self._open_store(url, self.config.replace(allow_pickle=False)),
            allow_pickle=self.allow_pickle,
        )

    def _store_of(self, url: str) -> CheckpointStore:
        return self._store(url).store

    def _linked_file(self, path: PathLike) -> CheckpointFile:
        return self._file(path, resolve=True)  # save_last="link": the file it links to

    def _restore(self, target: CheckpointFile, pointer: Pointer, old: bytes | None) -> None:
        """After a failed save: put back the pointer file it replaced (see
        :func:`~.pointer_lifecycle.restore`)."""
        pointer_lifecycle.restore(target, pointer, old, fsync=self.config.fsync)

    def _materialize(self) -> None:
        """Write the best/last checkpoints as plain files (see :mod:`~.materialize`)."""
        with self._lock:
            marks, self._marks = self._marks, {}
        materialize(
            marks,
            self.materialize,
            file_of=self._linked_file,
            load=lambda key: self._execute(
                resolve(key, self._linked_file, self._store_of), "cpu", None
            ),
            entry_of=self._store,
            fsync=self.config.fsync,
        )

    def _raise_failed(self) -> None:
        """Raise the first background error (``Exception``); then warn about the saves that
        failed to commit, or raise ``CheckpointError`` once ``max_consecutive_failures`` in a
        row failed."""
        self._background.raise_first()
        self._failures.apply()
