"""IncrementalCheckpoint: the engine as a Lightning callback.

Hooks map to engine calls: a schedule decides when, the trainer's own checkpoint dump decides what
(exactly what ``trainer.save_checkpoint`` writes), a
:class:`~lightning_incremental.core.CheckpointStore` saves it in the background. On top, what a
restarted job needs to continue as if nothing had happened: automatic resume from the newest
committed checkpoint, and each rank's random state and position in its training data (see
:mod:`~.resume` and :mod:`~.data_position`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_incremental.core import CheckpointStore, ConfigError, SaveResult, StoreConfig
from lightning_incremental.core.commit import fencing
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import data_position as dp
from lightning_incremental.lightning import resume
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.lightning.resume import KEY, ResumeHook
from lightning_incremental.lightning.saver import Saver
from lightning_incremental.lightning.schedule import Schedule
from lightning_incremental.runtime import replica_policy
from lightning_incremental.runtime.coordinate import coordinated
from lightning_incremental.runtime.failures import DEFAULT_MAX_CONSECUTIVE_FAILURES
from lightning_incremental.runtime.options import RecoveryOptions
from lightning_incremental.runtime.watchdog import Watchdog, WatchdogConfig

log = logging.getLogger(__name__)

DEFAULT_DIRNAME = "incremental_checkpoints"
_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"

_PATH = Union[str, Path]


class IncrementalCheckpoint(Checkpoint):
    """Save the complete training state incrementally on a schedule; resume from it exactly.

    Each save writes what ``trainer.save_checkpoint`` would (weights, optimizers, schedulers,
    loops, callbacks, precision plugin, hyper-parameters, datamodule) plus every rank's random
    state and position in its training data, through a
    :class:`~lightning_incremental.core.CheckpointStore`: the training loop waits only for the
    state to be copied; encoding and writing run in the background. When ``fit`` starts without a
    ``ckpt_path`` and the store holds a committed checkpoint, training resumes from the newest one.

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
        watchdog: run the heartbeat watchdog (see :mod:`lightning_incremental.runtime.watchdog`):
            a rank that dies, hangs or loses the job's TCPStore ends every process with a
            distinct exit code (86 dead peer, 87 hung peer, 88 isolated) instead of waiting out
            a collective timeout, so ``torchrun --max-restarts`` restarts the group, which
            resumes from the newest checkpoint. Default None: on in multi-process runs.
        heartbeat_interval: seconds between heartbeats (and checks of the others').
        heartbeat_timeout: seconds without a heartbeat after which a rank is dead (at least 3
            intervals); also how long a rank may lose the store before it fences itself off.
        progress_timeout: seconds without a finished batch after which a rank is hung; longer
            than the slowest legitimate pause (a long validation, data loading, a checkpoint).
        replica_check: under DDP, before each checkpoint, compare a fingerprint of every rank's
            weights and optimizer state (one hash per tensor, gathered; see
            :mod:`lightning_incremental.runtime.replicas`). On a divergence: ``"warn"`` logs which
            rank and which tensors differ (and skips the checkpoint if rank 0's copy is the odd
            one out); ``"repair"`` broadcasts the reference copy (the majority's; rank 0's when
            two ranks disagree) to every rank, records the repair in the checkpoint's audit
            trail and goes on; ``"stop"`` ends every process with exit code 89 so the group
            restarts from the last good checkpoint; ``"off"`` skips the check. A diverged copy
            is never committed.
        recovery: all of ``watchdog``, the three timings, ``replica_check`` and
            ``max_consecutive_failures`` as one
            :class:`~lightning_incremental.runtime.RecoveryOptions` (then leave those at their
            defaults).

    Under ``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy`` every rank
    saves its own shards (the sharded state dicts of ``torch.distributed.checkpoint.state_dict``,
    nothing gathered) and a resume fills the live shards in place, from a checkpoint of any
    number of ranks (see :mod:`~.sharded`); there ``replica_check`` does not
    apply. DeepSpeed is refused.

    In multi-process runs (and under torchrun) every start of ``fit`` also claims a new fencing
    generation in the store: checkpoints a previous incarnation of the job writes afterwards — a
    frozen or cut-off rank 0 that wakes up — are never visible (see
    :mod:`lightning_incremental.core.commit.fencing`).

    Raises:
        TypeError: an argument of the wrong type.
        ConfigError: an invalid value or a conflicting combination (a ``ValueError``).
        CoordinatorError: at ``fit``'s setup, on the other ranks, rank 0 could not open the
            store (rank 0 raises its own error).
    """

    def __init__(
        self,
        dirpath: _PATH | None = None,
        *,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
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
    ) -> None:
        super().__init__()
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise TypeError(f"dirpath must be a path or URL string, got {type(dirpath).__name__}")
        if dirpath is not None and not os.fspath(dirpath):
            raise ConfigError("dirpath must not be empty; pass None for the default location")
        self.dirpath: str | None = os.fspath(dirpath) if dirpath is not None else None
        self.schedule = Schedule.from_args(every_n_train_steps, every_n_epochs, train_time_interval)
        for name, flag in (
            ("save_on_exception", save_on_exception),
            ("save_on_train_end", save_on_train_end),
            ("resume", resume),
            ("allow_pickle", allow_pickle),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.save_on_exception = save_on_exception
        self.save_on_train_end = save_on_train_end
        self.resume = resume
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self.storage_options = storage_options
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
        self.store_config = _store_config(
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
        dog = getattr(self, "_watchdog", None)
        if dog is not None:  # a previous fit that never reached teardown
            dog.stop(finished=False)
        self._url: str | None = None
        self._saver: Saver | None = None
        self._resume_hook: ResumeHook | None = None
        self._disabled = False
        self._newest: int | None = None
        self._resumed_step: int | None = None
        self._payload: dict[str, Any] | None = None  # per-rank state of the restored checkpoint
        self._restored = False
        self._train_started = False
        self._in_save = False
        self._save_failed = False
        self._due: str | None = None  # a scheduled save waiting for the next consistent point
        # "validation", "epoch_end" (this epoch's end) or "between_epochs" (once Lightning
        # finished the epoch: the next epoch's start, or the end of training)
        self._due_at: str | None = None
        self._finish_restart = False  # resumed mid-epoch: leave Lightning's restart mode
        self._front: _BetweenEpochs | None = None
        self._step_at_batch_start = -1
        self._last_time = 0.0
        self._epoch_open = False
        self._epoch_record: dict[str, Any] | None = None
        self._iter_at_epoch_start: object | None = None
        self._check_iter = False
        self._skip_epoch_record = False
        self._warnings_guard: warnings.catch_warnings[Any] | None = None
        self._generation: int | None = None
        self._watchdog: Watchdog | None = None
        self._sharded = False  # the strategy shards the state (see _sharded.layout)

    # ------------------------------------------------------------------ public

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    @property
    def every_n_train_steps(self) -> int:
        return self.schedule.every_n_train_steps

    @property
    def every_n_epochs(self) -> int:
        return self.schedule.every_n_epochs

    @property
    def train_time_interval(self) -> timedelta | None:
        return self.schedule.train_time_interval

    @property
    def url(self) -> str | None:
        """The store's location, resolved when ``fit`` starts."""
        return self._url

    @property
    def last_saved_step(self) -> int | None:
        """The newest step saved (or being saved) by this callback, restored on resume."""
        return self._last_saved_step

    @property
    def generation(self) -> int | None:
        """The fencing generation this ``fit`` claimed (multi-process runs), else None."""
        return self._generation

    @property
    def resumed_from(self) -> int | None:
        """The step this ``fit`` resumed from automatically, or None."""
        return self._resumed_step

    @property
    def results(self) -> list[tuple[SaveResult, float]]:
        """This ``fit``'s committed saves so far (on global rank 0; in a sharded run on every
        rank, each its own part): each engine
        :class:`~lightning_incremental.core.SaveResult` with the seconds the training loop was
        blocked for it."""
        return list(self._saver.results) if self._saver is not None else []

    def wait(self) -> list[SaveResult]:
        """Wait for the saves running in the background; returns their results (and logs their
        figures). Only global rank 0 saves (elsewhere this returns ``[]``), except in a sharded
        run, where every rank saves its shards and gets its own figures. A failed save is
        warned about (see ``max_consecutive_failures``).

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed, or this writer
                was fenced off by a newer generation of the job.
        """
        if self._saver is None:
            return []
        results = self._saver.collect(block=True)
        self._saver.raise_failures()
        return results

    @override
    def state_dict(self) -> dict[str, Any]:
        """The newest step saved and running totals (saves, bytes written, logical bytes,
        seconds blocked) over the saves committed before this state was taken: a checkpoint's
        totals do not count that checkpoint itself, still being written."""
        return {"last_saved_step": self._last_saved_step, **self._totals}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = state_dict.get("last_saved_step")
        for key in self._totals:
            if key in state_dict:
                self._totals[key] = state_dict[key]

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:
            return
        self._reset_run_state()
        strategy = trainer.strategy
        self._sharded = _sharded.layout(strategy) == _sharded.SHARDED
        _warn_late_module_hooks(pl_module)
        default = os.path.join(str(trainer.default_root_dir), DEFAULT_DIRNAME)
        self._url = strategy.broadcast(self.dirpath or default, src=0)
        self._check_model_checkpoints(trainer)
        # Run after every other callback, ModelCheckpoint included: the saved state then holds
        # what their hooks for the same event did, and `trainer.checkpoint_callback` stays theirs.
        # A save due at an epoch's end happens once Lightning has finished that epoch, before
        # any other callback starts the next one (see `_save_between_epochs`).
        others = [
            cb
            for cb in _callbacks_of(trainer)
            if cb is not self and not (isinstance(cb, _BetweenEpochs) and cb.owner is self)
        ]
        self._front = _BetweenEpochs(self)
        trainer.callbacks = [self._front, *others, self]  # type: ignore[attr-defined]
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            rank_zero_info("IncrementalCheckpoint: disabled with fast_dev_run")
            self._disabled = True
            return
        if trainer.world_size > 1 and self._url.startswith("memory://"):
            raise ConfigError(
                f"dirpath {self._url} is in-process memory, which other ranks cannot read: "
                "use a path or URL every rank can reach"
            )
        # Rank 0 opens the store; whatever happens there, every rank learns it, so a failure
        # never leaves the other ranks waiting in a collective. Sharded over several ranks,
        # every rank then opens the store it saves its own shards through (a collective).
        distributed = self._sharded and trainer.world_size > 1
        store: CheckpointStore | None = None

        def open_store() -> tuple[int | None, int | None]:
            nonlocal store
            store = self._open_store()
            try:
                steps = store.steps()
                newest = steps[-1] if steps else None
                generation = None
                # A new incarnation of the job fences off the previous ones — unless this run is
                # about to refuse the store (resume=False on a store in use: not ours to take).
                if fencing.should_claim(trainer.world_size) and (
                    self.resume or newest is None
                ):  # the claim keeps what is visible
                    generation = store.claim_generation(fencing.restart_count())
            except BaseException:
                store.close()
                raise
            if distributed:
                store.close()
                store = None
            return newest, generation

        self._newest, self._generation = coordinated(
            open_store,
            what=f"open the checkpoint store {self._url}",
            is_coordinator=trainer.is_global_zero,
            broadcast=strategy.broadcast,
        )
        if distributed:
            store = self._open_store(distributed=True)
        self._saver = Saver(
            store,
            self._url,
            self._totals,
            trainer.loggers,
            self.max_consecutive_failures,
            sharded=self._sharded,
        )
        self._watchdog = self.recovery.start_watchdog(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            generation=self._generation or 0,
        )
        if not self.resume and self._newest is not None:
            raise ConfigError(
                f"IncrementalCheckpoint(resume=False) but {self._url} already holds checkpoints "
                f"(newest: step {self._newest}); a new run cannot write steps it already holds. "
                "Use an empty dirpath for a new run, or resume=True to continue that one."
            )
        if self.resume:
            self._resume_hook = ResumeHook(self, trainer)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._restored = True
        self._payload = checkpoint.get(KEY)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled:
            return
        self._train_started = True
        self._last_time = time.monotonic()
        step = trainer.global_step
        newest = self._newest
        if self._resumed_step is None and newest is not None and newest > step:
            raise ConfigError(
                f"{self._url} already holds checkpoints up to step {newest}, but training "
                f"continues from step {step} (ckpt_path={trainer.ckpt_path!r}); checkpoint "
                "steps must increase. Use a new dirpath for this run, or let it resume from the "
                "newest checkpoint (no ckpt_path)."
            )
        if self._restored:
            self._restore_position(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled:
            return
        self._epoch_open = True
        if self._skip_epoch_record:  # this epoch's iterator was just recreated from a record
            self._skip_epoch_record = False
            return
        self._epoch_record = dp.record_epoch_start(trainer, iter_created=False)
        self._iter_at_epoch_start = dp.epoch_iterator(trainer)
        self._check_iter = True

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._disabled:
            return
        self._close_warnings_guard()
        if self._finish_restart:
            self._finish_restart = False
            _compat.finish_restart(trainer)
        if self._check_iter:  # did Lightning create this epoch's iterator before or after us?
            self._check_iter = False
            if self._epoch_record is not None:
                created = dp.epoch_iterator(trainer) is self._iter_at_epoch_start
                self._epoch_record["iter_created"] = created
            self._iter_at_epoch_start = None
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._disabled:
            return
        if self._watchdog is not None:
            self._watchdog.progress(trainer.global_step)
        self._collect()
        step = trainer.global_step
        if step == self._step_at_batch_start:
            return  # no optimizer step in this batch (gradient accumulation)
        reason = self._due
        if self.schedule.step_due(step):
            reason = "step"
        elif self.schedule.train_time_interval is not None:
            due = self.schedule.time_due(time.monotonic() - self._last_time)
            if trainer.strategy.broadcast(due, src=0):  # rank 0's clock decides for all
                reason = "time"
        if reason is None and self.save_on_train_end and _compat.max_steps_reached(trainer):
            # Training ends here (max_steps), maybe mid-epoch: save before Lightning closes the
            # partial epoch (its epoch-end hooks and bookkeeping), so that a run extended to
            # more steps continues this epoch exactly as a longer run would.
            reason = "train_end"
        if reason is None or step == self._last_saved_step:
            return
        # Save where a restarted run continues exactly: after this epoch's last batch, once the
        # epoch is over (the resumed run starts the next epoch); before a validation, after it
        # (the resumed run skips that validation, but the validation changed random state and
        # the monitoring callbacks' state).
        if _compat.epoch_ends_here(trainer):
            self._due, self._due_at = reason, "epoch_end"
        elif _compat.validation_follows(trainer):
            self._due, self._due_at = reason, "validation"
        else:
            self._save(trainer, reason, boundary=False)

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
        if self._watchdog is not None:
            self._watchdog.progress()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled or trainer.sanity_checking or not self._train_started:
            return
        if self._due is not None and self._due_at == "validation":
            if trainer.global_step != self._last_saved_step:
                self._save(trainer, self._due, boundary=False)
            self._due = self._due_at = None

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled:
            return
        self._epoch_open = False
        self._collect()
        reason = self._due
        if self.schedule.epoch_due(trainer.current_epoch):
            reason = "epoch"
        if reason is not None and trainer.global_step not in (0, self._last_saved_step):
            # Not yet: after the callbacks' hook, Lightning still steps ReduceLROnPlateau
            # schedulers and completes the epoch. A checkpoint taken now would resume into the
            # middle of that bookkeeping.
            self._due, self._due_at = reason, "between_epochs"
        else:
            self._due = self._due_at = None

    def _save_between_epochs(self, trainer: pl.Trainer) -> None:
        """The save due at the end of the previous epoch, now that Lightning finished it: the
        next epoch's start, before any callback or the LightningModule begins it."""
        if self._disabled or self._due_at != "between_epochs":
            return
        reason, self._due, self._due_at = self._due, None, None
        if reason is not None and trainer.global_step not in (0, self._last_saved_step):
            self._save(trainer, reason, boundary=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled:
            return
        step = trainer.global_step
        if (self.save_on_train_end or self._due) and step not in (0, self._last_saved_step):
            self._save(trainer, self._due or "train_end", boundary=not self._epoch_open)
        assert self._saver is not None
        self._saver.collect(block=True)
        report = trainer.strategy.broadcast(self._saver.failure_report(), src=0)
        if report is not None:  # every rank ends the same way: warns, or raises at the limit
            self._saver.raise_failures(report)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            if self._should_save_on_exception(trainer):
                self._save(trainer, "exception", boundary=not self._epoch_open)
            if self._saver is not None:
                self._saver.collect(block=True)
                self._saver.log_failures()
        except Exception:  # the training error propagates; this one must be seen too
            log.exception("IncrementalCheckpoint: saving after %r failed", exception)
        finally:
            self._shutdown(raise_errors=False, finished=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING.value:
            self._shutdown(raise_errors=True)

    # ------------------------------------------------------------------ saving

    def _save(self, trainer: pl.Trainer, reason: str, *, boundary: bool) -> None:
        """Save now, on every rank at once (see :meth:`Saver.save`)."""
        assert self._saver is not None
        step, previous = trainer.global_step, self._last_saved_step
        self._in_save = True
        self._last_saved_step = step  # before the dump: the checkpoint records it
        try:
            verdict = self._check_replicas(trainer)
            if verdict.skip_save:  # wait for the next scheduled save rather than retry now
                self._last_saved_step = previous
                self._last_time = time.monotonic()
                self._due = self._due_at = None
                return
            state = resume.rank_state(trainer, boundary, self._epoch_record)
            self._saver.save(
                trainer,
                step=step,
                reason=reason,
                boundary=boundary,
                rank_state=state,
                audit={"replica_repair": verdict.audit()} if verdict.audit() else None,
            )
        except BaseException:
            self._last_saved_step = previous
            self._save_failed = True  # no second attempt from on_exception
            raise
        finally:
            self._in_save = False
        self._last_time = time.monotonic()
        self._due = self._due_at = None

    def _check_replicas(self, trainer: pl.Trainer) -> replica_policy.Verdict:
        """Compare the replicas' weights and optimizer state (every rank at once); see
        :func:`~lightning_incremental.runtime.replica_policy.check_before_save`."""
        if trainer.world_size == 1 or self._sharded:  # shards differ by design
            return replica_policy.Verdict(None)
        saver = self._saver
        assert saver is not None
        return replica_policy.check_before_save(
            lambda: replicated_state(trainer),
            self.replica_check,
            finish_saves=lambda: saver.collect(block=True),
            barrier=trainer.strategy.barrier,
        )

    def _collect(self) -> None:
        if self._saver is not None:
            self._saver.collect(block=False)

    def _should_save_on_exception(self, trainer: pl.Trainer) -> bool:
        """Whether the state at an exception is one a run can continue from: training started,
        no training step (data loading, forward, backward, optimizer step) or validation was in
        progress, and the process is the whole run (under DDP the other ranks may be anywhere,
        and collecting their state would need them)."""
        if not self.save_on_exception or self._disabled or self._in_save:
            return False
        if self._save_failed:
            return self._why_not("the exception is a failed save of IncrementalCheckpoint's own")
        if not self._train_started or trainer.state.fn != TrainerFn.FITTING:
            return False
        if trainer.world_size > 1:
            return self._why_not("under DDP the other ranks may be anywhere")
        if trainer.sanity_checking or trainer.validating:
            return self._why_not("it interrupted a validation run")
        step = trainer.global_step
        if step in (0, self._last_saved_step):
            return False
        total: Any = _compat.batch_progress_total(trainer)
        finished = total.ready == total.started == total.processed
        if not finished or total.completed not in (total.processed, total.processed - 1):
            return self._why_not(
                f"it interrupted a training step (batch {total.ready - 1}: data loading, "
                "forward, backward or optimizer step), so the state is not consistent"
            )
        return True

    def _why_not(self, reason: str) -> bool:
        newest = self._saver.last_committed if self._saver is not None else None
        last = f"newest committed checkpoint: step {newest}" if newest is not None else "none yet"
        rank_zero_warn(f"IncrementalCheckpoint: not saving on exception: {reason} ({last}).")
        return False

    # ------------------------------------------------------------------ resuming

    def _restore_position(self, trainer: pl.Trainer) -> None:
        restored = resume.restore_rank_state(trainer, self._payload)
        self._payload = None
        if restored is None:
            return
        self._epoch_record = restored.epoch_record
        self._skip_epoch_record = restored.recreated and not restored.mid_epoch
        self._epoch_open = restored.mid_epoch
        self._finish_restart = restored.mid_epoch
        if restored.mid_epoch and restored.epoch_record is not None:
            # Lightning warns that a plain dataloader restarts its epoch: here it does not.
            self._warnings_guard = warnings.catch_warnings()
            self._warnings_guard.__enter__()
            warnings.filterwarnings(
                "ignore", message=_LIGHTNING_NOT_RESUMABLE, category=PossibleUserWarning
            )

    def _close_warnings_guard(self) -> None:
        guard, self._warnings_guard = self._warnings_guard, None
        if guard is not None:
            guard.__exit__(None, None, None)

    def _check_model_checkpoints(self, trainer: pl.Trainer) -> None:
        assert self._url is not None
        mine = _local(self._url)
        for cb in _callbacks_of(trainer):
            theirs = cb.dirpath if isinstance(cb, ModelCheckpoint) else None
            if theirs and mine is not None and _local(os.fspath(theirs)) == mine:
                raise ConfigError(
                    f"IncrementalCheckpoint and ModelCheckpoint share the directory {mine}: "
                    "ModelCheckpoint writes plain .ckpt files there, which the incremental "
                    "store does not manage. Give them different directories."
                )

    def _shutdown(self, *, raise_errors: bool, finished: bool = True) -> None:
        """End this ``fit``'s machinery. ``finished``: training ended normally; otherwise the
        watchdog stops without telling the others this rank is done (if they wait for it, they
        must find it dead and restart rather than wait out a collective timeout)."""
        dog, self._watchdog = self._watchdog, None
        if dog is not None:
            dog.stop(finished=finished)
        self._close_warnings_guard()
        hook, self._resume_hook = self._resume_hook, None
        if hook is not None:
            hook.remove()
        if self._saver is not None:
            self._saver.close(raise_errors=raise_errors)

    def _open_store(self, *, distributed: bool = False) -> CheckpointStore:
        assert self._url is not None
        return CheckpointStore(
            self._url,
            storage_options=self.storage_options,
            config=self.store_config,
            distributed=distributed,
        )

    @contextlib.contextmanager
    def _store_for_reading(self) -> Iterator[CheckpointStore]:
        """The writing store where this rank has one (rank 0; every rank of a sharded run): a
        resumed run's first save then builds on what it loaded. Elsewhere a store closed after
        reading. Used by ResumeHook."""
        store = self._saver.store if self._saver is not None else None
        if store is not None:
            yield store
            return
        store = self._open_store()
        try:
            yield store
        finally:
            store.close()


class _BetweenEpochs(Callback):
    """Runs first among the trainer's callbacks, to take the checkpoint due at an epoch's end
    once Lightning finished that epoch and before anything begins the next one (it holds no
    state; ``IncrementalCheckpoint`` adds it to the trainer in ``setup``)."""

    def __init__(self, owner: IncrementalCheckpoint) -> None:
        self.owner = owner

    @property
    @override
    def state_key(self) -> str:
        return f"{type(self).__qualname__}[{self.owner.state_key}]"

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.owner._save_between_epochs(trainer)


def replicated_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What data-parallel replicas must hold identically: the parameters and the optimizers'
    state. Not the buffers: under DDP each rank updates running statistics (BatchNorm) from its
    own batch, and DDP broadcasts rank 0's at the next forward, so they legitimately differ.
    The tensors share storage with the live ones (a repair writes into them)."""
    module = trainer.lightning_module
    return {
        "model": {name: p.detach() for name, p in module.named_parameters()},
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
    }


def _callbacks_of(trainer: pl.Trainer) -> list[Callback]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return callbacks


def _store_config(
    keep_last: int | None,
    full_every: int | None,
    max_chain: int | None,
    allow_pickle: bool,
    store_options: dict[str, Any] | None,
    optimizer_state: str = "exact",
) -> StoreConfig:
    """The engine's configuration from the callback's arguments (validated by StoreConfig)."""
    if store_options is not None and not isinstance(store_options, dict):
        raise TypeError(f"store_options must be a dict, got {type(store_options).__name__}")
    options = dict(store_options or {})
    named = {"keep_last": keep_last, "full_every": full_every, "max_chain": max_chain}
    repeated = sorted(k for k, v in named.items() if v is not None and k in options)
    repeated += [k for k in ("allow_pickle", "optimizer_state") if k in options]
    if repeated:
        raise ConfigError(
            f"store_options repeats {', '.join(repeated)}: pass it as an argument of "
            "IncrementalCheckpoint"
        )
    options.update({k: v for k, v in named.items() if v is not None})
    return StoreConfig().replace(
        allow_pickle=allow_pickle, optimizer_state=optimizer_state, **options
    )


def _local(url: str) -> str | None:
    """A local path's canonical form; None for remote URLs."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        return None
    return os.path.realpath(os.path.expanduser(url))


def _warn_late_module_hooks(pl_module: pl.LightningModule) -> None:
    """Lightning calls a LightningModule's ``on_train_batch_end`` / ``on_validation_end`` after
    the callbacks' hooks of the same event: what they change at a checkpointed step is not in
    that checkpoint, and a resume does not replay them."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    late = [h for h in ("on_train_batch_end", "on_validation_end") if is_overridden(h, pl_module)]
    if late:
        rank_zero_warn(
            f"{type(pl_module).__name__} overrides {' and '.join(late)}, which Lightning runs "
            "after IncrementalCheckpoint has taken the checkpoint of that step: state changed "
            "there (e.g. an EMA, a counter, random draws) is not in the checkpoint, so a resume "
            "is not bit-exact for it. Move that work into training_step, or into a Callback "
            "(callbacks run before IncrementalCheckpoint).",
            category=PossibleUserWarning,
        )
