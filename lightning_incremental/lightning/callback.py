"""IncrementalCheckpoint: the engine as a Lightning callback. A schedule decides when
(:mod:`~.save_points`), the trainer's own checkpoint dump what, a
:class:`~lightning_incremental.core.CheckpointStore` saves it in the background; a restarted job
resumes by itself, random states and data position included (:mod:`~.resume`,
:mod:`~.data_position`), and a preemption notice costs no step (:mod:`~.preemption`)."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_incremental.core import CheckpointStore, ConfigError, SaveResult
from lightning_incremental.lightning import fit_checks, fork, memory, resume
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.lightning.callback_views import Views
from lightning_incremental.lightning.fit_state import (
    BetweenEpochs,
    Copies,
    FitState,
    TrainerLoop,
    open_fit_store,
)
from lightning_incremental.lightning.preemption import PreemptionPoint
from lightning_incremental.lightning.resume import KEY, ResumeHook, ResumeSource
from lightning_incremental.lightning.save_points import SaveNow, SavePoints
from lightning_incremental.lightning.saver import Saver
from lightning_incremental.lightning.schedule import Schedule
from lightning_incremental.runtime.cluster.watchdog import WatchdogConfig
from lightning_incremental.runtime.policy.failures import DEFAULT_MAX_CONSECUTIVE_FAILURES
from lightning_incremental.runtime.policy.preemption import PreemptionConfig
from lightning_incremental.runtime.session.options import RecoveryOptions

log = logging.getLogger(__name__)

DEFAULT_DIRNAME = "incremental_checkpoints"

_PATH = Union[str, Path]


class IncrementalCheckpoint(Views, Copies, Checkpoint):
    """Save the complete training state incrementally on a schedule; resume from it exactly.

    Each save writes what ``trainer.save_checkpoint`` would (weights, optimizers, schedulers,
    loops, callbacks, precision plugin, hyper-parameters, datamodule) plus every rank's random
    state and data position, through a :class:`~lightning_incremental.core.CheckpointStore`:
    the training loop waits only for the state to be copied; encoding and writing run in the
    background. When ``fit`` starts without a ``ckpt_path`` and the store holds a committed
    checkpoint, training resumes from the newest one.

    A save falls where a restarted run continues exactly: one due after the last batch of an epoch
    happens at the epoch's end, one due after a batch that validation follows happens after that
    validation. Only optimizer steps count (with gradient accumulation, saves happen after the
    step). It is a Lightning :class:`~lightning.pytorch.callbacks.Checkpoint`: it runs after every
    other callback, and Lightning adds no default ``ModelCheckpoint`` next to it (add one for
    "best"/"last" ``.ckpt`` files, in another directory).

    Args:
        dirpath: where checkpoints go: a local path or any fsspec URL (``s3://bucket/run``). It
            must outlive the job and, under DDP, be readable by every rank. Default:
            ``<trainer.default_root_dir>/incremental_checkpoints`` (one fixed location, so a
            restarted job finds it).
        every_n_train_steps: save every this many optimizer steps (``trainer.global_step``).
        train_time_interval: save when this much time passed since the last save (checked after
            each optimizer step; rank 0's clock decides).
        every_n_epochs: save at the end of every this many epochs. When none of the three is
            given, ``every_n_epochs=1``; ``0`` disables a schedule. At most one may be active.
        max_overhead, expected_mtbf: adapt a step interval to the measured cost of a save: the
            fraction of training time checkpointing may cost (``0.02``), and/or the job's mean
            time between failures in seconds for Young/Daly's optimum interval; then
            ``every_n_train_steps`` is the shortest interval. Logged; see :attr:`cadence`.
        save_on_exception: save when ``fit`` fails, if the state is consistent (not in the middle
            of a training step or of validation) and training is not distributed.
        save_on_train_end: save when training ends, unless that step is already saved.
        resume: resume automatically from the newest committed checkpoint when ``fit`` gets no
            ``ckpt_path``. When False, ``dirpath`` must not hold checkpoints yet.
        keep_last: keep only the newest ``keep_last`` checkpoints (None keeps all).
        full_every: every ``full_every``-th checkpoint is a full base (engine default: 10).
        max_chain: longest chain of deltas a chunk may depend on (engine default: 8).
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        allow_pickle: allow values that need pickling (and loading them, which executes code).
        optimizer_state: ``"exact"`` (default: lossless, restored bit-exact), ``"bf16"`` or
            ``"int8"``: optimizer moments (``exp_avg``, ``exp_avg_sq``) stored quantized, about
            2x or 4x fewer bytes for them; a resume from such a checkpoint is not bit-exact
            (see :mod:`lightning_incremental.core.codecs.optimizer_state`). Weights stay lossless.
        store_options: any other :class:`~lightning_incremental.core.StoreConfig` field
            (``chunk_size``, ``compression_level``, ``xor_base_memory``, ``max_in_flight``, ...).
        max_consecutive_failures: a save that fails in the background (storage error, full
            disk) commits nothing; it is logged and warned about on every rank (naming the step,
            the store and the error) and training goes on from the previous committed
            checkpoint. This many failed saves in a row raise ``CheckpointError`` on every rank
            instead; a committed save resets the count. 1: stop at the first failure.
        watchdog: the heartbeat watchdog (:mod:`lightning_incremental.runtime.cluster.watchdog`): a
            rank that dies, hangs or loses the job's TCPStore ends every process with a distinct
            exit code (86 dead peer, 87 hung peer, 88 isolated), so ``torchrun --max-restarts``
            restarts the group. Default None: on in multi-process runs.
        heartbeat_interval, heartbeat_timeout, progress_timeout: the watchdog's windows in
            seconds: between heartbeats; without one a rank is dead (at least 3 intervals; also
            how long a rank may lose the store); without a finished batch a rank is hung.
        replica_check: under DDP, before each checkpoint, compare a fingerprint of every rank's
            weights and optimizer state: ``"warn"`` logs a divergence (and skips the checkpoint
            if rank 0's copy is the odd one out), ``"repair"`` broadcasts the majority's copy
            and goes on, ``"stop"`` exits 89 (the group restarts from the last good
            checkpoint), ``"off"`` skips it; a diverged copy is never committed (see
            :mod:`lightning_incremental.runtime.policy.replica_policy`).
        recovery: ``watchdog``, the three timings, ``replica_check`` and
            ``max_consecutive_failures`` as one :class:`~lightning_incremental.runtime.
            RecoveryOptions` (then leave those at their defaults).
        preemption: what a preemption notice does (True: the defaults of
            :class:`~lightning_incremental.runtime.PreemptionConfig`; False: nothing).
            At SIGTERM or SIGINT (and SLURM's requeue signal), delivered any number of times, or
            :meth:`request_preemption`, every rank agrees at the next training batch's end,
            saves that step, waits for the commit and exits with code 143: a preemption costs
            no step, single-process or distributed.
        memory_every_n_train_steps, memory_replicas, memory_dir: the memory tier (off by
            default): every this many optimizer steps each rank's part of the checkpoint goes
            to node-local memory (``memory_dir``; default ``$LIGHTNING_INCREMENTAL_MEMORY_DIR``,
            else ``/dev/shm/lightning-incremental``) and onto ``memory_replicas`` other
            nodes; a restarted job resumes from the newest step every rank agrees on when it is
            at least the store's newest (see :mod:`~.memory`, :attr:`resumed_tier`).
        fork_from: ``"SRC[@STEP]"``: while ``dirpath`` holds no checkpoint, fork that step of
            the store at SRC (default its newest) into it and resume from it (no copy; pinned
            in SRC); a restart only checks that ``dirpath`` was forked from SRC.
        fork_weights_only: with ``fork_from``, take the step's model weights only: the run
            starts at step 0 (fresh optimizer and loops) and its checkpoints are deltas of those
            weights (the step is the store's delta base, not a step of it).

    Under ``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy`` every rank
    saves its own shards (the sharded state dicts of ``torch.distributed.checkpoint.state_dict``,
    nothing gathered) and a resume fills the live shards in place, from a checkpoint of any
    number of ranks (see :mod:`~.sharded`); there ``replica_check`` does not
    apply. DeepSpeed is refused.

    Every ``fit`` first checks that it can write ``dirpath``, before it resumes or trains: rank 0
    takes the writer lease and probes the store, claiming a new fencing generation in multi-process
    runs and under torchrun (see :mod:`lightning_incremental.runtime.cluster.writing`).

    Raises:
        TypeError: an argument of the wrong type.
        ConfigError: an invalid value or a conflicting combination (a ``ValueError``).
        WriterLeaseError: at ``fit``'s setup, another job writes ``dirpath`` (naming its host,
            pid and job). StoreNotWritableError: ``dirpath`` cannot be written. The other
            ranks raise the same types (``CoordinatorError`` subclasses), or CoordinatorError
            when rank 0 could not open the store otherwise (rank 0 raises its own error).
    """

    def __init__(
        self,
        dirpath: _PATH | None = None,
        *,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        max_overhead: float | None = None,
        expected_mtbf: float | None = None,
        save_on_exception: bool = True,
        save_on_train_end: bool = True,
        resume: bool = True,
        keep_last: int | None = None,
        full_every: int | None = None,
        max_chain: int | None = None,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        optimizer_state: str = "exact",
        store_options: dict[str, Any] | None = None,
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        watchdog: bool | None = None,
        heartbeat_interval: float = 5.0,
        heartbeat_timeout: float = 60.0,
        progress_timeout: float = 900.0,
        replica_check: str = "warn",
        recovery: RecoveryOptions | None = None,
        preemption: PreemptionConfig | bool = True,
        memory_every_n_train_steps: int | None = None,
        memory_replicas: int = 1,
        memory_dir: _PATH | None = None,
        fork_from: _PATH | None = None,
        fork_weights_only: bool = False,
    ) -> None:
        super().__init__()
        self.fork = fork.options(fork_from, fork_weights_only, resume=resume)
        self.memory = memory.MemoryOptions(
            memory_every_n_train_steps,
            memory_replicas,
            None if memory_dir is None else str(memory_dir),
        )
        self.preemption = PreemptionConfig.of(preemption)
        self.dirpath = fit_checks.dirpath(dirpath)
        self.schedule = Schedule.from_args(
            every_n_train_steps, every_n_epochs, train_time_interval, max_overhead, expected_mtbf
        )
        fit_checks.flags(
            save_on_exception=save_on_exception,
            save_on_train_end=save_on_train_end,
            resume=resume,
            allow_pickle=allow_pickle,
        )
        self.save_on_exception = save_on_exception
        self.save_on_train_end = save_on_train_end
        self.resume = resume
        self.storage_options = fit_checks.storage_options(storage_options)
        self.recovery = RecoveryOptions.resolve(
            recovery,
            watchdog=watchdog,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            progress_timeout=progress_timeout,
            replica_check=replica_check,
            max_consecutive_failures=max_consecutive_failures,
        )
        self.max_consecutive_failures = self.recovery.max_consecutive_failures
        self.store_config = fit_checks.store_config(
            keep_last, full_every, max_chain, allow_pickle, store_options, optimizer_state
        )
        # Lightning reads it from its first checkpoint callback: there is no "best" checkpoint
        # here, so `ckpt_path="best"` explains that it needs a ModelCheckpoint.
        self.best_model_path = ""
        self.watchdog = self.recovery.watchdog
        self.watchdog_config: WatchdogConfig = self.recovery.watchdog_config
        self.replica_check = self.recovery.replica_check
        self._reset_run_state()
        self._last_saved_step: int | None = None
        self._totals = {"saves": 0, "bytes_written": 0, "bytes_logical": 0, "blocked_s": 0.0}

    def _reset_run_state(self) -> None:
        fit = getattr(self, "_fit", None)
        if fit is not None and fit.watchdog is not None:  # a fit that never reached teardown
            fit.watchdog.stop(finished=False)
        self._fit = FitState(
            PreemptionPoint(self.preemption),
            SavePoints(
                self.schedule,
                save_on_train_end=self.save_on_train_end,
                save_on_exception=self.save_on_exception,
            ),
        )

    # ------------------------------------------------------------------ public

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    def request_preemption(self, reason: str = "requested by the script") -> None:
        """Save at the next batch's end and exit, as on SIGTERM; on any rank (they agree)."""
        self._fit.preemption.request(reason)

    def wait(self) -> list[SaveResult]:
        """Wait for the saves running in the background; returns their results (and logs their
        figures). Only global rank 0 saves (elsewhere this returns ``[]``), except in a sharded
        run, where every rank saves its shards and gets its own figures. A failed save is
        warned about (see ``max_consecutive_failures``). Also waits for this rank's memory
        step in flight (written and replicated).

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed, or this writer
                was fenced off by a newer generation of the job.
        """
        if self._fit.memory is not None:
            self._fit.memory.wait()
        if (saver := self._fit.saver) is None:
            return []
        results = saver.collect(block=True)
        saver.raise_failures()
        return results

    @override
    def state_dict(self) -> dict[str, Any]:
        """The newest step saved and running totals (saves, bytes written, logical bytes,
        seconds blocked) over the saves committed before this state was taken: a checkpoint's
        totals do not count that checkpoint itself, still being written."""
        return {"last_saved_step": self._last_saved_step, **self._totals}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = self._fit.saved_before(state_dict.get("last_saved_step"))
        self._totals.update((k, state_dict[k]) for k in self._totals if k in state_dict)

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:
            return
        self._reset_run_state()
        fit = self._fit
        strategy = trainer.strategy
        fit.sharded = _sharded.layout(strategy) == _sharded.SHARDED
        fit_checks.warn_late_module_hooks(pl_module)
        default = os.path.join(str(trainer.default_root_dir), DEFAULT_DIRNAME)
        url: str = strategy.broadcast(self.dirpath or default, src=0)
        fit.url = url
        fit_checks.check_model_checkpoints(trainer, url)
        # Run after every other callback, ModelCheckpoint included: the saved state then holds
        # what their hooks for the same event did, and `trainer.checkpoint_callback` stays theirs.
        # A save due at an epoch's end happens once Lightning has finished that epoch, before
        # any other callback starts the next one (see `_save_between_epochs`).
        others = [
            cb
            for cb in fit_checks.callbacks_of(trainer)
            if cb is not self and not (isinstance(cb, BetweenEpochs) and cb.owner is self)
        ]
        fit.front = BetweenEpochs(self, self._save_between_epochs)
        trainer.callbacks = [fit.front, *others, self]  # type: ignore[attr-defined]
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            rank_zero_info("IncrementalCheckpoint: disabled with fast_dev_run")
            fit.disabled = True
            return
        fit_checks.reachable_by_every_rank(url, trainer.world_size)
        fork.before_open(trainer, url, self.fork, self.storage_options)
        store = open_fit_store(trainer, fit, self._open_store, claim_unless_refused=self.resume)
        fork.load_weights(
            pl_module, url, self.fork, fit.newest, self.storage_options, sharded=fit.sharded
        )
        fit.saver = Saver(
            store,
            url,
            self._totals,
            trainer.loggers,
            self.max_consecutive_failures,
            sharded=fit.sharded,
        )
        fit.watchdog = self.recovery.start_watchdog(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            generation=fit.generation or 0,
        )
        fit_checks.fresh_unless_resuming(url, fit.newest, resume=self.resume)
        pickles = self.store_config.allow_pickle
        fit.memory = memory.start(
            self.memory, trainer, url, fit.generation, sharded=fit.sharded, allow_pickle=pickles
        )
        if self.resume:
            from_memory = fit.memory and partial(fit.memory.resume, trainer, fit.newest)
            source = ResumeSource(
                url, fit.sharded, fit.reader(self._open_store), fit.resumed, from_memory
            )
            fit.resume_hook = ResumeHook(source, trainer)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._fit.restored = True
        self._fit.payload = checkpoint.get(KEY)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit = self._fit
        if fit.disabled:
            return
        fit.points.train_started(time.monotonic(), self._last_saved_step)
        fit.preemption.start(trainer)
        step = trainer.global_step
        newest = fit.newest
        if fit.resumed_step is None and newest is not None and newest > step:
            raise ConfigError(
                f"{fit.url} already holds checkpoints up to step {newest}, but training "
                f"continues from step {step} (ckpt_path={trainer.ckpt_path!r}); checkpoint "
                "steps must increase. Use a new dirpath for this run, or let it resume from the "
                "newest checkpoint (no ckpt_path)."
            )
        if fit.restored:
            fit.restore_position(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._fit.disabled:
            self._fit.epoch_started(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._fit.disabled:
            self._fit.batch_started(trainer)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        fit = self._fit
        if fit.disabled:
            return
        if fit.watchdog is not None:
            fit.watchdog.progress(trainer.global_step)
        self._collect()
        if fit.preemption.at_batch_end(trainer, self._preempt_save):
            return
        loop, now = TrainerLoop(trainer, fit.saver), time.monotonic()
        decision = fit.points.after_batch(trainer.global_step, self._last_saved_step, now, loop)
        if decision is not None:
            self._save(trainer, decision)
        if fit.memory is not None:
            changed = trainer.global_step != fit.points.step_at_batch_start
            fit.memory.after_batch(trainer, changed, fit.epoch_record)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        fit = self._fit
        if fit.watchdog is not None:
            fit.watchdog.progress()
        if fit.points.started and not trainer.sanity_checking:  # validating inside a fit
            fit.preemption.hold_during_validation(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit = self._fit
        if fit.disabled or trainer.sanity_checking:
            return
        if fit.points.started and fit.preemption.at_batch_end(trainer, self._preempt_save):
            return
        decision = fit.points.at_validation_end(
            trainer.global_step, self._last_saved_step, sanity_checking=trainer.sanity_checking
        )
        if decision is not None:
            self._save(trainer, decision)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit.disabled:
            return
        self._collect()
        self._fit.points.at_epoch_end(
            trainer.current_epoch, trainer.global_step, self._last_saved_step
        )

    def _save_between_epochs(self, trainer: pl.Trainer) -> None:
        """The save due at the end of the previous epoch, now that Lightning finished it: the
        next epoch's start, before any callback or the LightningModule begins it."""
        if self._fit.disabled:
            return
        decision = self._fit.points.between_epochs(trainer.global_step, self._last_saved_step)
        if decision is not None:
            self._save(trainer, decision)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit = self._fit
        if fit.disabled:
            return
        decision = fit.points.at_train_end(trainer.global_step, self._last_saved_step)
        if decision is not None:
            self._save(trainer, decision)
        assert fit.saver is not None
        fit.saver.collect(block=True)
        final = fit.newest_committed() == trainer.global_step
        report, final = trainer.strategy.broadcast((fit.saver.failure_report(), final), src=0)
        if report is not None:  # every rank ends the same way: warns, or raises at the limit
            fit.saver.raise_failures(report)
        elif final and fit.memory is not None:  # the store holds the end: free the node's memory
            fit.memory.finish()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit.loop_skipped_after_memory():  # the end of training, not run by Lightning
            self.on_train_end(trainer, pl_module)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._fit.at_exception(trainer, exception, self._last_saved_step, self._save)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING.value:
            self._fit.shutdown(raise_errors=True)

    # ------------------------------------------------------------------ saving

    def _save(self, trainer: pl.Trainer, decision: SaveNow) -> None:
        """Save now, on every rank at once (see :meth:`Saver.save`)."""
        fit = self._fit
        assert fit.saver is not None
        step, previous, started = trainer.global_step, self._last_saved_step, time.monotonic()
        fit.points.save_started()
        self._last_saved_step = step  # before the dump: the checkpoint records it
        try:
            verdict = fit.check_replicas(trainer, self.replica_check)
            if verdict.skip_save:  # wait for the next scheduled save rather than retry now
                self._last_saved_step = previous
                fit.points.saved(time.monotonic())
                return
            state = resume.rank_state(trainer, decision.boundary, fit.epoch_record)
            fit.saver.save(
                trainer,
                step=step,
                reason=decision.reason,
                boundary=decision.boundary,
                rank_state=state,
                audit={"replica_repair": verdict.audit()} if verdict.audit() else None,
            )
        except BaseException:
            self._last_saved_step = previous
            fit.points.save_raised()  # no second attempt from on_exception
            raise
        fit.points.saved(time.monotonic(), step, started)

    def _collect(self) -> None:
        for result in self._fit.saver.collect(block=False) if self._fit.saver else []:
            self._fit.preemption.observe_save(result.total_s)

    def _preempt_save(self, trainer: pl.Trainer) -> None:
        if trainer.global_step not in (0, self._last_saved_step):
            self._save(trainer, SaveNow("preemption", boundary=not self._fit.points.epoch_open))
        self.wait()  # its commit (or its failure, raised)

    def _open_store(self, *, distributed: bool = False) -> CheckpointStore:
        assert self._fit.url is not None
        return CheckpointStore(
            self._fit.url,
            storage_options=self.storage_options,
            config=self.store_config,
            distributed=distributed,
        )
