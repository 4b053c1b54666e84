"""Where :class:`~.callback.IncrementalCheckpoint` saves: the save points of one ``fit``, as a
small state machine that knows no Trainer.

A checkpoint is due by the schedule (every n optimizer steps, after a time interval, at the end
of every n epochs), when training ends, or when ``fit`` fails. It is *taken* only where a
restarted run continues exactly as the uninterrupted one would:

- after an optimizer step inside an epoch, at once;
- after the last batch of an epoch: once Lightning has finished that epoch (its epoch-end
  bookkeeping, ``ReduceLROnPlateau``), i.e. at the next epoch's start or at the end of training;
- after a batch that a validation follows: after that validation;
- on an exception: only when no training step or validation was interrupted, the process is the
  whole run, and the failure is not one of our own saves.

The callback reports what happens (:meth:`SavePoints.batch_started`,
:meth:`~SavePoints.after_batch`, :meth:`~SavePoints.at_epoch_end`, ...); each report that should
save now returns a :class:`SaveNow`, and the callback saves and reports back
(:meth:`~SavePoints.saved`). What a decision needs from the training loop beyond plain values is
asked through :class:`Loop`, and only when the decision needs it (the time check is a
collective: rank 0's clock decides for every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_incremental.lightning.schedule import Schedule
from lightning_incremental.runtime.policy.cadence import Cadence

VALIDATION = "validation"  # after the validation that follows this batch
EPOCH_END = "epoch_end"  # at this epoch's end
BETWEEN_EPOCHS = "between_epochs"  # once Lightning finished the epoch: next epoch's start, or end


@dataclass(frozen=True)
class SaveNow:
    """Save now, for ``reason`` (``"step"``, ``"time"``, ``"epoch"``, ``"train_end"``,
    ``"exception"``); ``boundary``: between two epochs (the next one not begun)."""

    reason: str
    boundary: bool


@dataclass(frozen=True)
class Declined:
    """No save on an exception, for a reason the user is told."""

    why: str


@dataclass(frozen=True)
class BatchCounts:
    """The fit loop's batch counters over all epochs."""

    ready: int
    started: int
    processed: int
    completed: int


class Loop(Protocol):
    """What the decision after a batch asks the training loop, only when it needs it."""

    def time_due(self, due_here: bool) -> bool:
        """Whether the time interval passed, agreed by every rank (``due_here``: this rank's
        clock says so)."""
        ...

    def agree(self, due_here: bool) -> bool:
        """Rank 0's ``due_here``, on every rank."""
        ...

    def save_in_flight(self) -> bool:
        """A save's background work is still running (on this rank)."""
        ...

    def max_steps_reached(self) -> bool:
        """Training ends after this step (``max_steps``)."""
        ...

    def epoch_ends_here(self) -> bool:
        """This was the epoch's last batch."""
        ...

    def validation_follows(self) -> bool:
        """A validation runs after this batch."""
        ...


