"""The callback's save points, without a Trainer: each report of the training loop and what it
decides (save now, defer, nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import pytest

from lightning_incremental.lightning.save_points import (
    BETWEEN_EPOCHS,
    EPOCH_END,
    VALIDATION,
    BatchCounts,
    Declined,
    SaveNow,
    SavePoints,
)
from lightning_incremental.lightning.schedule import Schedule


@dataclass
class FakeLoop:
    """The training loop as the decisions see it; records which questions were asked."""

    time: bool = False
    max_steps: bool = False
    epoch_end: bool = False
    validation: bool = False
    asked: list[str] = field(default_factory=list)

    def time_due(self, due_here: bool) -> bool:
        self.asked.append(f"time:{due_here}")
        return self.time

    def max_steps_reached(self) -> bool:
        self.asked.append("max_steps")
        return self.max_steps

    def epoch_ends_here(self) -> bool:
        self.asked.append("epoch_end")
        return self.epoch_end

    def validation_follows(self) -> bool:
        self.asked.append("validation")
        return self.validation


def points(**schedule: object) -> SavePoints:
    sp = SavePoints(Schedule(**schedule))  # type: ignore[arg-type]
    sp.train_started(now=0.0)
    sp.epoch_started()
    return sp


def batch(sp: SavePoints, step: int, loop: FakeLoop, last: int | None = None, now: float = 0.0):
    sp.batch_started(step - 1)
    return sp.after_batch(step, last, now, loop)


FINISHED = BatchCounts(ready=4, started=4, processed=4, completed=4)


def test_a_step_schedule_saves_inside_the_epoch_at_once() -> None:
    sp = points(every_n_train_steps=2)
    assert batch(sp, 1, FakeLoop()) is None
    assert batch(sp, 2, FakeLoop()) == SaveNow("step", boundary=False)
    assert batch(sp, 2, FakeLoop(), last=2) is None  # that step is saved already


def test_no_optimizer_step_no_decision() -> None:
    sp = points(every_n_train_steps=1)
    sp.batch_started(3)
    loop = FakeLoop(max_steps=True)
    assert sp.after_batch(3, None, 0.0, loop) is None  # gradient accumulation
    assert loop.asked == []


def test_a_save_due_at_the_epochs_last_batch_waits_for_the_next_epoch() -> None:
    sp = points(every_n_train_steps=2)
    assert batch(sp, 2, FakeLoop(epoch_end=True)) is None
    assert (sp.due, sp.due_at) == ("step", EPOCH_END)
    sp.at_epoch_end(epoch=0, step=2, last_saved=None)
    assert (sp.due, sp.due_at, sp.epoch_open) == ("step", BETWEEN_EPOCHS, False)
    assert sp.between_epochs(step=2, last_saved=None) == SaveNow("step", boundary=True)
    assert (sp.due, sp.due_at) == (None, None)
    assert sp.between_epochs(step=2, last_saved=None) is None  # taken once


def test_a_save_before_a_validation_is_taken_after_it() -> None:
    sp = points(every_n_train_steps=2)
    assert batch(sp, 2, FakeLoop(validation=True)) is None
    assert sp.due_at == VALIDATION
    assert sp.at_validation_end(2, None, sanity_checking=True) is None  # not that one
    assert sp.at_validation_end(2, None, sanity_checking=False) == SaveNow("step", False)
    assert sp.due is None and sp.at_validation_end(2, None, sanity_checking=False) is None


def test_a_validation_after_the_step_was_saved_clears_the_due_save() -> None:
    sp = points(every_n_train_steps=2)
    batch(sp, 2, FakeLoop(validation=True))
    assert sp.at_validation_end(2, 2, sanity_checking=False) is None
    assert sp.due is None


def test_the_time_schedule_asks_the_ranks_only_when_the_step_is_not_due() -> None:
    sp = points(train_time_interval=timedelta(seconds=10))
    loop = FakeLoop(time=False)
    assert batch(sp, 1, loop, now=11.0) is None
    assert loop.asked[0] == "time:True"  # this rank's clock says so; rank 0's decides
    loop = FakeLoop(time=True)
    assert batch(sp, 2, loop, now=5.0) == SaveNow("time", False)
    assert loop.asked[0] == "time:False"
    sp.saved(now=5.0)
    assert sp.last_time == 5.0
    loop = FakeLoop()
    batch(sp, 3, loop, now=14.0)
    assert loop.asked[0] == "time:False"  # 9 s since the last save


def test_max_steps_saves_before_lightning_closes_the_epoch() -> None:
    sp = points(every_n_epochs=5)
    assert batch(sp, 7, FakeLoop(max_steps=True)) == SaveNow("train_end", False)
    sp.save_on_train_end = False
    loop = FakeLoop(max_steps=True)
    assert batch(sp, 8, loop) is None and "max_steps" not in loop.asked


def test_epoch_schedule() -> None:
    sp = points(every_n_epochs=2)
    sp.at_epoch_end(epoch=0, step=4, last_saved=None)
    assert sp.due_at is None
    sp.epoch_started()
    sp.at_epoch_end(epoch=1, step=8, last_saved=None)
    assert (sp.due, sp.due_at) == ("epoch", BETWEEN_EPOCHS)
    sp.epoch_started()
    sp.at_epoch_end(epoch=3, step=0, last_saved=None)  # nothing trained: no save
    assert (sp.due, sp.due_at) == (None, None)
    sp.at_epoch_end(epoch=3, step=16, last_saved=16)
    assert (sp.due, sp.due_at) == (None, None)


def test_train_end() -> None:
    sp = points(every_n_epochs=0)
    assert sp.at_train_end(step=5, last_saved=None) == SaveNow("train_end", boundary=False)
    sp.at_epoch_end(epoch=0, step=5, last_saved=None)
    assert sp.at_train_end(step=5, last_saved=None) == SaveNow("train_end", boundary=True)
    assert sp.at_train_end(step=5, last_saved=5) is None
    assert sp.at_train_end(step=0, last_saved=None) is None
    sp.save_on_train_end = False
    assert sp.at_train_end(step=6, last_saved=5) is None
    sp.due = "step"  # still due: taken even without save_on_train_end
    assert sp.at_train_end(step=6, last_saved=5) == SaveNow("step", boundary=True)


def exception(sp: SavePoints, **facts: object) -> SaveNow | Declined | None:
    values: dict[str, object] = {
        "fitting": True,
        "world_size": 1,
        "validating": False,
        "batches": FINISHED,
    }
    values.update(facts)
    step = values.pop("step", 3)
    last = values.pop("last_saved", None)
    return sp.at_exception(step, last, **values)  # type: ignore[arg-type]


def test_an_exception_between_steps_saves() -> None:
    sp = points()
    assert exception(sp) == SaveNow("exception", boundary=False)
    sp.at_epoch_end(epoch=0, step=3, last_saved=None)
    assert exception(sp) == SaveNow("exception", boundary=True)
    optimizer_step_done = BatchCounts(ready=4, started=4, processed=4, completed=3)
    assert isinstance(exception(sp, batches=optimizer_step_done), SaveNow)


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        ({"world_size": 2}, "under DDP"),
        ({"validating": True}, "validation"),
        ({"batches": BatchCounts(ready=5, started=4, processed=4, completed=4)}, "batch 4"),
        ({"batches": BatchCounts(ready=4, started=4, processed=4, completed=2)}, "training step"),
    ],
)
def test_an_exception_in_an_inconsistent_state_declines_saying_why(
    facts: dict[str, object], why: str
) -> None:
    decision = exception(points(), **facts)
    assert isinstance(decision, Declined) and why in decision.why


def test_an_exception_in_our_own_save_is_not_saved_again() -> None:
    sp = points()
    sp.save_started()
    assert exception(sp) is None  # inside the save
    sp.save_raised()
    assert not sp.saving
    decision = exception(sp)
    assert isinstance(decision, Declined) and "failed save" in decision.why


@pytest.mark.parametrize("facts", [{"fitting": False}, {"step": 0}, {"step": 3, "last_saved": 3}])
def test_an_exception_with_nothing_to_save_is_silent(facts: dict[str, object]) -> None:
    assert exception(points(), **facts) is None


def test_no_save_on_exception_before_training_or_when_off() -> None:
    sp = SavePoints(Schedule())
    assert exception(sp) is None  # training did not start
    sp.train_started(0.0)
    sp.save_on_exception = False
    assert exception(sp) is None


def test_a_save_clears_what_was_due() -> None:
    sp = points(every_n_train_steps=1)
    batch(sp, 1, FakeLoop(validation=True))
    sp.save_started()
    sp.saved(now=42.0)
    assert (sp.due, sp.due_at, sp.saving, sp.last_time) == (None, None, False, 42.0)
