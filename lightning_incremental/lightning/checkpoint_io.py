"""IncrementalCheckpointIO: a Lightning ``CheckpointIO`` that saves through the engine.

``Trainer(plugins=[IncrementalCheckpointIO()])`` makes every ``trainer.save_checkpoint`` —
ModelCheckpoint's top-k, ``save_last`` and periodic saves included — incremental, with no other
change to the user's code.

How paths map to checkpoints
----------------------------
Lightning addresses checkpoints by file path and finds them by listing directories (``"last"``
is the newest ``last*.ckpt`` file, ``best_model_path`` is a path, every ``fit/validate/test/
predict(ckpt_path=...)`` checks that the file exists). So each path stays a real file:

- every directory that checkpoints are saved to holds one engine store, in the hidden
  sub-directory ``<dir>/.incremental`` (``store_name``);
- each save becomes the next step of that store: steps are a sequence number (0, 1, 2, ...),
  not the global step, because ModelCheckpoint saves the same global step under several names
  (a top-k file and ``last.ckpt``); the second save costs a manifest, since nothing changed;
- at the path Lightning asked for, a small *pointer file* names the store (relative to the
  pointer's own directory, so a checkpoint directory can be moved or copied whole) and the step:
  a short header that makes ``torch.load`` fail saying what the file is and how to load it
  (:mod:`lightning_incremental.lightning.pointers`), then the JSON document::

      {"format": "lightning-incremental-pointer", "version": 1, "store": ".incremental",
       "step": 7, "id": "<32 hex digits>", "global_step": 400, "epoch": 3,
       "previous": 5, "previous_id": "<32 hex digits>", "writer": {"host": ..., "pid": ...}}

  It is written by ``save_checkpoint`` itself, as soon as the engine has snapshotted the state
  and before the step commits, atomically (a temporary file renamed into place on local disks,
  one PUT on object stores): Lightning's callbacks expect the file right after the save
  (ModelCheckpoint's ``-v1`` version counter, ``save_last="link"``). ``previous`` names the step
  of the pointer it replaced (the same path's older checkpoint); that step is kept until the
  new one commits, and released only then.
- a pointer whose step has not committed is *pending*. Loading it waits for the save when this
  process is making it, through this plug-in instance or another (a second ``Trainer``): every
  save is registered in :mod:`lightning_incremental.core.save.inflight` under its store. Otherwise
  another process is still writing it (its ``writer`` is alive), or the save never committed
  (its writer died between the pointer and the commit, or the save failed): the load falls back
  to ``previous`` when that is committed, with a warning naming both steps and which case it
  is, and else raises ``CheckpointNotFoundError`` saying so. A save that fails in the
  background also puts the replaced pointer file back (or removes its own, when it replaced
  none).

``load_checkpoint(path)`` reads the pointer, validates it (format, version, a store name that
cannot leave the directory, an id that the step's manifest must record) and returns the complete
checkpoint dict with bit-identical tensors. Under DDP (``torch.distributed`` initialised with
more than one process) ``load_checkpoint`` is *collective*, as ``torch.distributed.checkpoint``'s
load is: every rank must call it (Lightning's strategies do). Only global rank 0 saves, so only
it knows which saves are in flight: it waits for them, resolves what the path means (with the
fallback above) and broadcasts that, so every rank loads the same step or raises the same
error. A path that is a plain ``torch.save`` file (no
pointer) is loaded by Lightning's ``TorchCheckpointIO``, so runs can resume from checkpoints
written before this plug-in was added. A path that is a store directory loads its newest
committed checkpoint.

``remove_checkpoint(path)`` (top-k rotation, replaced ``last`` files) deletes the pointer file,
then the step, unless another pointer file in the directory names the same step (a ``last.ckpt``
copy) or names it as the ``previous`` of a pending step. Overwriting a pointer (ModelCheckpoint
rewrites ``last.ckpt``) releases the old step the same way, once the new one committed. The
engine deletes a step's objects only when no remaining checkpoint needs them, so a removal never
breaks a kept checkpoint.

Async
-----
``save_checkpoint`` blocks only while the engine snapshots the state (one host copy, no second
device copy) and the pointer file is written; encoding, writing and committing the step happen
in the background. A background error surfaces at the next ``save_checkpoint``/
``load_checkpoint``/``remove_checkpoint``, at :meth:`IncrementalCheckpointIO.wait`, or at
``teardown`` (which Lightning calls at the end of every ``fit/validate/test/predict``, also when
they fail) — never lost. A save that failed to commit (storage error, full disk) is logged and
warned about there, and training goes on from the previous checkpoint (the save's file keeps
naming it); ``max_consecutive_failures`` failed saves in a row raise ``CheckpointError`` instead.
Other background errors (releasing a replaced step) are raised. ``teardown`` waits for every
pending save to commit and closes the stores; the plug-in reopens them on next use.
``trainer.save_checkpoint`` called outside of a running stage (after ``fit``) is synchronous: it
returns once the checkpoint committed (raising if it failed), as callers of ``save_checkpoint``
rely on, and closes the stores.

Threads: the plug-in's background thread and the stores' threads run only while there is work
(:class:`~lightning_incremental.core.workers.WorkerPool`: daemon threads that end after a short
idle time; saves in flight at interpreter exit are finished by an exit hook). ``teardown``,
:meth:`IncrementalCheckpointIO.close` and a save outside of a stage end them at once.

What is covered
---------------
Lightning calls a ``CheckpointIO`` only from strategies that save one full checkpoint on global
rank 0: single device, DDP (all its launchers, ``ddp_spawn`` included) and similar. Lightning
gives a ``CheckpointIO`` no setup hook, so it cannot see the strategy; these are *not* covered:

- ``DeepSpeedStrategy``: saves and loads with DeepSpeed's own checkpointing, never calling the
  plug-in (its checkpoints stay DeepSpeed directories);
- ``FSDPStrategy``/``ModelParallelStrategy`` with sharded state (their default): the same, with
  ``torch.distributed.checkpoint``;
- ``FSDPStrategy(state_dict_type="full")`` / ``ModelParallelStrategy(save_distributed_checkpoint
  =False)``: gathers the whole state to rank 0 and saves it through the plug-in (a complete
  checkpoint, saved as any other), but loads paths itself with ``torch.load(path, mmap=True)``,
  which fails on a pointer file ("mmap can only be used with files saved with torch.save").

The plug-in warns where it can tell: at the first save a full-state sharded strategy makes
through it (``materialize`` makes the best/last files plain ones when ``fit`` ends), and at the
end of a ``fit`` under ``FSDPStrategy`` that saved nothing through it
(``ModelParallelStrategy`` does not even call a CheckpointIO's ``teardown``, so nothing tells
the plug-in there). See :mod:`lightning_incremental.lightning.sharded`.

The ``IncrementalCheckpoint`` callback covers these strategies where it can.

Storage options and pickles
---------------------------
fsspec ``storage_options`` (credentials, endpoint) are given once, at construction, and used
for stores and pointer files. Passing them per call (``trainer.save_checkpoint(...,
storage_options=...)``) raises ``TypeError``, as ``TorchCheckpointIO`` does, rather than being
ignored. Checkpoints hold data only and load without executing code; a value that needs pickle
(e.g. an ``argparse.Namespace`` in ``hyper_parameters``) is an error naming its key, unless
``allow_pickle=True``.

One writer per directory: two processes saving to the same directory at once conflict on
steps (the engine refuses the second, nothing is overwritten).
"""

