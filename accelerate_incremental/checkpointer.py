"""``IncrementalCheckpointer``: the whole Accelerate training state through the engine.

One global checkpoint per save: the prepared models (unwrapped state dicts), optimizers,
schedulers, the gradient scaler, objects registered with
``accelerator.register_for_checkpointing``, the step counters, and every process's own part (its
random state and its position in each prepared DataLoader) gathered into it. Written by the main
process; under FSDP every process writes its own shards of the models and optimizers (see
:mod:`accelerate_incremental._sharded`) and the main process commits.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from accelerate_incremental import (
    _compat,
    _fork,
    _layout,
    _load_arguments,
    _memory,
    _pace,
    _progress,
    _sharded,
    _source,
    _state,
    _takeover,
    _writer,
)
from accelerate_incremental._arguments import check_accelerator, check_arguments, check_step
from accelerate_incremental._loaders import Loaders
from accelerate_incremental._preemption import PreemptionPoint
from lightning_incremental.core import CheckpointStore, SaveHandle
from lightning_incremental.runtime import PreemptionConfig, RecoveryOptions
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.cluster.watchdog import Watchdog
from lightning_incremental.runtime.policy.backpressure import wait_for_room
from lightning_incremental.runtime.policy.cadence import Cadence
from lightning_incremental.runtime.policy.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    FailurePolicy,
    share_report,
)
from lightning_incremental.runtime.state import rng

if TYPE_CHECKING:
    from accelerate import Accelerator


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
            every process at :meth:`save`; on the main process at :meth:`wait` / :meth:`close`;
            a committed save resets the count). 1: stop at the first failure.
        watchdog: run the heartbeat watchdog over the launch's TCPStore (a dead, hung or cut
            off process ends every process with exit code 86, 87 or 88, so ``accelerate launch
            --max_restarts`` / torchrun restarts the group). Default None: on when there is more
            than one process.
        replica_check: before each save with more than one process, compare every process's
            weights and optimizer state (one hash per tensor): ``"warn"`` (default), ``"repair"``
            (broadcast the reference copy, record it in the audit trail), ``"stop"`` (exit code
            89 on every process) or ``"off"``; see
            :mod:`lightning_incremental.runtime.policy.replica_policy`.
        heartbeat_interval, heartbeat_timeout, progress_timeout: the watchdog's timings in
            seconds (see :class:`~lightning_incremental.runtime.WatchdogConfig`); progress is a
            prepared optimizer step, a batch from :meth:`iterate` (or from a plain loop over a
            loader tracked after :meth:`take_over`) or a :meth:`save`.
        recovery: ``watchdog``, the timings, ``replica_check``, ``max_consecutive_failures`` as
            one :class:`~lightning_incremental.runtime.RecoveryOptions` (leave those default).
        optimizer_state: ``"exact"`` (default: lossless, restored bit-exact), ``"bf16"`` or
            ``"int8"``: optimizer moments (``exp_avg``, ``exp_avg_sq``) stored quantized; a
            resume from such a checkpoint is not bit-exact (see
            :mod:`lightning_incremental.core.codecs.optimizer_state`). Weights stay lossless.
        preemption: a ``PreemptionConfig``, True (its defaults) or False: at SIGTERM or SIGINT
            (however often delivered) every process commits the step of the next batch boundary,
            exits 143 (:mod:`~._preemption`).
        max_overhead, expected_mtbf: :meth:`maybe_save` adapts its interval to the measured cost
            of a save: the fraction of training time checkpointing may cost (``0.02``) and/or the
            mean time between failures in seconds (Young/Daly); ``every_n_steps`` is then the
            shortest interval (see :mod:`~._pace`). Logged; :attr:`cadence` has the choices.
        memory_every_n_steps, memory_replicas, memory_dir: the memory tier (off by default):
            every ``memory_every_n_steps`` steps :meth:`maybe_save` puts each process's part
            into node-local memory (``memory_dir``; default ``$LIGHTNING_INCREMENTAL_MEMORY_DIR``,
            else ``/dev/shm/lightning-incremental``) and onto ``memory_replicas`` other nodes;
            :meth:`load` resumes from the newest step every process agrees on when it is at
            least the store's newest (see :mod:`~._memory`); :attr:`resumed_tier` says which.
        fork_from: ``"SRC[@STEP]"``: while ``dirpath`` holds no checkpoint, fork that step of SRC
            (default: its newest) into it first, for :meth:`load` (see the pool guide).
        fork_weights_only: with ``fork_from``, :meth:`load` takes only its models' weights.
        read_only: for loading only (inference, evaluation): takes no writer lease, so it works
            beside a live run writing ``dirpath`` and on a store it cannot write; :meth:`save`
            raises ``ConfigError`` (no ``every_n_steps``, memory tier, ``fork_from``, preemption).
        **options: further :class:`~lightning_incremental.core.StoreConfig` options.

    Under FSDP (FSDP2 or FSDP1) every process saves its own shards of the models and optimizers
    (their sharded state dicts, whatever ``state_dict_type`` the plugin has) and :meth:`load`
    fills them in place; resume with the same number of processes. When FSDP was asked for but
    Accelerate fell back to DDP (no GPUs), a ``UserWarning`` says so.

    Its creation is a writer's start, before anything is loaded or trained: the main process
    takes the store's writer lease and probes the store, claiming a new fencing generation with
    more than one process (see :mod:`~._writer`). Create it on every process.

    Raises:
        TypeError: ``accelerator`` is not an Accelerator, or an argument has the wrong type.
        ValueError: a DeepSpeed, Megatron-LM or XLA accelerator (not covered), an Accelerator
            that sees one process in a multi-process launch, or a bad ``every_n_steps``.
        ConfigError: an invalid store option or URL, ``recovery`` given together with one of
            the arguments it holds, ``read_only`` with an argument that writes.
        WriterLeaseError, StoreNotWritableError: another job writes ``dirpath`` (naming its
            host, pid and job), or it cannot be written (on every process; not ``read_only``).
        CoordinatorError: on the other processes, another failure of the main process.
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
        preemption: PreemptionConfig | bool = True,
        max_overhead: float | None = None,
        expected_mtbf: float | None = None,
        memory_every_n_steps: int | None = None,
        memory_replicas: int = 1,
        memory_dir: str | None = None,
        fork_from: str | None = None,
        fork_weights_only: bool = False,
        read_only: bool = False,
        **options: Any,
    ) -> None:
        check_accelerator(accelerator)
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
            preemption=preemption,
            max_overhead=max_overhead,
            expected_mtbf=expected_mtbf,
            memory_every_n_steps=memory_every_n_steps,
            memory_replicas=memory_replicas,
            memory_dir=memory_dir,
            read_only=read_only,
            fork_from=fork_from,
            **options,
        )
        self.read_only, self.replica_check = read_only, self.recovery.replica_check
        if keep_last is None:
            keep_last = accelerator.project_configuration.total_limit
        self.accelerator = accelerator
        self.every_n_steps = every_n_steps
        self._pace = _pace.Pace.of(max_overhead, expected_mtbf, every_n_steps, accelerator)
        # FSDP: every process saves its own shards through a store it opens (a collective)
        self.sharded = _sharded.is_sharded(accelerator)
        self._fk = _fork.start(accelerator, dirpath, storage_options, fork_from, fork_weights_only)
        self.store = CheckpointStore(
            dirpath,
            storage_options=storage_options,
            keep_last=keep_last,
            optimizer_state=optimizer_state,
            distributed=self.sharded and accelerator.num_processes > 1,
            **options,
        )
        self._loaders = Loaders(accelerator)
        # A save due at an epoch's last batch (step, loaders at their epoch's end), taken when one's
        # next epoch starts or at wait/close; or a memory resume's step the store lacks (step, {})
        self._deferred: tuple[int, set[int]] | None = None
        self.max_consecutive_failures = self.recovery.max_consecutive_failures
        self._failures = FailurePolicy(
            "IncrementalCheckpointer", str(self.store.url), self.max_consecutive_failures
        )
        self._handles: list[SaveHandle] = []  # this process's saves not collected yet
        self.generation = _writer.start(self.store, accelerator, read_only=read_only)
        self.resumed_tier: str | None = None  # where load() found its step: memory, peer, store
        memory = (memory_every_n_steps, memory_replicas, memory_dir)
        self._memory = _memory.start(accelerator, self.store, self.generation, self.sharded, memory)
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
            _progress.watch_optimizers(self.accelerator, self._watchdog, self._watched, self._hooks)
            dropped = weakref.finalize(self, _progress.stop_dropped, dog)
            dropped.atexit = False  # at exit the watchdog says it finished (Watchdog.start)
        self._preemption = PreemptionPoint(accelerator, not read_only and preemption)  # signals

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
        self._preemption.seen(step)
        return self._save(step, self.accelerator.project_configuration.iteration, metadata)

    def maybe_save(self, step: int) -> SaveHandle | None:
        """:meth:`save` when ``step`` is a positive multiple of ``every_n_steps``; else None.

        A save due right after the last batch of an epoch is taken once that epoch is over —
        when that loader's next epoch starts (through :meth:`iterate`, or a plain loop over it
        after :meth:`take_over`), or at :meth:`wait` / :meth:`close` — so it holds the epoch's
        end work too (an epoch-interval scheduler step, an evaluation) and a resumed run starts
        the next epoch, whatever its loop looks like (``while loader.iteration < epochs`` or
        ``for epoch in range(start, epochs)``)."""
        check_step(step)
        if self._deferred and not self._deferred[1] and step != self._deferred[0]:
            self._deferred = None  # a memory resume's step: the state has moved on since
        self._preemption.seen(step)
        if self._watchdog is not None:
            self._watchdog.progress(step)
        if self._memory is not None:
            self._memory.maybe_take(step, self._loaders)
        if self._pace is not None:
            if not self._pace.due(step, self._handles):
                return None
        elif self.every_n_steps is None or step <= 0 or step % self.every_n_steps:
            return None
        ended = self._loaders.at_epoch_end()
        if ended:
            self._deferred = (step, ended)
            return None
        return self.save(step)

    def _save_deferred(self) -> None:
        if self._deferred is not None:
            self.save(self._deferred[0])

    def _epoch(self, index: int) -> Iterator[Any]:
        """One epoch of prepared DataLoader ``index``, its position tracked: the iteration of
        :meth:`iterate` and of a tracked loader's own ``for`` loop."""

        def before() -> None:
            if self._deferred is not None and index in self._deferred[1]:
                self._save_deferred()  # the epoch is over, the next one not begun

        def boundary() -> None:  # a batch boundary: stop here for a preemption
            self._preemption.at_boundary(self, self._save_and_wait)

        return self._loaders.epoch(
            index, before=before, watchdog=lambda: self._watchdog, boundary=boundary
        )

    def _save(
        self,
        step: int,
        iteration: int,
        metadata: dict[str, Any] | None,
        weights: list[dict[str, Any]] | None = None,  # the models' state dicts, after the hooks
    ) -> SaveHandle | None:
        check_step(step)
        _writer.refuse_save(self.read_only, self.store.url)
        started = time.monotonic()
        self._deferred = None  # a due save not taken yet: this one holds newer state
        self._preemption.saved = step
        if self._watchdog is not None:
            self._watchdog.progress(step)
        acc = self.accelerator
        _layout.check_prepared(acc)
        _layout.check_loaders(acc)
        local = _state.process_state(acc, self._loaders)
        self._settle(block=False)  # earlier failed saves: warned about, or raised, everywhere
        verdict = _state.check_replicas(acc, self.sharded, self.replica_check, self._collect)
        if verdict.skip_save:
            return None
        if verdict.audit():
            metadata = {**(metadata or {}), "replica_repair": verdict.audit()}
        processes = (collectives.gather if self.sharded else collectives.gather_to)(local)
        if self.sharded:
            models, optimizers = _state.sharded(acc)  # every process: its own shards
        elif not acc.is_main_process:
            return None
        else:
            models, optimizers = _state.full(acc, weights)
        assert processes is not None  # on every process that saves
        state = _state.checkpoint(acc, models, optimizers, iteration, processes)
        handle = self._failures.start(  # None: the limit was reached (raised at the next call)
            lambda: self.store.save(state, step, metadata=metadata, world_size=len(processes)),
            lambda: self._collect(block=False),
        )
        if handle is not None:
            self._handles.append(handle)
        if self._pace is not None:
            self._pace.saved(step, started)
        return handle

    def _settle(self, *, block: bool, everywhere: bool = True) -> None:
        """Collect the main process's finished saves (all with ``block``) and apply the failure
        policy: warn about failed ones, or raise ``CheckpointError`` once
        ``max_consecutive_failures`` in a row failed. ``everywhere`` (on every process): the
        main process decides, every process warns or raises alike."""
        report = None
        if self.accelerator.is_main_process or self.store.distributed:
            # The engine's back-pressure: the next save waits for these anyway (max_in_flight).
            wait_for_room(self._handles, self.store.config.max_in_flight)
            self._collect(block=block)
            report = self._failures.report()
        if everywhere:
            report = share_report(report)
        if report is not None:
            self._failures.apply(report)

    def _collect(self, *, block: bool) -> None:
        self._preemption.committed(self._failures.collect(self._handles, block=block))

    def wait(self) -> None:
        """Wait until every pending save of this process committed (or failed: a failed save is
        warned about, see ``max_consecutive_failures``), and its memory step in flight.

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed.
        """
        self._save_deferred()
        self._settle(block=True, everywhere=False)
        self.store.wait()
        if self._memory is not None:
            self._memory.wait()

    # ------------------------------------------------------------------ loading

    def load(self, *, map_location: str | None = None) -> int | None:
        """Restore the newest committed checkpoint into the prepared objects on every process and
        return its step; None (nothing restored) when the store has no checkpoint.

        The main process picks the step and broadcasts it. Restores the models, optimizers,
        schedulers, scaler, registered objects, ``accelerator.step``, the project's save
        iteration, and this process's random state and DataLoader positions. ``map_location``
        is Accelerate's (``"on_device"``: new tensors on this process's device; else the CPU).
        With the memory tier on, the step every process can restore from node-local memory or
        a peer comes first when it is at least the store's newest (:attr:`resumed_tier` says
        which tier gave the step; each process's own random state and positions come with it).

        Raises:
            TypeError: a ``map_location`` Accelerate refuses (the same error).
            RuntimeError: called before ``accelerator.prepare``.
            ValueError: the checkpoint's layout (models, keys, shapes, optimizers, schedulers,
                registered objects, process count) differs from this run's, naming the difference.
            CorruptCheckpointError: every committed checkpoint is corrupt (on the main process;
                the others raise ``CoordinatorError`` naming it).
        """
        return self._load(None, _load_arguments.map_location(self.accelerator, map_location))

    def _load(self, pre_hooks: Callable[[int], list[Any]] | None, location: Any) -> int | None:
        """:meth:`load`; ``pre_hooks`` (or None) runs Accelerate's load pre-hooks given the
        restored step and returns the models the checkpoint's weights go to."""
        acc = self.accelerator
        _layout.check_prepared(acc)
        self._deferred = None  # the state it would have held is being replaced
        into = _state.live(acc, is_sharded=self.sharded)  # every process: FSDP1's is a collective
        found = _source.newest(acc, self.store, self._memory, into, location)
        if found is None:  # a fork of weights only starts from its source's weights
            return _fork.load_weights(acc, self._fk, sharded=self.sharded)
        step, state, self.resumed_tier = found
        # Accelerate's load pre-hooks: before the weights, which go to the models they leave
        models = list(_compat.models(acc)) if pre_hooks is None else pre_hooks(step)
        whole = not self.sharded  # a sharded state is checked by torch, on as many processes
        _layout.check_compatible(acc, state, _state.FORMAT, models, weights=whole, resizable=whole)
        mine = self._loaders.restore_saved(state["processes"])  # first: it may refuse
        _state.restore(acc, state, models, is_sharded=self.sharded, own=mine)
        rng.restore(mine["rng"])
        if self._pace is not None:
            self._pace.cadence.resumed(step)
        self._deferred = (step, set()) if _memory.lacked(self._memory, step) else None
        return step

    # ------------------------------------------------------------------ takeover

    def take_over(self) -> None:
        """Install the integration on the accelerator: ``accelerator.save_state()`` /
        ``load_state()`` go through this checkpointer, and every prepared DataLoader iterated
        directly (``for batch in loader``) is tracked as through :meth:`iterate`, so a
        mid-epoch resume is exact in plain loops too.

        ``save_state`` saves checkpoint ``project_configuration.iteration``, waits for its commit
        and increments the iteration, as Accelerate does; ``load_state`` restores the newest
        checkpoint and returns its step (None for an empty store), honours ``map_location`` and
        refuses (TypeError) arguments it cannot honour; the directory and ``save_state``'s
        serialization arguments are ignored, unless pre-hooks run (see :mod:`~._hooks`).
        ``skip_first_batches`` on a tracked loader returns the loader itself, skipping by index
        and still tracked (see :mod:`~._takeover`). :meth:`release` undoes all of it.

        Raises:
            RuntimeError: the accelerator is already taken over.
            TypeError: a prepared DataLoader whose iteration cannot be tracked.
        Raises (from the taken-over methods):
            ValueError: pre-hooks are registered and there is no checkpoint directory for them
                (no ``output_dir`` / ``input_dir`` and no automatic checkpoint naming).
        """
        _takeover.take_over(self._target())

    def follow(self) -> None:
        """Track the DataLoaders (and watch the optimizers) prepared since :meth:`take_over`;
        the launch flag calls it after every ``accelerator.prepare``."""
        _takeover.follow(self._target())
        _progress.watch_optimizers(self.accelerator, self._watchdog, self._watched, self._hooks)

    def release(self) -> None:
        """Undo :meth:`take_over`: the accelerator's own methods and loaders' iteration again."""
        _takeover.release(self._target())

    def _target(self) -> _takeover.Target:
        return _takeover.Target(
            owner=self,
            accelerator=self.accelerator,
            loaders=self._loaders,
            epoch=self._epoch,
            save=self._save_now,
            load=self._load,
        )

    def _save_now(self, iteration: int, weights: list[dict[str, Any]] | None) -> str:
        """``accelerator.save_state``: save checkpoint ``iteration`` and wait for its commit."""
        self._save(iteration, iteration + 1, None, weights)
        self._save_and_wait(None)
        return str(self.store.url)

    def _save_and_wait(self, step: int | None) -> None:
        """:meth:`save` ``step`` (None: nothing), then wait for every pending save's commit."""
        if step is not None:
            self.save(step)
        self._settle(block=True)  # on every process: all warn or raise alike
        self.store.wait()

    # ------------------------------------------------------------------ data position

    def iterate(self, dataloader: Any) -> Iterator[Any]:
        """Iterate one epoch of a prepared DataLoader, tracking the position saved with each
        checkpoint. After :meth:`load`, the first call continues the interrupted epoch exactly
        where it stood (same order, same random state), skipping the consumed batches. After
        :meth:`take_over` a plain ``for batch in dataloader`` is the same.

        Raises:
            ValueError: ``dataloader`` was not returned by ``accelerator.prepare``.
        """
        index = self._loaders.index(dataloader)
        if index is None:
            raise ValueError(
                "iterate() takes a DataLoader returned by accelerator.prepare(...); this one was "
                "not prepared by this accelerator"
            )
        return self._epoch(index)

    # ------------------------------------------------------------------ lifecycle

    def request_preemption(self, reason: str = "requested by the script") -> None:
        """On any process: save at the next batch boundary and exit 143, as on SIGTERM."""
        self._preemption.request(reason)

    @property
    def cadence(self) -> Cadence | None:
        """The adaptive interval of :meth:`maybe_save` (``max_overhead``/``expected_mtbf``)."""
        return self._pace.cadence if self._pace is not None else None

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first."""
        return self.store.steps()

    def close(self, *, finished: bool = True) -> None:
        """Wait for pending saves, stop the watchdog, release the store. ``finished=False``: this
        process is failing; its watchdog stops without telling the others (they find it dead).

        Raises:
            Exception: the error of a failed save.
        """
        self._preemption.stop()
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
            if self._pace is not None and self.accelerator.is_main_process:
                _pace.log_report(self._pace)
        finally:
            _memory.close(self._memory, self.store, finished=finished)
            self.store.close()

    def __enter__(self) -> IncrementalCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(finished=exc is None)

    def __repr__(self) -> str:
        return f"IncrementalCheckpointer({self.store.url!r}, every_n_steps={self.every_n_steps})"
