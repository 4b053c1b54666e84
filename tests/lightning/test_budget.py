"""``IncrementalCheckpoint(max_overhead=..., expected_mtbf=...)`` in a real Trainer: the interval
adapts to the measured cost of a save (here a controlled clock makes that cost exact), is logged,
is agreed with the other schedules' rules, restarts from the resumed step, and a resumed run
stays exact."""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.lightning import callback as callback_module
from lightning_incremental.lightning.saver import Saver
from lightning_incremental.runtime.policy.cadence import WARMUP
from tests.fake_clock import Clock
from tests.jobs.lightning_job import fit, weights

TRAINER = {"max_steps": 40, "max_epochs": -1, "limit_val_batches": 0, "val_check_interval": None}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(callback_module, "time", clock)
    # a save's background work ends before the next step: its cost is its stall and the step
    # after it (which read the clock once more: 2 s), whatever this machine's speed
    monkeypatch.setattr(Saver, "in_flight", lambda self: False)
    return clock


def _saved(path: Path) -> list[int]:
    with CheckpointStore(str(path)) as store:
        return store.steps()


def test_the_interval_keeps_the_overhead_budget(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    _, _, ckpt = fit(tmp_path / "ckpt", trainer=TRAINER, max_overhead=0.25)
    # cost 2 s a save (1 s stall + 1 s more on the step after it), 1 s a step:
    # 2 / (0.25 * 1) = 8 steps between saves
    assert ckpt.cadence is not None
    assert [c.interval for c in ckpt.cadence.choices] == [8] * len(ckpt.cadence.choices)
    assert ckpt.cadence.choices[0].cost_s == pytest.approx(2.0)
    first = WARMUP + 1  # WARMUP steps measured after the first one, whose start is unknown
    assert _saved(tmp_path / "ckpt") == [*range(first, 40, 8), 40]
    assert "checkpoint every 8 steps (a save costs 2.000 s of training" in caplog.text
    assert "max_overhead=0.25 needs >= 8" in caplog.text
    assert "checkpointing cost" in caplog.text and "intervals chosen: [8" in caplog.text


def test_young_daly_sets_the_interval_and_every_n_train_steps_is_the_shortest(
    tmp_path: Path, clock: Clock
) -> None:
    _, _, ckpt = fit(tmp_path / "a", trainer=TRAINER, expected_mtbf=9.0)
    assert ckpt.cadence is not None
    assert ckpt.cadence.interval == round(math.sqrt(2 * 2.0 * 9.0))  # 6
    assert ckpt.cadence.choices[-1].young_daly == 6
    _, _, ckpt = fit(tmp_path / "b", trainer=TRAINER, expected_mtbf=9.0, every_n_train_steps=10)
    assert ckpt.cadence is not None and ckpt.cadence.interval == 10
    steps = _saved(tmp_path / "b")
    assert all(b - a >= 10 for a, b in itertools.pairwise(steps[:-1])), steps


def test_a_resumed_run_counts_from_its_checkpoint_and_stays_exact(
    tmp_path: Path, clock: Clock
) -> None:
    reference, _, _ = fit(tmp_path / "ref", trainer=TRAINER, max_overhead=0.25)
    fit(tmp_path / "run", trainer=TRAINER, max_overhead=0.25, crash_at=15)
    first = WARMUP + 1
    assert _saved(tmp_path / "run") == [first, first + 8, 15]  # 15: saved on the exception
    resumed, _, ckpt = fit(tmp_path / "run", trainer=TRAINER, max_overhead=0.25)
    assert ckpt.resumed_from == 15
    # measured afresh after the resume: warm-up steps (an epoch's end is not a measurement),
    # then the budget's interval
    after = _saved(tmp_path / "run")[3:-1]
    assert 15 + WARMUP + 1 <= after[0] <= 15 + WARMUP + 2, after
    assert {b - a for a, b in itertools.pairwise(after)} == {8}, after
    for key, value in weights(reference).items():
        assert torch.equal(value, weights(resumed)[key]), key


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_overhead": 2}, "in \\(0, 1\\)"),
        ({"expected_mtbf": 0}, "mean time between failures"),
        ({"max_overhead": 0.02, "every_n_epochs": 1}, "every_n_epochs=1 conflicts with"),
        (
            {"max_overhead": 0.02, "train_time_interval": __import__("datetime").timedelta(1)},
            "conflicts with max_overhead",
        ),
    ],
)
def test_bad_budgets_are_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    from lightning_incremental import IncrementalCheckpoint

    with pytest.raises(ConfigError, match=message):
        IncrementalCheckpoint("unused", **kwargs)