from __future__ import annotations

import io
import logging
import os
import threading
import uuid
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, NamedTuple

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    PickleNotAllowedError,
    StoreConfig,
    UnsupportedValueError,
)
from lightning_incremental.core.save import inflight
from lightning_incremental.core.save.at_exit import drain_at_exit
from lightning_incremental.core.workers import WorkerPool
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.lightning.compat import (
    PathLike,
    saving_trainer,
    strategy_fitted,
    tearing_down_strategy,
    torch_load_checkpoint,
    trainer_stage_running,
)
from lightning_incremental.lightning.pointers import (
    CheckpointFile,
    NotATorchCheckpointError,
    Pointer,
    PointerError,
    Writer,
    is_int,
    looks_like_pointer,
    valid_store_name,
)
from lightning_incremental.lightning.trainer import MATERIALIZE, marks_of
from lightning_incremental.runtime import collectives
from lightning_incremental.runtime.backpressure import wait_for_room
from lightning_incremental.runtime.coordinate import Outcome, coordinated
from lightning_incremental.runtime.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    FailurePolicy,
    check_max_consecutive_failures,
    describe,
)

log = logging.getLogger(__name__)

# not pickled
_RUNTIME = (
    "_lock",
    "_stores",
    "_executor",
    "_jobs",
    "_pending",
    "_failures",
    "_marks",
    "_saved_in_stage",
    "_warned_strategy",
)

