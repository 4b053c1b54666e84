"""``IncrementalCheckpointer``: the whole Accelerate training state through the engine.

One global checkpoint per save: the prepared models (unwrapped state dicts), optimizers,
schedulers, the gradient scaler, objects registered with
``accelerator.register_for_checkpointing``, the step counters, and every process's own part (its
random state and its position in each prepared DataLoader) gathered into it. Written by the main
process; under FSDP every process writes its own shards of the models and optimizers (see
:mod:`accelerate_incremental._sharded`) and the main process commits.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from accelerate_incremental import _layout, _sharded, _takeover, _tracking
from accelerate_incremental._position import LoaderPosition
from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    SaveHandle,
    StepError,
    StepTypeError,
    StoreConfig,
)
from lightning_incremental.core.commit import fencing
from lightning_incremental.runtime import collectives, replica_policy, rng
from lightning_incremental.runtime.backpressure import wait_for_room
from lightning_incremental.runtime.coordinate import coordinated
from lightning_incremental.runtime.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    FailurePolicy,
    share_report,
)
from lightning_incremental.runtime.options import RecoveryOptions
from lightning_incremental.runtime.watchdog import Watchdog

if TYPE_CHECKING:
    from accelerate import Accelerator


FORMAT = "accelerate_incremental/1"
# Accelerate's distributed types whose state the engine behind them owns and writes in its own
# files (FSDP is covered: see _sharded).
_REFUSED = {
    "DEEPSPEED": "DeepSpeed's engine owns the partitioned optimizer state and saves and loads it "
    "itself (its own files per process), outside of the state dicts this checkpointer saves",
    "MEGATRON_LM": "Megatron-LM's engine partitions the model and optimizer itself and saves "
    "them with its own checkpointing",
    "XLA": "XLA devices hold the tensors (the state would be moved off the device and "
    "gathered without XLA's own sharding information)",
}


class IncrementalCheckpointer:
    """Incremental, verified checkpoints of an ``Accelerator``'s whole training state.

    Call :meth:`save` and :meth:`load` on every process (they gather and broadcast). Iterate the
    prepared training DataLoader through :meth:`iterate` to make a mid-epoch resume exact.

    Args:
        accelerator: the ``accelerate.Accelerator`` whose prepared objects are checkpointed.
        dirpath: the checkpoint store: a local directory or any fsspec URL.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        keep_last: keep only the newest ``keep_last`` checkpoints (never deleting data a kept one
            needs, and only after the newer one committed). Default: the accelerator's
            ``ProjectConfiguration.total_limit``, else keep all.
        every_n_steps: the schedule of :meth:`maybe_save`; None: ``maybe_save`` never saves.
        max_consecutive_failures: a save that fails in the background (storage error, full
            disk) commits nothing; the next :meth:`save` warns about it on every process (naming
            the step, the store and the error) and training goes on from the previous committed
            checkpoint. This many failed saves in a row raise ``CheckpointError`` instead (on
            every process at :meth:`save`; on the main process at :meth:`wait` / :meth:`close`);
            a committed save resets the count. 1: stop at the first failure.
        watchdog: run the heartbeat watchdog over the launch's TCPStore (a dead, hung or cut
            off process ends every process with exit code 86, 87 or 88, so ``accelerate launch
            --max_restarts`` / torchrun restarts the group). Default None: on when there is more
            than one process.
        replica_check: before each save with more than one process, compare every process's
            weights and optimizer state (one hash per tensor): ``"warn"`` (default), ``"repair"``
            (broadcast the reference copy, record it in the audit trail), ``"stop"`` (exit code
            89 on every process) or ``"off"``; see
            :mod:`lightning_incremental.runtime.replica_policy`.
        heartbeat_interval, heartbeat_timeout, progress_timeout: the watchdog's timings in
            seconds (see :class:`~lightning_incremental.runtime.WatchdogConfig`); progress is a
            prepared optimizer step, a batch from :meth:`iterate` (or from a plain loop over a
            loader tracked after :meth:`take_over`) or a :meth:`save`.
        recovery: all of ``watchdog``, the three timings, ``replica_check`` and
            ``max_consecutive_failures`` as one
            :class:`~lightning_incremental.runtime.RecoveryOptions` (then leave those at their
            defaults).
        optimizer_state: ``"exact"`` (default: lossless, restored bit-exact), ``"bf16"`` or
            ``"int8"``: optimizer moments (``exp_avg``, ``exp_avg_sq``) stored quantized; a
            resume from such a checkpoint is not bit-exact (see
            :mod:`lightning_incremental.core.codecs.optimizer_state`). Weights stay lossless.
        **options: further :class:`~lightning_incremental.core.StoreConfig` options
            (``full_every``, ``allow_pickle``, ...).

    Under FSDP (FSDP2 or FSDP1) every process saves its own shards of the models and optimizers
    (their sharded state dicts, whatever ``state_dict_type`` the plugin has) and :meth:`load`
    fills them in place; resume with the same number of processes. When FSDP was asked for but
    Accelerate fell back to DDP (no GPUs), a ``UserWarning`` says so.

    With more than one process (or under torchrun) the main process claims a new fencing
    generation when the checkpointer is created: checkpoints a previous incarnation of the job
    writes afterwards are never visible. Create it on every process.

    Raises:
        TypeError: ``accelerator`` is not an Accelerator, or an argument has the wrong type.
        ValueError: a DeepSpeed, Megatron-LM or XLA accelerator (not covered), an
            Accelerator that sees one process in a multi-process launch, or a bad
            ``every_n_steps``.
        ConfigError: an invalid store option or URL, or ``recovery`` given together with one of
            the arguments it holds.
        CoordinatorError: on the other processes, the main process could not claim a fencing
            generation (the main process raises its own error).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        dirpath: str,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        every_n_steps: int | None = None,
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        watchdog: bool | None = None,
        heartbeat_interval: float = 5.0,
        heartbeat_timeout: float = 60.0,
        progress_timeout: float = 900.0,
        replica_check: str = "warn",
        recovery: RecoveryOptions | None = None,
        optimizer_state: str = "exact",
        **options: Any,
    ) -> None:
        from accelerate import Accelerator

        if not isinstance(accelerator, Accelerator):
            raise TypeError(
                f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
            )
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if kind.upper() in _REFUSED:
            raise ValueError(
                f"IncrementalCheckpointer does not support {kind} accelerators: "
                f"{_REFUSED[kind.upper()]}. Covered: single process, data parallel (DDP on "
                "CPU/GPU/XPU/NPU, i.e. distributed_type NO or MULTI_*) and FSDP; use "
                "accelerator.save_state for DeepSpeed/Megatron-LM/XLA."
            )
        fallback = _sharded.fsdp_fallback_warning(accelerator)
        if fallback is not None and accelerator.is_main_process:
            warnings.warn(fallback, UserWarning, stacklevel=2)
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched.isdigit() and int(launched) > 1 and accelerator.num_processes == 1:
            raise ValueError(
                f"this process was launched as one of WORLD_SIZE={launched} processes, but the "
                "Accelerator runs as a single process (distributed_type NO), so every process "
                "would write the same checkpoints on its own. On a machine without GPUs create "
                "Accelerator(cpu=True) or launch with ACCELERATE_USE_CPU=1"
            )
        self.recovery = check_arguments(
            dirpath,
            storage_options=storage_options,
            keep_last=keep_last,
            every_n_steps=every_n_steps,
            max_consecutive_failures=max_consecutive_failures,
            watchdog=watchdog,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            progress_timeout=progress_timeout,
            replica_check=replica_check,
            recovery=recovery,
            optimizer_state=optimizer_state,
            **options,
        )
        self.replica_check = self.recovery.replica_check
        if keep_last is None:
            keep_last = accelerator.project_configuration.total_limit
        self.accelerator = accelerator
        self.every_n_steps = every_n_steps
        # FSDP: every process saves its own shards through a store it opens (a collective)
        self.sharded = _sharded.is_sharded(accelerator)
        self.store = CheckpointStore(
            dirpath,
            storage_options=storage_options,
            keep_last=keep_last,
            optimizer_state=optimizer_state,
            distributed=self.sharded and accelerator.num_processes > 1,
            **options,
        )
        self._positions: dict[int, LoaderPosition] = {}
        self._saved_rng: dict[str, Any] | None = None  # this process's RNG at the loaded save
        # A save due at an epoch's last batch, taken when one of these loaders' next epoch
        # starts (or at wait/close): (step, indices of the loaders at their epoch's end).
        self._deferred: tuple[int, set[int]] | None = None
        self.max_consecutive_failures = self.recovery.max_consecutive_failures
        self._failures = FailurePolicy(
            "IncrementalCheckpointer", str(self.store.url), self.max_consecutive_failures
        )
        self._handles: list[SaveHandle] = []  # this process's saves not collected yet
        self.generation: int | None = None
        if fencing.should_claim(accelerator.num_processes):
            self.generation = self._claim_generation()
        self._hooks: list[Any] = []
        self._watched: set[int] = set()  # ids of the optimizers whose steps count as progress
        self._watchdog: Watchdog | None = self.recovery.start_watchdog(
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            generation=self.generation or 0,
        )
        dog = self._watchdog
        if dog is not None:
            # Progress is every optimizer step, whatever loop the script runs (its own, or
            # through iterate()); a checkpointer dropped without close() stops its watchdog.
            self._watch_optimizers()
            dropped = weakref.finalize(self, stop_dropped, dog)
            dropped.atexit = False  # at exit the watchdog says it finished (Watchdog.start)

    def _watch_optimizers(self) -> None:
        """Count every prepared optimizer's step as progress for the watchdog (whatever loop the
        script runs); optimizers prepared later are added by :meth:`follow`."""
        dog = self._watchdog
        if dog is None:
            return
        for opt in self.accelerator._optimizers:
            if id(opt) not in self._watched:
                self._watched.add(id(opt))
                inner = getattr(opt, "optimizer", opt)
                self._hooks.append(inner.register_step_post_hook(lambda *_: dog.progress()))

    def _claim_generation(self) -> int:
        """A new fencing generation, claimed by the main process, known to every process.

        Raises:
            CoordinatorError: on the other processes, the claim failed (the main process raises
                its own error).
        """
        try:
            return coordinated(
                lambda: self.store.claim_generation(fencing.restart_count()),
                what=f"claim a fencing generation in {self.store.url}",
                is_coordinator=self.accelerator.is_main_process,
            )
        except BaseException:
            self.store.close()
            raise

    # ------------------------------------------------------------------ saving

    def save(self, step: int, *, metadata: dict[str, Any] | None = None) -> SaveHandle | None:
        """Save the whole training state as checkpoint ``step``; call it on every process.

        Blocks only for the gather and the snapshot; the write runs in the background (see
        :meth:`wait`). Returns the save's handle on the main process, None on the others
        (under FSDP every process saves its shards and gets its handle).

        Raises:
            StepError: ``step`` is not an int (``StepTypeError``, also a ``TypeError``), is
                negative, or is not greater than the newest saved step.
            RuntimeError: called before ``accelerator.prepare`` (no prepared model).
            ValueError: a prepared ``StatefulDataLoader`` (not covered).
            UnsupportedValueError: a state value that needs pickling (naming its key).
        """
        return self._save(step, self.accelerator.project_configuration.iteration, metadata)

    def maybe_save(self, step: int) -> SaveHandle | None:
        """:meth:`save` when ``step`` is a positive multiple of ``every_n_steps``; else None.

        A save due right after the last batch of an epoch is taken once that epoch is over —
        when that loader's next epoch starts (through :meth:`iterate`, or a plain loop over it
        after :meth:`take_over`), or at :meth:`wait` / :meth:`close` — so it holds the epoch's
        end work too (an epoch-interval scheduler step, an evaluation) and a resumed run starts
        the next epoch, whatever its loop looks like (``while loader.iteration < epochs`` or
        ``for epoch in range(start, epochs)``)."""
        _check_step(step)
        if self._watchdog is not None:
            self._watchdog.progress(step)
        if self.every_n_steps is None or step <= 0 or step % self.every_n_steps:
            return None
        ended = {i for i, position in self._positions.items() if position.at_epoch_end()}
        if ended:
            self._deferred = (step, ended)
            return None
        return self.save(step)

    def _save_deferred(self) -> None:
        if self._deferred is not None:
            self.save(self._deferred[0])

    def _save(
        self,
        step: int,
        iteration: int,
        metadata: dict[str, Any] | None,
        weights: list[dict[str, Any]] | None = None,  # the models' state dicts, after the hooks
    ) -> SaveHandle | None:
        _check_step(step)
        self._deferred = None  # a due save not taken yet: this one holds newer state
        if self._watchdog is not None:
            self._watchdog.progress(step)
        acc = self.accelerator
        _layout.check_prepared(acc)
        _layout.check_loaders(acc)
        local = {
            "rng": rng.capture(),
            "loaders": [self._position(i).state() for i in range(len(acc._dataloaders))],
        }
        self._settle(block=False)  # earlier failed saves: warned about, or raised, everywhere
        verdict = self._check_replicas()
        if verdict.skip_save:
            return None
        if verdict.audit():
            metadata = {**(metadata or {}), "replica_repair": verdict.audit()}
        processes = collectives.gather(local)
        if self.sharded:
            sharded = _sharded.state(acc)  # every process: its own shards
            models, optimizers = sharded["models"], sharded["optimizers"]
        elif not acc.is_main_process:
            return None
        else:
            models = (
                weights
                if weights is not None
                else [acc.unwrap_model(m).state_dict() for m in acc._models]
            )
            optimizers = [opt.state_dict() for opt in acc._optimizers]
        state = {
            "format": FORMAT,
            "models": models,
            "optimizers": optimizers,
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "counters": {"step": int(acc.step), "iteration": int(iteration)},
            "processes": processes,
        }
        handle = self._failures.start(  # None: the limit was reached (raised at the next call)
            lambda: self.store.save(state, step, metadata=metadata, world_size=len(processes)),
            lambda: self._failures.collect(self._handles, block=False),
        )
        if handle is not None:
            self._handles.append(handle)
        return handle

    def _check_replicas(self) -> replica_policy.Verdict:
        """Compare the processes' weights and optimizer state (every process at once); see
        :func:`~lightning_incremental.runtime.replica_policy.check_before_save`."""
        acc = self.accelerator
        if self.sharded:  # every process holds other shards, by design
            return replica_policy.Verdict(None)

        def state() -> dict[str, Any]:
            # Parameters and optimizer state, not buffers (running statistics legitimately
            # differ per process under DDP); the tensors share storage with the live ones (for
            # a repair).
            return {
                "models": [
                    {name: p.detach() for name, p in acc.unwrap_model(m).named_parameters()}
                    for m in acc._models
                ],
                "optimizers": [opt.state_dict() for opt in acc._optimizers],
            }

        def finish_saves() -> None:
            self._failures.collect(self._handles, block=True)

        return replica_policy.check_before_save(
            state, self.replica_check, finish_saves=finish_saves, barrier=acc.wait_for_everyone
        )

    def _settle(self, *, block: bool, everywhere: bool = True) -> None:
        """Collect the main process's finished saves (all of them with ``block``) and apply the
        failure policy: warn about failed ones, or raise once ``max_consecutive_failures`` in a
        row failed. ``everywhere`` (call it on every process): the main process decides, every
        process warns or raises alike.

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed.
        """
        report = None
        if self.accelerator.is_main_process or self.store.distributed:
            # The engine's back-pressure: the next save waits for these anyway (max_in_flight).
            wait_for_room(self._handles, self.store.config.max_in_flight)
            self._failures.collect(self._handles, block=block)
            report = self._failures.report()
        if everywhere:
            report = share_report(report)
        if report is not None:
            self._failures.apply(report)

    def wait(self) -> None:
        """Wait until every pending save of this process committed (or failed: a failed save is
        warned about, see ``max_consecutive_failures``).

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed.
        """
        self._save_deferred()
        self._settle(block=True, everywhere=False)
        self.store.wait()

    # ------------------------------------------------------------------ loading

    def load(self, *, _pre_hooks: Any = None) -> int | None:
        """Restore the newest committed checkpoint into the prepared objects on every process and
        return its step; None (nothing restored) when the store has no checkpoint.

        The main process picks the step and broadcasts it. Restores the models, optimizers,
        schedulers, scaler, registered objects, ``accelerator.step``, the project's save
        iteration, and this process's random state and DataLoader positions.

        Raises:
            RuntimeError: called before ``accelerator.prepare``.
            ValueError: the checkpoint's layout (models, keys, shapes, optimizers, schedulers,
                registered objects, process count) differs from this run's, naming the difference.
            CorruptCheckpointError: every committed checkpoint is corrupt (on the main process;
                the others raise ``CoordinatorError`` naming it).
        """
        acc = self.accelerator
        _layout.check_prepared(acc)
        self._deferred = None  # the state it would have held is being replaced
        state: dict[str, Any] | None = None
        into = self._live()  # on every process (FSDP1's sharded state dict is a collective)

        def newest() -> int | None:
            nonlocal state
            try:
                state = self.store.load(map_location="cpu", into=into, strict_into=False)
            except CheckpointNotFoundError:
                return None
            return self.store.loaded_step

        step = coordinated(
            newest,
            what=f"load a checkpoint from {self.store.url}",
            is_coordinator=acc.is_main_process,
        )
        if step is None:
            return None
        if state is None:
            state = self.store.load(step, map_location="cpu", into=into, strict_into=False)
        # Accelerate's load pre-hooks: before the weights, which go to the models they leave
        models = list(acc._models) if _pre_hooks is None else _pre_hooks(step)
        _layout.check_compatible(acc, state, FORMAT, models, weights=not self.sharded)
        if self.sharded:  # torch checks the keys and sets every process's shards
            _sharded.apply(acc, models, state)
        else:
            for model, weights in zip(models, state["models"], strict=True):
                acc.unwrap_model(model).load_state_dict(weights)
            for opt, opt_state in zip(acc._optimizers, state["optimizers"], strict=True):
                opt.load_state_dict(opt_state)
        for sched, sched_state in zip(acc._schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sched_state)
        if acc.scaler is not None and state["scaler"] is not None:
            acc.scaler.load_state_dict(state["scaler"])
        for obj, obj_state in zip(acc._custom_objects, state["custom"], strict=True):
            obj.load_state_dict(obj_state)
        acc.step = int(state["counters"]["step"])
        acc.project_configuration.iteration = int(state["counters"]["iteration"])
        mine = state["processes"][acc.process_index]
        for i, position in enumerate(mine["loaders"]):
            self._position(i).restore(position)
        self._saved_rng = mine["rng"]
        rng.restore(mine["rng"])
        return step

    def _live(self) -> dict[str, Any]:
        """The prepared models' own tensors, for the engine to restore into: their weights are
        decoded in place (``load_state_dict`` then copies each onto itself), not into a second
        copy of the model."""
        acc = self.accelerator
        if self.sharded:  # the live shards, optimizers' included
            return _sharded.state(acc)
        return {"models": [acc.unwrap_model(m).state_dict() for m in acc._models]}

    # ------------------------------------------------------------------ takeover

    def take_over(self) -> None:
        """Install the integration on the accelerator: ``accelerator.save_state()`` /
        ``load_state()`` go through this checkpointer, and every prepared DataLoader iterated
        directly (``for batch in loader``) is tracked as through :meth:`iterate`, so a
        mid-epoch resume is exact in plain loops too.

        ``save_state`` saves checkpoint ``project_configuration.iteration``, waits for its commit
        (Accelerate's save_state is synchronous too) and increments the iteration (as Accelerate
        does); ``load_state`` restores the newest checkpoint and returns its step (None
        when the store is empty). Both accept and ignore Accelerate's serialization arguments;
        the directory is ignored too, unless pre-hooks are registered
        (``register_save_state_pre_hook`` / ``register_load_state_pre_hook``): they run as
        Accelerate runs them, with the checkpoint directory (see
        :mod:`accelerate_incremental._hooks`). ``skip_first_batches`` on a tracked loader returns
        the loader itself, skipping by index and still tracked (see
        :mod:`accelerate_incremental._takeover`). :meth:`release` undoes all of it.

        Raises:
            RuntimeError: the accelerator is already taken over.
            TypeError: a prepared DataLoader whose iteration cannot be tracked.
        Raises (from the taken-over methods):
            ValueError: pre-hooks are registered and there is no checkpoint directory for them
                (no ``output_dir`` / ``input_dir`` and no automatic checkpoint naming).
        """
        _takeover.take_over(self)

    def follow(self) -> None:
        """Track the DataLoaders (and watch the optimizers) prepared since :meth:`take_over`;
        the launch flag calls it after every ``accelerator.prepare``."""
        _takeover.follow(self)
        self._watch_optimizers()

    def release(self) -> None:
        """Undo :meth:`take_over`: the accelerator's own methods and loaders' iteration again."""
        _takeover.release(self)

    # ------------------------------------------------------------------ data position

    def iterate(self, dataloader: Any) -> Iterator[Any]:
        """Iterate one epoch of a prepared DataLoader, tracking the position saved with each
        checkpoint. After :meth:`load`, the first call continues the interrupted epoch exactly
        where it stood (same order, same random state), skipping the consumed batches. After
        :meth:`take_over` a plain ``for batch in dataloader`` is the same.

        Raises:
            ValueError: ``dataloader`` was not returned by ``accelerator.prepare``.
        """
        index = self._index(dataloader)
        if index is None:
            raise ValueError(
                "iterate() takes a DataLoader returned by accelerator.prepare(...); this one was "
                "not prepared by this accelerator"
            )
        return self._epoch(index)

    def _index(self, dataloader: Any) -> int | None:
        loaders = self.accelerator._dataloaders
        return next((i for i, dl in enumerate(loaders) if dl is dataloader), None)

    def _epoch(self, index: int) -> Iterator[Any]:
        """One epoch of prepared DataLoader ``index``, its position tracked: the iteration of
        :meth:`iterate` and of a tracked loader's own ``for`` loop."""
        position = self._position(index)
        loader = position.loader

        def open_epoch(skip: int) -> Any:
            if skip == 0:
                return _tracking.own_iter(loader)
            acc = self.accelerator  # Accelerate's own, not a taken-over instance attribute
            return type(acc).skip_first_batches(acc, loader, skip)

        def restore_now() -> None:
            if self._saved_rng is not None:
                rng.restore(self._saved_rng)

        if self._deferred is not None and index in self._deferred[1]:
            self._save_deferred()  # the epoch is over, the next one not begun
        dog = self._watchdog
        for batch in position.iterate(open_epoch, restore_now):
            if dog is not None:
                dog.progress()
            yield batch

    def _position(self, index: int) -> LoaderPosition:
        loader = self.accelerator._dataloaders[index]
        position = self._positions.get(index)
        if position is None or position.loader is not loader:
            position = self._positions[index] = LoaderPosition(loader)
        return position

    # ------------------------------------------------------------------ lifecycle

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first."""
        return self.store.steps()

    def close(self, *, finished: bool = True) -> None:
        """Wait for pending saves, stop the watchdog and release the store. ``finished``
        False: this process is failing; its watchdog stops without telling the others it is
        done (if they wait for it, they find it dead and restart).

        Raises:
            Exception: the error of a failed save.
        """
        dog, self._watchdog = self._watchdog, None
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        if dog is not None:
            dog.stop(finished=finished)
        try:
            if finished:
                self._save_deferred()
            self._settle(block=True, everywhere=False)
        finally:
            self.store.close()

    def __enter__(self) -> IncrementalCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(finished=exc is None)

    def __repr__(self) -> str:
        return f"IncrementalCheckpointer({self.store.url!r}, every_n_steps={self.every_n_steps})"


def check_arguments(
    dirpath: Any,
    *,
    storage_options: Any = None,
    keep_last: Any = None,
    every_n_steps: Any = None,
    max_consecutive_failures: Any = DEFAULT_MAX_CONSECUTIVE_FAILURES,
    watchdog: Any = None,
    heartbeat_interval: Any = 5.0,
    heartbeat_timeout: Any = 60.0,
    progress_timeout: Any = 900.0,
    replica_check: Any = "warn",
    recovery: Any = None,
    **options: Any,
) -> RecoveryOptions:
    """Validate :class:`IncrementalCheckpointer`'s arguments without an accelerator or a store
    (the launch flag checks its settings before the script runs). Returns the recovery options
    (watchdog, replica check, ``max_consecutive_failures``), validated.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a bad ``every_n_steps``, ``max_consecutive_failures`` or ``replica_check``.
        ConfigError: an invalid store option or watchdog timing, or ``recovery`` given together
            with one of the arguments it holds.
    """
    if not isinstance(dirpath, str):
        raise TypeError(f"dirpath must be a str (a directory or URL), got {type(dirpath).__name__}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(
            f"storage_options must be a dict or None, got {type(storage_options).__name__}"
        )
    if every_n_steps is not None and (
        isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
    ):
        raise ValueError(f"every_n_steps must be an int >= 1 or None, got {every_n_steps!r}")
    recovery = RecoveryOptions.resolve(
        recovery,
        watchdog=watchdog,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        progress_timeout=progress_timeout,
        replica_check=replica_check,
        max_consecutive_failures=max_consecutive_failures,
    )
    StoreConfig().replace(keep_last=keep_last, **options)
    return recovery


def _check_step(step: Any) -> None:
    """The checks on a step the engine makes at ``save``, made on every process before any
    collective (so that every process raises alike).

    Raises:
        StepError: ``step`` is not an int (a ``StepTypeError``, also a ``TypeError``), or is
            negative.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise StepTypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise StepError(f"step must be >= 0, got {step}")


def stop_dropped(dog: Watchdog) -> None:
    """Stop the watchdog of a checkpointer dropped without ``close()``, without waiting for its
    threads. A finalizer runs on whatever thread the garbage collector does, possibly one that
    holds a lock a watchdog thread needs to end (logging's, its store client's): joining them
    there could wait forever. They see the stop within a heartbeat interval and end alone."""
    dog.stop(timeout=0, finished=False)
