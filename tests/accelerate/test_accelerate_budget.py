"""``IncrementalCheckpointer(max_overhead=..., expected_mtbf=...)``: ``maybe_save`` adapts its
interval to the measured cost of a save (a controlled clock makes that cost exact), counts from a
loaded checkpoint, and refuses bad settings by name."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState

from accelerate_incremental import IncrementalCheckpointer, _pace
from accelerate_incremental import checkpointer as checkpointer_module
from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.policy.cadence import WARMUP
from tests.accelerate.test_accelerate import make_run
from tests.fake_clock import Clock


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(_pace, "time", clock)
    monkeypatch.setattr(checkpointer_module, "time", clock)
    # each save's background work counts as finished at the next step, whatever this machine's
    # speed: its cost is then exactly 2 s
    monkeypatch.setattr(_pace.Pace, "in_flight", staticmethod(lambda handles: False))
    return clock


def test_maybe_save_keeps_the_overhead_budget(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="accelerate_incremental")
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(tmp_path / "s"), max_overhead=0.25) as ckpt:
        saved = [step for step in range(1, 41) if ckpt.maybe_save(step) is not None]
        assert ckpt.cadence is not None
        assert {c.interval for c in ckpt.cadence.choices} == {8}  # 2 s / (0.25 * 1 s)
    first = WARMUP + 1  # the first call starts the clock; WARMUP clean steps after it
    assert saved == list(range(first, 41, 8))
    assert "checkpoint every 8 steps (a save costs 2.000 s of training" in caplog.text
    assert "checkpointing cost" in caplog.text


def test_young_daly_and_the_shortest_interval(tmp_path: Path, clock: Clock) -> None:
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(tmp_path / "a"), expected_mtbf=9.0) as ckpt:
        for step in range(1, 41):
            ckpt.maybe_save(step)
        assert ckpt.cadence is not None
        assert ckpt.cadence.interval == round(math.sqrt(2 * 2.0 * 9.0)) == 6
    with IncrementalCheckpointer(
        run.acc, str(tmp_path / "b"), expected_mtbf=9.0, every_n_steps=10
    ) as ckpt:
        saved = [step for step in range(1, 41) if ckpt.maybe_save(step) is not None]
        assert ckpt.cadence is not None and ckpt.cadence.interval == 10
    assert all(b - a == 10 for a, b in itertools.pairwise(saved)), saved


def test_a_loaded_checkpoint_restarts_the_count(tmp_path: Path, clock: Clock) -> None:
    run = make_run()
    url = str(tmp_path / "s")
    with IncrementalCheckpointer(run.acc, url) as ckpt:
        ckpt.save(20)
    with IncrementalCheckpointer(run.acc, url, max_overhead=0.25) as ckpt:
        assert ckpt.load() == 20
        saved = [step for step in range(21, 40) if ckpt.maybe_save(step) is not None]
    assert saved[0] == 20 + WARMUP + 1 and saved[1] - saved[0] == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_overhead": 0}, "in \\(0, 1\\)"),
        ({"expected_mtbf": -5}, "mean time between failures"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    run = make_run()
    with pytest.raises(ConfigError, match=message):
        IncrementalCheckpointer(run.acc, str(tmp_path / "s"), **kwargs)