__all__ = ["IncrementalCheckpointIO", "NotATorchCheckpointError", "PointerError"]


class _TorchIODefault:
    """``load_checkpoint``'s default ``map_location``: every tensor on the CPU, as
    ``TorchCheckpointIO``'s default (``lambda storage, loc: storage``). An explicit ``None``
    means what it means to ``torch.load``: the device each tensor was saved on."""

    def __repr__(self) -> str:
        return "<cpu: TorchCheckpointIO's default>"


_TO_CPU: Any = _TorchIODefault()


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
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(
                f"storage_options must be a dict of fsspec options or None, got "
                f"{type(storage_options).__name__}"
            )
        if not isinstance(store_name, str) or not valid_store_name(store_name):
            raise ConfigError(
                f"store_name must be one plain directory name (letters, digits, '_', '-', '.'; "
                f"not '.' or '..'), got {store_name!r}"
            )
        if "keep_last" in options:
            raise ConfigError(
                "keep_last is not an option of IncrementalCheckpointIO: checkpoints are kept or "
                "removed by Lightning (ModelCheckpoint(save_top_k=...)); the store keeps exactly "
                "the checkpoints that files point to"
            )
        if not isinstance(allow_pickle, bool):
            raise ConfigError(f"allow_pickle must be True or False, got {allow_pickle!r}")
        self.materialize = _materialize_option(materialize)
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
        self._stores: dict[str, _OpenStore] = {}
        self._executor: WorkerPool | None = None
        self._jobs: list[Future[None]] = []  # background work, oldest first
        self._pending: dict[str, Future[None]] = {}  # path -> its save's pointer job
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
        self._saved_in_stage = True
        self._warn_strategy()
        target = self._file(path)
        if self.store_name in target.parts:
            raise ValueError(
                f"cannot save a checkpoint file inside the store directory {self.store_name!r} "
                f"({target.display}); save it next to the store"
            )
        target.makedirs()  # at once, as TorchCheckpointIO: the file itself comes later
        entry = self._store(target.store_url(self.store_name))
        # Back-pressure, as the engine's (max_in_flight): the oldest saves must finish first,
        # and commit, so that their errors are raised here, before this save.
        wait_for_room(entry.saving, self.config.max_in_flight)
        entry.saving = deque(job for job in entry.saving if not job.done())
        self._raise_failed()
        with entry.lock:
            step = entry.next_step(lambda: target.sibling_pointers(), self.store_name)
            progress = _progress(checkpoint)
            pointer = Pointer(
                self.store_name,
                step,
                uuid.uuid4().hex,
                global_step=progress["global_step"],
                epoch=progress["epoch"],
                writer=Writer.this_process(),
            )
            try:
                handle = entry.store.save(
                    checkpoint,
                    step,
                    metadata={
                        "path": target.display,
                        "checkpoint_id": pointer.id,
                        "global_step": pointer.global_step,
                        "epoch": pointer.epoch,
                    },
                )
            except UnsupportedValueError as exc:
                raise UnsupportedValueError(
                    f"cannot save checkpoint {target.display}: {exc}\n"
                    "With IncrementalCheckpointIO: make the value plain data (for "
                    "hyper-parameters, e.g. self.save_hyperparameters(vars(args)) or "
                    "save_hyperparameters(ignore=[...])), or construct "
                    "IncrementalCheckpointIO(allow_pickle=True) if every reader trusts these "
                    "checkpoints."
                ) from exc
            entry.reserved = step + 1
            entry.inflight.add(step)
        # The snapshot is taken: write the pointer now, naming the reserved step and the step of
        # the pointer it replaces, so that the path exists when this returns (ModelCheckpoint's
        # version counter and ``save_last="link"`` look for it at once).
        try:
            old_bytes, previous = self._replaced(target, entry)
            pointer = replace(
                pointer,
                previous=None if previous is None else previous[0],
                previous_id=None if previous is None else previous[1],
            )
            target.write_atomic(pointer.dumps(), fsync=self.config.fsync)
        except BaseException:
            # the step still commits, without a name (as after a crash before the pointer)
            job = self._submit(
                lambda: self._finish_unnamed(entry, handle, step), "saving", track=entry.store_url
            )
            entry.saving.append(job)
            raise

        failure: list[BaseException] = []

        def finish() -> None:
            try:
                handle.wait()
            except BaseException as exc:  # reported by the next call, as the policy says
                entry.inflight.discard(step)
                self._restore(target, pointer, old_bytes)
                log.error("IncrementalCheckpointIO: saving %s failed: %s", target.display, exc)
                failure.append(exc)
                self._failures.failed(f"{target.display} (step {step} of {entry.store.url})", exc)
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt, SystemExit: not a storage failure to count
                return
            entry.inflight.discard(step)
            self._failures.committed()
            self._committed(target, entry, pointer)

        job = self._submit(finish, f"saving {target.display}", track=entry.store_url)
        entry.saving.append(job)
        with self._lock:
            self._pending[target.key] = job
            self._marks.update(marks_of(checkpoint))
        if trainer_stage_running() is False:
            self._finish_now(job, failure, target, step, entry)

    def _finish_now(
        self,
        job: Future[None],
        failure: list[BaseException],
        target: CheckpointFile,
        step: int,
        entry: _OpenStore,
    ) -> None:
        """``Trainer.save_checkpoint`` outside of a running stage: wait for the commit, raise
        its failure, and end the threads (nothing else runs until the next stage or call).

        Raises:
            CheckpointError: the save failed to commit.
        """
        job.exception()
        if not failure:
            self.close()
            return
        exc = failure[0]
        self._failures.take()  # reported here, by raising
        try:
            self.close()
        except Exception as other:
            log.error("another checkpoint error while closing: %r", other)
        message = (
            f"saving {target.display} (step {step} of {entry.store.url}) did not commit: "
            f"{describe(exc)}; the file keeps naming the checkpoint it named before, if any"
        )
        if isinstance(exc, CheckpointError):
            raise _rewrap(exc, message) from exc
        raise CheckpointError(message) from exc

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Any | None = _TO_CPU,
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
        if not collectives.is_distributed():
            self.wait()
            return self._execute(self._resolve(path), map_location, weights_only)[0]
        # Collective under DDP: only global rank 0 saves, so only it knows which saves are in
        # flight; it resolves what to load and every rank loads exactly that.
        coordinator = collectives.rank() == 0
        loaded: dict[str, Any] | None = None

        def resolve() -> _Plan:
            nonlocal loaded
            self.wait()
            plan = self._resolve(path)
            if plan.step is None and plan.kind == "store":  # newest: fix the exact step
                loaded, step = self._execute(plan, map_location, weights_only)
                plan = plan._replace(step=step)
            return plan

        own = Outcome() if coordinator else Outcome.of(self.wait)  # raised after the collective
        plan = coordinated(resolve, what=f"load {path}", is_coordinator=coordinator)
        own.result((None, None), what=f"load {path}")
        if loaded is not None:
            return loaded
        return self._execute(plan, map_location, weights_only)[0]

    @override
    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the checkpoint file at ``path``; then, in the background, its step, unless
        another pointer file in the directory names it. A symbolic link is only unlinked; a plain
        ``torch.save`` file is removed as ``TorchCheckpointIO`` would.

        Raises:
            Exception: the error of an earlier background save, not delivered yet.
        """
        target = self._file(path)
        pending = self._pending.get(target.key)
        if pending is not None:
            pending.exception()  # its step must commit (or the old pointer be put back) first
        self._raise_failed()
        if target.islink():
            target.remove()
            return
        head = target.head()
        if head is None:
            return
        if not looks_like_pointer(head):
            TorchCheckpointIO().remove_checkpoint(target.path)
            return
        try:
            pointer = Pointer.parse(target.read(), target.display)
        except CheckpointError as exc:
            log.warning("removing %s, which is not a valid pointer file: %s", target.display, exc)
            target.remove()
            return
        target.remove()
        entry = self._store(target.store_url(pointer.store))

        def release() -> None:
            self._release(target, entry, pointer.store, pointer.step)
            if pointer.previous is not None:  # kept when that save never committed
                self._release(target, entry, pointer.store, pointer.previous)

        self._submit(release, f"removing {target.display}")

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
        _raise_first(errors, "during teardown")

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
        errors.extend(self._undelivered())
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
            executor, self._executor = self._executor, None
            self._jobs, self._pending = [], {}
        if executor is not None:
            executor.shutdown(wait=True)
        for entry in stores:
            try:
                entry.store.close()
            except BaseException as exc:
                errors.append(exc)
        _raise_first(errors, "while closing")

    # ------------------------------------------------------------------ public helpers

    def wait(self) -> None:
        """Block until every background save committed (and released the step it replaced).

        Raises:
            Exception: the first background error not delivered yet.
        """
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.exception()
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

    def _store(self, url: str) -> _OpenStore:
        with self._lock:
            entry = self._stores.get(url)
            if entry is None:
                entry = _OpenStore(self._open_store(url, self.config), url)
                self._stores[url] = entry
            return entry

    def _file(self, path: PathLike, *, resolve: bool = False) -> CheckpointFile:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"a checkpoint path must be a str or path, got {type(path).__name__}")
        return CheckpointFile.of(os.fspath(path), self.storage_options, resolve=resolve)

    def _resolve(self, path: PathLike) -> _Plan:
        """What loading ``path`` means, once no save of this process to its store is in flight
        (whichever plug-in instance started it).

        Raises:
            FileNotFoundError, CheckpointError: as :meth:`load_checkpoint`.
        """
        while True:
            source = self._file(path, resolve=True)
            if source.isdir():
                if inflight.wait(source.path_url):
                    continue
                return _Plan("store", source.path_url, None, source.display)
            head = source.head()
            if head is None:
                raise FileNotFoundError(f"Checkpoint file not found: {source.display}")
            if not looks_like_pointer(head):
                return _Plan("torch", source.path, None, source.display)
            pointer = Pointer.parse(source.read(), source.display)
            url = source.store_url(pointer.store)
            # A save of this process to that store (this Trainer's or another's) commits first;
            # then the file is read again: a failed save puts the file it replaced back.
            if not inflight.wait(url):
                break
        try:
            self._check_step(url, pointer.step, pointer.id, pointer.store, source.display)
            return _Plan("store", url, pointer.step, source.display)
        except CheckpointNotFoundError as exc:
            missing = exc
        # The step the pointer names is not committed, and no save of this process is writing
        # it: another process is still writing it, or its writer died or failed.
        why = pointer.why_uncommitted()
        if pointer.previous is not None:
            try:
                self._check_step(
                    url, pointer.previous, pointer.previous_id, pointer.store, source.display
                )
            except CheckpointNotFoundError:
                pass
            else:
                message = (
                    f"{source.display} names step {pointer.step} of {url}, which {why}; loading "
                    f"the checkpoint that file held before, step {pointer.previous}, instead"
                )
                log.warning(message)
                warnings.warn(message, UserWarning, stacklevel=4)
                return _Plan("store", url, pointer.previous, source.display)
        also = (
            f"; the checkpoint it replaced (step {pointer.previous}) is not committed either"
            if pointer.previous is not None
            else ""
        )
        raise _rewrap(
            missing,
            f"cannot load {source.display} (step {pointer.step} of {url}): {missing}; that step "
            f"{why}, or its store was moved or deleted{also}",
        ) from missing

    def _execute(
        self, plan: _Plan, map_location: Any, weights_only: bool | None
    ) -> tuple[dict[str, Any], int | None]:
        """Load what :meth:`_resolve` decided; also returns the step loaded."""
        if plan.kind == "torch":
            state = torch_load_checkpoint(
                plan.location, _to_cpu if map_location is _TO_CPU else map_location, weights_only
            )
            return state, None
        return self._load_store(plan.location, plan.step, map_location, weights_only, plan.display)

    def _load_store(
        self,
        url: str,
        step: int | None,
        map_location: Any,
        weights_only: bool | None,
        display: str,
    ) -> tuple[dict[str, Any], int | None]:
        what = f"step {step} of {url}" if step is not None else f"the newest checkpoint of {url}"
        location = "cpu" if map_location is _TO_CPU else map_location
        try:
            if weights_only and self.allow_pickle:  # a one-off reader that refuses pickles
                with self._open_store(url, self.config.replace(allow_pickle=False)) as store:
                    return store.load(step, map_location=location), store.loaded_step
            entry = self._store(url)
            return entry.store.load(step, map_location=location), entry.store.loaded_step
        except PickleNotAllowedError as exc:
            hint = (
                "it was loaded with weights_only=True"
                if self.allow_pickle
                else "construct IncrementalCheckpointIO(allow_pickle=True) to load it"
            )
            raise PickleNotAllowedError(
                f"cannot load {display} ({what}): {exc}; {hint}, only if you trust it"
            ) from exc
        except CheckpointError as exc:
            raise _rewrap(exc, f"cannot load {display} ({what}): {exc}") from exc

    def _check_step(
        self, url: str, step: int, ident: str | None, store_name: str, display: str
    ) -> None:
        """``step`` is committed, and (with an id) is the checkpoint the pointer names: step
        numbers of different stores overlap, and a pointer copied next to another store would
        load the wrong checkpoint.

        Raises:
            CheckpointNotFoundError: the step is not committed (or there is no store).
            PointerError: another checkpoint. CheckpointError: the step cannot be read.
        """
        try:
            manifest = self._store(url).store.manifest(step)
        except CheckpointNotFoundError:
            raise
        except CheckpointError as exc:
            raise _rewrap(exc, f"cannot load {display} (step {step} of {url}): {exc}") from exc
        if ident is None:
            return
        audit = manifest.audit
        metadata = audit.get("metadata")
        recorded = metadata.get("checkpoint_id") if isinstance(metadata, dict) else None
        if recorded != ident:
            raise PointerError(
                f"{display} names step {step} of {url}, but that step is another "
                f"checkpoint (id {recorded}, not {ident}): the pointer file was copied "
                "from another checkpoint directory or run; copy a checkpoint directory whole, "
                f"with its {store_name} store"
            )

    def _replaced(
        self, target: CheckpointFile, entry: _OpenStore
    ) -> tuple[bytes | None, tuple[int, str | None] | None]:
        """The pointer file at ``target`` that a save replaces (its bytes, to put back if the
        save fails) and the (step, id) the new pointer keeps as ``previous``: the old pointer's
        step, or, when that save never committed and is not in flight here, its own previous."""
        if target.islink():
            return None, None
        head = target.head()
        if head is None or not looks_like_pointer(head):
            return None, None
        data = target.read()
        try:
            old = Pointer.parse(data, target.display)
        except CheckpointError:
            return None, None
        if old.store != self.store_name:
            return None, None
        if old.step in entry.inflight or old.step in entry.store.steps():
            return data, (old.step, old.id)
        if old.previous is None:
            return data, None
        return data, (old.previous, old.previous_id)

    def _restore(self, target: CheckpointFile, pointer: Pointer, old: bytes | None) -> None:
        """After a failed save: put back the pointer file it replaced (or remove it), unless
        the file was replaced meanwhile. Best effort: a reader falls back to ``previous``."""
        try:
            head = target.head()
            if head is None or not looks_like_pointer(head) or target.islink():
                return
            if Pointer.parse(target.read(), target.display) != pointer:
                return
            if old is None:
                target.remove()
            else:
                target.write_atomic(old, fsync=self.config.fsync)
        except Exception as exc:
            log.warning("could not restore %s after its save failed: %s", target.display, exc)

    def _committed(self, target: CheckpointFile, entry: _OpenStore, pointer: Pointer) -> None:
        """After the commit: release the step the pointer replaced, never before."""
        if pointer.previous is not None and pointer.previous != pointer.step:
            self._release(target, entry, pointer.store, pointer.previous)

    def _finish_unnamed(self, entry: _OpenStore, handle: Any, step: int) -> None:
        try:
            handle.wait()
        finally:
            entry.inflight.discard(step)

    def _materialize(self) -> None:
        """Replace the pointer files at ModelCheckpoint's best/last paths (as of the newest save)
        by plain ``torch.save`` files of their checkpoints, and release their steps."""
        import torch

        with self._lock:
            marks, self._marks = self._marks, {}
        paths: list[str] = []
        for mark in marks.values():
            paths.extend(p for kind, p in mark.items() if kind in self.materialize)
        done: set[str] = set()
        for path in paths:
            target = self._file(path, resolve=True)  # save_last="link": the file it links to
            if target.key in done:
                continue
            done.add(target.key)
            head = target.head()
            if head is None or not looks_like_pointer(head):
                continue  # removed meanwhile, or already a plain file
            pointer = Pointer.parse(target.read(), target.display)
            state, loaded = self._execute(self._resolve(target.key), "cpu", None)
            buffer = io.BytesIO()
            torch.save(state, buffer)
            del state
            target.write_atomic(buffer.getvalue(), fsync=self.config.fsync)
            log.info("IncrementalCheckpointIO: wrote %s as a plain checkpoint", target.display)
            entry = self._store(target.store_url(pointer.store))
            for step in dict.fromkeys((loaded, pointer.step, pointer.previous)):
                if step is not None:  # the file no longer names them
                    self._release(target, entry, pointer.store, step)

    def _release(
        self, target: CheckpointFile, entry: _OpenStore, store_name: str, step: int
    ) -> None:
        """Delete ``step`` unless a pointer file next to ``target`` still names it, as its step
        or as the ``previous`` of a step that has not committed (its fallback)."""
        try:
            siblings = [p for p in target.siblings() if p.store == store_name]
        except OSError as exc:  # cannot tell what still names it: keeping it is the safe side
            log.warning(
                "keeping step %d of %s: the pointer files next to %s could not be "
                "read (%s); the step stays in the store (it costs space, nothing is lost)",
                step,
                store_name,
                target.display,
                exc,
            )
            return
        named = {p.step for p in siblings}
        fallbacks = [p for p in siblings if p.previous == step and p.step != step]
        if fallbacks and step not in named:
            committed = set(entry.store.steps())
            if any(p.step not in committed for p in fallbacks):
                named.add(step)
        if step in named:
            log.debug("keeping step %d of %s: another pointer file names it", step, store_name)
            return
        with entry.lock:  # no save may start while the engine deletes unreferenced objects
            try:
                entry.store.delete(step)
            except CheckpointNotFoundError:
                log.debug("step %d of %s was already deleted", step, entry.store.url)

    def _submit(
        self, work: Callable[[], None], what: str, *, track: str | None = None
    ) -> Future[None]:
        """Run ``work`` on the plug-in's background thread (which ends when idle). ``track``: a
        store URL whose loads in this process wait for this work (a save's commit and the
        pointer-file bookkeeping after it), whatever plug-in instance loads."""

        def run() -> None:
            try:
                work()
            except BaseException as exc:
                log.error("IncrementalCheckpointIO: %s failed: %s", what, exc)
                raise

        with self._lock:
            if self._executor is None:
                self._executor = WorkerPool(1, "li-checkpoint-io")
            # drained at exit before the stores it opened so far (newest registration first)
            drain_at_exit(self, _finish_jobs)
            # finished jobs stay only while their error is undelivered
            self._jobs = [j for j in self._jobs if not j.done() or j.exception() is not None]
            self._pending = {k: j for k, j in self._pending.items() if not j.done()}
            job = self._executor.submit(run)
            self._jobs.append(job)
        if track is not None:
            done = threading.Event()
            inflight.track(track, done)
            job.add_done_callback(lambda _: done.set())
        return job

    def _undelivered(self) -> list[BaseException]:
        """Errors of finished jobs, each returned once."""
        with self._lock:
            done = [j for j in self._jobs if j.done()]
            self._jobs = [j for j in self._jobs if j not in done]
        return [e for e in (j.exception() for j in done) if e is not None]

    def _raise_failed(self) -> None:
        """Raise the first background error; then warn about the saves that failed to commit,
        or raise them once ``max_consecutive_failures`` in a row failed.

        Raises:
            Exception: a background error (other than a failed save).
            CheckpointError: ``max_consecutive_failures`` saves in a row failed.
        """
        errors = self._undelivered()
        for extra in errors[1:]:
            log.error("another background checkpoint error: %r", extra)
        if errors:
            raise errors[0]
        self._failures.apply()


class _OpenStore:
    """One directory's store, the lock that orders saves against deletes, the next step."""

    def __init__(self, store: CheckpointStore, store_url: str) -> None:
        self.store = store
        self.store_url = store_url  # as the plug-in names it (what loads wait for)
        self.lock = threading.Lock()
        self.reserved: int | None = None
        self.saving: deque[Future[None]] = deque()  # this store's saves, oldest first
        self.inflight: set[int] = set()  # steps this process is saving, not committed yet

    def next_step(self, pointers: Callable[[], set[tuple[str, int]]], store_name: str) -> int:
        """After every committed step and every step a pointer file names (a step deleted
        from the store is not reused while a stale pointer might still name it)."""
        if self.reserved is None:
            named = [step for store, step in pointers() if store == store_name]
            self.reserved = max([-1, *self.store.steps(), *named]) + 1
        return self.reserved


