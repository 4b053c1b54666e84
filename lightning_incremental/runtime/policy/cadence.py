"""A checkpoint interval set by what checkpointing may cost, measured as training sees it.

Two ways to say what a checkpoint is worth, alone or together:

- ``max_overhead``: the fraction of training time checkpointing may cost (the policy of
  CheckFreq, Mohan et al., FAST '21). The interval is the shortest one whose measured cost fits:
  ``interval >= cost / (max_overhead * step time)``.
- ``expected_mtbf``: the mean time between failures of the job, in seconds. Young's and Daly's
  first-order optimum, ``sqrt(2 * cost * MTBF)`` of training time between saves, minimises the
  expected time lost to checkpointing plus the work redone after a failure.

With both, the longer of the two intervals: Young/Daly's optimum, stretched when the budget
needs more room. ``min_interval`` (the user's ``every_n_train_steps``, else 1) bounds it below.

What a save costs is what training loses to it, not the save's own time: the stall of the
snapshot, plus how much longer the steps that ran while the save's background work was in flight
took than steps without one (the background threads compete for cores, memory bandwidth and the
GIL). A step without a save in flight is the baseline (the median of the recent ones); each save
is one measurement, and the estimate is the median of the last few (robust to a step slowed by
something else). Before the first measurement the interval is ``min_interval``, and the first
save waits for ``WARMUP`` steps without one, so that a baseline exists. A save is never started
while the previous one is still in flight, nor before ``CLEAN_BETWEEN`` steps without one
followed it (the baseline keeps being measured).

:class:`Cadence` is pure: the caller reports steps, saves and whether a save is still in flight,
with its own clock; in a distributed run one process's decision is agreed by every process.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from lightning_incremental.core.errors import ConfigError

WARMUP = 5  # steps without a save in flight before the first measured save
BASELINE_STEPS = 16  # recent steps without a save in flight: the baseline is their median
COST_SAMPLES = 5  # the cost estimate is the median of this many latest measurements
# Steps without a save in flight between one save's background work and the next save. Without
# them, a save whose background work outlasts the interval is followed at once by the next, no
# baseline step is measured again, and the baseline's error (the median of the warm-up's few
# steps) counts once for every step of every window: with steps varying by 2 %, a window of 21
# steps measured a 0.375 s save as 0.08-0.19 s, and the achieved overhead was 1.8x the budget.
CLEAN_BETWEEN = 2


@dataclass(frozen=True)
class CadenceConfig:
    """What the interval must respect; validated on construction.

    Raises:
        ConfigError: ``max_overhead`` not in (0, 1), ``expected_mtbf`` not > 0, neither given, or
            ``min_interval`` < 1.
    """

    max_overhead: float | None = None
    expected_mtbf: float | None = None
    min_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_overhead is None and self.expected_mtbf is None:
            raise ConfigError("an adaptive cadence needs max_overhead or expected_mtbf")
        if self.max_overhead is not None and not (
            _number(self.max_overhead) and 0 < self.max_overhead < 1
        ):
            raise ConfigError(
                "max_overhead is the fraction of training time checkpointing may cost, in (0, 1) "
                f"(e.g. 0.02 for 2 %), got {self.max_overhead!r}"
            )
        if self.expected_mtbf is not None and not (
            _number(self.expected_mtbf) and self.expected_mtbf > 0
        ):
            raise ConfigError(
                "expected_mtbf is the job's mean time between failures in seconds (e.g. "
                f"4 * 3600), got {self.expected_mtbf!r}"
            )
        if isinstance(self.min_interval, bool) or not isinstance(self.min_interval, int):
            raise ConfigError(f"min_interval must be an int, got {self.min_interval!r}")
        if self.min_interval < 1:
            raise ConfigError(f"min_interval must be >= 1, got {self.min_interval}")

    def describe(self) -> str:
        parts = []
        if self.max_overhead is not None:
            parts.append(f"max_overhead={self.max_overhead:g}")
        if self.expected_mtbf is not None:
            parts.append(f"expected_mtbf={self.expected_mtbf:g} s")
        return ", ".join(parts)


@dataclass(frozen=True)
class Choice:
    """An interval chosen after the save at ``step``, and what it was chosen from."""

    step: int
    interval: int  # steps from this save to the next
    cost_s: float  # the estimated cost of one save, in training time
    step_s: float  # a step without a save in flight
    budget: int | None  # the shortest interval max_overhead allows
    young_daly: int | None  # Young/Daly's optimum for expected_mtbf

    def describe(self, config: CadenceConfig) -> str:
        why = [f"a save costs {self.cost_s:.3f} s of training, a step takes {self.step_s:.3f} s"]
        if self.budget is not None:
            why.append(f"max_overhead={config.max_overhead:g} needs >= {self.budget}")
        if self.young_daly is not None:
            why.append(f"Young/Daly for MTBF {config.expected_mtbf:g} s: {self.young_daly}")
        return f"checkpoint every {self.interval} steps ({'; '.join(why)})"


@dataclass
class _Window:
    """The steps affected by one or more saves, until none is in flight."""

    saves: int = 0
    stall_s: float = 0.0
    durations: list[float] = field(default_factory=list)  # of the affected steps, stalls taken out


@dataclass
class Cadence:
    """The adaptive interval of one run (see the module documentation)."""

    config: CadenceConfig
    last_save: int | None = None  # the step saved last (on resume: the step resumed from)
    choices: list[Choice] = field(default_factory=list)
    _baseline: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_STEPS))
    _costs: deque[float] = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))
    _window: _Window | None = None
    _measuring: list[_Window] = field(default_factory=list)  # closed, waiting for a baseline
    _last_end: float | None = None
    _stall_in_next: float = 0.0
    _skip_next: bool = False
    _clean_since_start: int = 0
    _clean_since_window: int = 0  # steps measured without a save in flight since the last one
    train_s: float = 0.0  # training time seen (steps timed)
    cost_s: float = 0.0  # of it, the measured cost of saves

    @property
    def interval(self) -> int:
        return self.choices[-1].interval if self.choices else self.config.min_interval

    def step_ended(self, step: int, now: float, *, in_flight: bool) -> None:
        """A training step reached ``step`` at ``now`` (seconds); ``in_flight``: a save's
        background work is still running."""
        previous, self._last_end = self._last_end, now
        stall, self._stall_in_next = self._stall_in_next, 0.0
        skip, self._skip_next = self._skip_next, False
        if previous is None or skip:
            return
        duration = max(0.0, now - previous - stall)
        self.train_s += now - previous
        if self._window is not None:
            self._window.durations.append(duration)
            if not in_flight:
                self._measuring.append(self._window)
                self._window = None
                self._clean_since_window = 0
        else:
            self._baseline.append(duration)
            self._clean_since_start += 1
            self._clean_since_window += 1
        self._settle()

    def interrupted(self) -> None:
        """Something that is not a training step ran since the last step (a validation, the
        end of an epoch): the next step's time is not a measurement."""
        self._skip_next = True

    def due(self, step: int) -> bool:
        """Whether the step just ended is a save point: ``interval`` steps after the last save,
        once that save is measured (no save is started while one is in flight: it would wait
        for that one, stalling training, and blur both measurements)."""
        if self._window is not None or self._measuring:
            return False
        if self._clean_since_start < WARMUP and not self._costs:
            return False
        if self._costs and self._clean_since_window < CLEAN_BETWEEN:
            return False
        start = self.last_save if self.last_save is not None else 0
        return step - start >= self.interval

    def saved(self, step: int, stall_s: float) -> None:
        """A save was taken after step ``step``; it held training for ``stall_s`` seconds."""
        self.last_save = step
        if self._window is None:
            self._window = _Window()
        self._window.saves += 1
        self._window.stall_s += stall_s
        self._stall_in_next += stall_s

    def resumed(self, step: int) -> None:
        """Training continues from a checkpoint of step ``step``."""
        self.last_save = step

    def achieved(self) -> float | None:
        """The measured cost of the saves as a fraction of the training time seen (None before
        any measurement)."""
        return self.cost_s / self.train_s if self.train_s > 0 and self._costs else None

    def _settle(self) -> None:
        if len(self._baseline) < min(WARMUP, BASELINE_STEPS):
            return
        base = statistics.median(self._baseline)
        for window in self._measuring:
            excess = sum(d - base for d in window.durations)
            cost = max(0.0, window.stall_s + excess)
            self.cost_s += cost
            self._costs.append(cost / window.saves)
        if self._measuring:
            self._measuring = []
            self._choose(base)

    def _choose(self, step_s: float) -> None:
        cfg = self.config
        cost = statistics.median(self._costs)
        step_s = max(step_s, 1e-9)
        budget = young_daly = None
        if cfg.max_overhead is not None:
            budget = max(1, math.ceil(cost / (cfg.max_overhead * step_s) - 1e-9))
        if cfg.expected_mtbf is not None:
            young_daly = max(1, round(math.sqrt(2 * cost * cfg.expected_mtbf) / step_s))
        interval = max(cfg.min_interval, budget or 1, young_daly or 1)
        self.choices.append(Choice(self.last_save or 0, interval, cost, step_s, budget, young_daly))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


__all__ = ["Cadence", "CadenceConfig", "Choice", "WARMUP"]