@dataclass
class SavePoints:
    """The save points of one ``fit`` (see the module documentation). ``last_saved``, the step
    saved last (restored from the checkpoint on resume), is the caller's: every decision takes
    it, and none saves that step twice."""

    schedule: Schedule
    save_on_train_end: bool = True
    save_on_exception: bool = True
    due: str | None = None  # a due save's reason, waiting for the next consistent point
    due_at: str | None = None  # where it is taken: VALIDATION, EPOCH_END or BETWEEN_EPOCHS
    started: bool = False  # training started (not only sanity checking)
    epoch_open: bool = False  # inside an epoch (a save now is not between epochs)
    step_at_batch_start: int = -1
    last_time: float = 0.0  # when the last save was taken (or training started)
    saving: bool = False  # a save is in progress
    failed: bool = False  # a save raised: the exception is our own
    cadence: Cadence | None = field(default=None, init=False)  # the adaptive interval, if any

    def __post_init__(self) -> None:
        self.cadence = self.schedule.cadence()

    def train_started(self, now: float, last_saved: int | None = None) -> None:
        self.started = True
        self.last_time = now
        if self.cadence is not None and last_saved is not None:
            self.cadence.resumed(last_saved)

    def epoch_started(self) -> None:
        self.epoch_open = True

    def batch_started(self, step: int) -> None:
        self.step_at_batch_start = step

    def after_batch(
        self, step: int, last_saved: int | None, now: float, loop: Loop
    ) -> SaveNow | None:
        """After a training batch that reached global step ``step``: save now, defer the save
        to the epoch's end or after the validation that follows, or nothing."""
        if step == self.step_at_batch_start:
            return None  # no optimizer step in this batch (gradient accumulation)
        reason = self.due
        cadence = self.cadence
        if cadence is not None:
            before = cadence.interval if cadence.choices else None
            cadence.step_ended(step, now, in_flight=loop.save_in_flight())
            if cadence.choices and cadence.interval != before:  # rank 0's choice is agreed
                choice = cadence.choices[-1].describe(cadence.config)
                rank_zero_info(f"IncrementalCheckpoint: {choice}")
            if loop.agree(cadence.due(step)):
                reason = "step"
        elif self.schedule.step_due(step):
            reason = "step"
        elif self.schedule.train_time_interval is not None and loop.time_due(
            self.schedule.time_due(now - self.last_time)
        ):
            reason = "time"
        if reason is None and self.save_on_train_end and loop.max_steps_reached():
            # Training ends here (max_steps), maybe mid-epoch: save before Lightning closes the
            # partial epoch, so that a run extended to more steps continues it exactly.
            reason = "train_end"
        if reason is None or step == last_saved:
            return None
        if loop.epoch_ends_here():
            self.due, self.due_at = reason, EPOCH_END
        elif loop.validation_follows():
            self.due, self.due_at = reason, VALIDATION
        else:
            return SaveNow(reason, boundary=False)
        return None

    def at_validation_end(
        self, step: int, last_saved: int | None, *, sanity_checking: bool
    ) -> SaveNow | None:
        """After a validation: the save deferred to it, if any."""
        if self.cadence is not None:
            self.cadence.interrupted()
        if sanity_checking or not self.started:
            return None
        if self.due is None or self.due_at != VALIDATION:
            return None
        reason = self.due
        self.due = self.due_at = None
        return SaveNow(reason, boundary=False) if step != last_saved else None

    def at_epoch_end(self, epoch: int, step: int, last_saved: int | None) -> None:
        """At the callbacks' end of epoch ``epoch``: a save due now is taken once Lightning has
        finished the epoch (after this hook it still steps ``ReduceLROnPlateau`` schedulers and
        completes the epoch; a checkpoint taken now would resume into that bookkeeping)."""
        self.epoch_open = False
        if self.cadence is not None:
            self.cadence.interrupted()
        reason = self.due
        if self.schedule.epoch_due(epoch):
            reason = "epoch"
        if reason is not None and step not in (0, last_saved):
            self.due, self.due_at = reason, BETWEEN_EPOCHS
        else:
            self.due = self.due_at = None

    def between_epochs(self, step: int, last_saved: int | None) -> SaveNow | None:
        """At the next epoch's start, before anything begins it: the save due at the previous
        epoch's end."""
        if self.due_at != BETWEEN_EPOCHS:
            return None
        reason, self.due, self.due_at = self.due, None, None
        if reason is not None and step not in (0, last_saved):
            return SaveNow(reason, boundary=True)
        return None

    def at_train_end(self, step: int, last_saved: int | None) -> SaveNow | None:
        """When training ends: a save still due, or the final one (``save_on_train_end``)."""
        achieved = self.cadence.achieved() if self.cadence is not None else None
        if self.cadence is not None and achieved is not None:
            rank_zero_info(
                f"IncrementalCheckpoint: checkpointing cost {achieved:.2%} of training time "
                f"({self.cadence.config.describe()}; intervals chosen: "
                f"{[c.interval for c in self.cadence.choices]})"
            )
        if (self.save_on_train_end or self.due) and step not in (0, last_saved):
            return SaveNow(self.due or "train_end", boundary=not self.epoch_open)
        return None

    def at_exception(
        self,
        step: int,
        last_saved: int | None,
        *,
        fitting: bool,
        world_size: int,
        validating: bool,
        batches: BatchCounts,
    ) -> SaveNow | Declined | None:
        """Whether the state at an exception is one a run can continue from: training started,
        no training step (data loading, forward, backward, optimizer step) or validation was in
        progress, and the process is the whole run (under DDP the other ranks may be anywhere,
        and collecting their state would need them). None: not saving, nothing to say."""
        if not self.save_on_exception or self.saving:
            return None
        if self.failed:
            return Declined("the exception is a failed save of IncrementalCheckpoint's own")
        if not self.started or not fitting:
            return None
        if world_size > 1:
            return Declined("under DDP the other ranks may be anywhere")
        if validating:
            return Declined("it interrupted a validation run")
        if step in (0, last_saved):
            return None
        finished = batches.ready == batches.started == batches.processed
        if not finished or batches.completed not in (batches.processed, batches.processed - 1):
            return Declined(
                f"it interrupted a training step (batch {batches.ready - 1}: data loading, "
                "forward, backward or optimizer step), so the state is not consistent"
            )
        return SaveNow("exception", boundary=not self.epoch_open)

    def save_started(self) -> None:
        self.saving = True

    def saved(self, now: float, step: int | None = None, started: float | None = None) -> None:
        """A save was taken (or skipped on purpose: the next one is the next scheduled one);
        ``step`` and ``started`` (when it began, on the clock of ``now``): it was taken."""
        self.saving = False
        self.last_time = now
        self.due = self.due_at = None
        cadence = self.cadence
        if cadence is not None and step is not None and started is not None:
            cadence.saved(step, now - started)

    def save_raised(self) -> None:
        """A save raised: no second attempt on the exception it causes."""
        self.saving = False
        self.failed = True
