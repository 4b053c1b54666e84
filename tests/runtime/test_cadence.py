"""The adaptive checkpoint interval (runtime/cadence.py) against a simulated training run whose
saves cost a known amount of training time: the interval it chooses keeps a ``max_overhead``
budget, matches Young/Daly's optimum for an ``expected_mtbf``, and respects the bounds."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.policy.cadence import WARMUP, Cadence, CadenceConfig


def simulate(
    cadence: Cadence,
    steps: int,
    *,
    step_s: float = 0.1,
    stall_s: float = 0.02,
    background_steps: int = 3,
    slow_by: float = 0.01,
    noise: float = 0.0,
    seed: int = 0,
) -> tuple[list[int], float]:
    """Train ``steps`` steps of ``step_s``; a save stalls ``stall_s`` and slows the next
    ``background_steps`` steps by ``slow_by`` each (its background work). Returns the steps
    saved and the true fraction of time the saves cost."""
    rng = random.Random(seed)
    now, saves, in_flight, cost = 0.0, [], 0, 0.0
    cadence.step_ended(0, now, in_flight=False)
    for step in range(1, steps + 1):
        took = step_s * (1 + rng.uniform(-noise, noise))
        if in_flight:
            took += slow_by
            cost += slow_by
            in_flight -= 1
        now += took
        cadence.step_ended(step, now, in_flight=in_flight > 0)
        if cadence.due(step):
            now += stall_s
            cost += stall_s
            cadence.saved(step, stall_s)
            saves.append(step)
            in_flight = background_steps
    return saves, cost / now


def test_the_budget_sets_the_interval_from_the_measured_cost() -> None:
    cadence = Cadence(CadenceConfig(max_overhead=0.02))
    saves, overhead = simulate(cadence, 2000)
    per_save = 0.02 + 3 * 0.01  # stall + three slowed steps
    expected = math.ceil(per_save / (0.02 * 0.1))  # 25 steps
    assert cadence.interval == expected
    assert [c.interval for c in cadence.choices][-1] == expected
    assert cadence.choices[-1].cost_s == pytest.approx(per_save)
    assert cadence.choices[-1].budget == expected and cadence.choices[-1].young_daly is None
    # the first save waits for a baseline; later ones keep the budget
    assert saves[0] == WARMUP
    assert overhead <= 0.02 * 1.15
    assert cadence.achieved() == pytest.approx(overhead, rel=0.1)


def test_young_daly_interval_for_an_expected_mtbf() -> None:
    cadence = Cadence(CadenceConfig(expected_mtbf=3600.0))
    simulate(cadence, 3000)
    cost = 0.05
    assert cadence.interval == round(math.sqrt(2 * cost * 3600.0) / 0.1)  # 190 steps
    assert cadence.choices[-1].young_daly == cadence.interval


def test_with_both_the_longer_interval_wins_and_the_floor_holds() -> None:
    both = Cadence(CadenceConfig(max_overhead=0.5, expected_mtbf=3600.0))
    simulate(both, 2000)
    assert both.interval == both.choices[-1].young_daly > both.choices[-1].budget  # type: ignore[operator]
    floor = Cadence(CadenceConfig(max_overhead=0.5, min_interval=40))
    saves, _ = simulate(floor, 400)
    assert floor.interval == 40
    assert all(b - a >= 40 for a, b in itertools.pairwise(saves))


def test_a_cheaper_save_shortens_the_interval_again() -> None:
    cadence = Cadence(CadenceConfig(max_overhead=0.05))
    simulate(cadence, 1000, stall_s=0.2)
    long = cadence.interval
    now = 1000.0
    for step in range(1001, 3000):  # saves now cost only their stall of 0.01 s
        now += 0.1
        cadence.step_ended(step, now, in_flight=False)
        if cadence.due(step):
            now += 0.01
            cadence.saved(step, 0.01)
    assert cadence.interval < long
    assert cadence.interval == math.ceil(0.01 / (0.05 * 0.1))


def test_interrupted_steps_are_not_measured() -> None:
    """A validation between two steps would look like a very slow step."""
    cadence = Cadence(CadenceConfig(max_overhead=0.02))
    simulate(cadence, 500)
    before = cadence.choices[-1].cost_s
    now, step = 1e4, 500
    cadence.step_ended(step, now, in_flight=False)
    for _ in range(200):
        step += 1
        if step % 50 == 0:
            cadence.interrupted()
            now += 30.0  # a long validation
        now += 0.1
        cadence.step_ended(step, now, in_flight=False)
        if cadence.due(step):
            now += 0.05
            cadence.saved(step, 0.05)
    assert cadence.choices[-1].cost_s == pytest.approx(0.05)
    assert before == pytest.approx(0.05)


def test_resumed_runs_count_from_the_checkpoint() -> None:
    cadence = Cadence(CadenceConfig(max_overhead=0.5, min_interval=10))
    cadence.resumed(100)
    now = 0.0
    cadence.step_ended(100, now, in_flight=False)
    due = []
    for step in range(101, 125):
        now += 0.1
        cadence.step_ended(step, now, in_flight=False)
        if cadence.due(step):
            due.append(step)
            cadence.saved(step, 0.0)
    assert due == [110, 120]


@settings(max_examples=60, deadline=None)
@example(  # background work outlasting the interval: saves back to back, no new baseline
    budget=0.01, step_s=1.0, stall_s=0.375, background=20, slow=0.0, seed=20
)  # found by this test: 1.8 % achieved against a 1 % budget before CLEAN_BETWEEN
@given(
    budget=st.sampled_from([0.01, 0.02, 0.05, 0.1]),
    step_s=st.floats(0.01, 1.0),
    stall_s=st.floats(0.0, 2.0),
    background=st.integers(0, 20),
    slow=st.floats(0.0, 0.5),
    seed=st.integers(0, 1000),
)
def test_the_budget_holds_under_noise(
    budget: float, step_s: float, stall_s: float, background: int, slow: float, seed: int
) -> None:
    """Whatever a save costs, once measured the achieved overhead stays near the budget (steps
    vary by +-2 %; a save's measured cost carries that noise over every step it spans, and the
    baseline's error times the steps it spans)."""
    slow_by = slow * step_s
    cadence = Cadence(CadenceConfig(max_overhead=budget))
    per_save = stall_s + background * slow_by
    interval = math.ceil(per_save / (budget * step_s))
    assume(background < interval <= 200)  # a save finishes before the next is due
    steps = max(400, 30 * interval)
    saves, overhead = simulate(
        cadence, steps, step_s=step_s, stall_s=stall_s, background_steps=background,
        slow_by=slow_by, noise=0.02, seed=seed,
    )  # fmt: skip
    assert saves, "never saved"
    # the first save is taken before any measurement: count from the second
    assert overhead <= budget * 1.5 + per_save / (steps * step_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs max_overhead or expected_mtbf"),
        ({"max_overhead": 0}, "in \\(0, 1\\)"),
        ({"max_overhead": 1.5}, "in \\(0, 1\\)"),
        ({"max_overhead": True}, "in \\(0, 1\\)"),
        ({"max_overhead": float("nan")}, "in \\(0, 1\\)"),
        ({"expected_mtbf": -1}, "mean time between failures"),
        ({"expected_mtbf": "4h"}, "mean time between failures"),
        ({"max_overhead": 0.02, "min_interval": 0}, "min_interval must be >= 1"),
    ],
)
def test_bad_settings_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CadenceConfig(**kwargs)