class _Plan(NamedTuple):
    """What a load reads: a plain ``torch.save`` file, or one step of a store (None: its
    newest). Rank 0 broadcasts it under DDP, so it holds only plain values."""

    kind: str  # "torch" or "store"
    location: str  # the file's local path, or the store's URL
    step: int | None
    display: str  # the path as the user wrote it, for messages


def _finish_jobs(plugin: IncrementalCheckpointIO) -> None:
    """Let saves still in flight when the interpreter exits commit and get their pointer file
    (see :mod:`lightning_incremental.core.save.at_exit`).

    A save made after ``teardown`` (``trainer.save_checkpoint`` after ``fit``, ``ddp_spawn``
    handing the weights back to the main process) may still be running when the script ends.
    """
    with plugin._lock:
        jobs = list(plugin._jobs)
    for job in jobs:
        job.exception()  # failures were logged when they happened


def _progress(checkpoint: Any) -> dict[str, int | None]:
    """The checkpoint's global step and epoch, when it records them as ints."""
    out: dict[str, int | None] = {}
    for key in ("global_step", "epoch"):
        value = checkpoint.get(key) if isinstance(checkpoint, dict) else None
        out[key] = value if is_int(value) else None
    return out


def _rewrap(exc: CheckpointError, message: str) -> CheckpointError:
    """The same kind of error, with the Lightning path it was about."""
    try:
        return type(exc)(message)
    except TypeError:
        return CheckpointError(message)


def _to_cpu(storage: Any, location: str) -> Any:
    return storage


def _materialize_option(value: Any) -> tuple[str, ...]:
    """``materialize`` as the tuple of kinds it asks for (empty: off).

    Raises:
        ConfigError: anything but a bool, ``"best"``, ``"last"`` or a collection of them.
    """
    if value is False or value is None:
        return ()
    if value is True:
        return MATERIALIZE
    kinds = (value,) if isinstance(value, str) else value
    if not isinstance(kinds, (tuple, list, set, frozenset)) or not all(
        k in MATERIALIZE for k in kinds
    ):
        raise ConfigError(
            f"materialize must be True, False, 'best', 'last' or a list of them, got {value!r}"
        )
    return tuple(k for k in MATERIALIZE if k in kinds)


def _raise_first(errors: list[BaseException], when: str) -> None:
    """Raise the first of ``errors`` (if any); log the others, which would be lost."""
    for extra in errors[1:]:
        log.error("another checkpoint error %s: %r", when, extra)
    if errors:
        raise errors[0]
