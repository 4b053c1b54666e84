"""When a checkpoint is due: ModelCheckpoint's three schedules, or an interval adapted to what
checkpointing may cost (:mod:`lightning_incremental.runtime.policy.cadence`), validated on
construction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_incremental.core import ConfigError
from lightning_incremental.runtime.policy.cadence import Cadence, CadenceConfig


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Save every ``every_n_train_steps`` optimizer steps, every ``every_n_epochs`` epochs, or
    when ``train_time_interval`` passed since the last save. ``0``/None disables one; at most one
    is active (as with ModelCheckpoint).

    ``max_overhead`` / ``expected_mtbf``: a step interval adapted to the measured cost of a save
    (see :mod:`~lightning_incremental.runtime.policy.cadence`), with ``every_n_train_steps`` as its
    shortest interval; it replaces the epoch and time schedules (which fix their own interval).

    Raises:
        TypeError: a value of the wrong type.
        ConfigError: a negative count, a non-positive interval, or two active schedules.
    """

    every_n_train_steps: int = 0
    every_n_epochs: int = 0
    train_time_interval: timedelta | None = None
    max_overhead: float | None = None
    expected_mtbf: float | None = None

    def __post_init__(self) -> None:
        _count("every_n_train_steps", self.every_n_train_steps)
        _count("every_n_epochs", self.every_n_epochs)
        interval = self.train_time_interval
        if interval is not None:
            if not isinstance(interval, timedelta):
                raise TypeError(
                    "train_time_interval must be a datetime.timedelta (in YAML: '0:30:00'), got "
                    f"{type(interval).__name__}"
                )
            if interval <= timedelta(0):
                raise ConfigError(f"train_time_interval must be positive, got {interval}")
        active = [
            f"{name}={value}"
            for name, value in (
                ("every_n_train_steps", self.every_n_train_steps),
                ("every_n_epochs", self.every_n_epochs),
                ("train_time_interval", interval),
            )
            if value
        ]
        adaptive = self.max_overhead is not None or self.expected_mtbf is not None
        if adaptive:
            self.cadence_config()  # validates them
            fixed = [a for a in active if not a.startswith("every_n_train_steps")]
            if fixed:
                raise ConfigError(
                    f"{fixed[0]} conflicts with max_overhead/expected_mtbf, which adapt a step "
                    "interval: give every_n_train_steps (the shortest interval) or nothing"
                )
        elif len(active) > 1:
            raise ConfigError(
                f"{' and '.join(active)} conflict: use one schedule (every_n_train_steps, "
                "every_n_epochs or train_time_interval), as with ModelCheckpoint"
            )

    @classmethod
    def from_args(
        cls,
        every_n_train_steps: int | None,
        every_n_epochs: int | None,
        train_time_interval: timedelta | None,
        max_overhead: float | None = None,
        expected_mtbf: float | None = None,
    ) -> Schedule:
        """ModelCheckpoint's defaults: when none is given, ``every_n_epochs=1``."""
        given = (every_n_train_steps, every_n_epochs, train_time_interval, max_overhead)
        if all(v is None for v in given) and expected_mtbf is None:
            every_n_epochs = 1
        _count("every_n_train_steps", every_n_train_steps, optional=True)
        _count("every_n_epochs", every_n_epochs, optional=True)
        return cls(
            every_n_train_steps=every_n_train_steps or 0,
            every_n_epochs=every_n_epochs or 0,
            train_time_interval=train_time_interval,
            max_overhead=max_overhead,
            expected_mtbf=expected_mtbf,
        )

    def cadence_config(self) -> CadenceConfig:
        return CadenceConfig(
            max_overhead=self.max_overhead,
            expected_mtbf=self.expected_mtbf,
            min_interval=self.every_n_train_steps or 1,
        )

    def cadence(self) -> Cadence | None:
        """A fresh adaptive interval for one run, when ``max_overhead``/``expected_mtbf``."""
        if self.max_overhead is None and self.expected_mtbf is None:
            return None
        return Cadence(self.cadence_config())

    def step_due(self, step: int) -> bool:
        """After an optimizer step that reached ``step``."""
        return bool(self.every_n_train_steps) and step % self.every_n_train_steps == 0

    def time_due(self, elapsed_s: float) -> bool:
        """``elapsed_s`` seconds after the last save (or the start of training)."""
        interval = self.train_time_interval
        return interval is not None and elapsed_s >= interval.total_seconds()

    def epoch_due(self, epoch: int) -> bool:
        """At the end of epoch ``epoch`` (counted from 0)."""
        return bool(self.every_n_epochs) and (epoch + 1) % self.every_n_epochs == 0


def _count(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0 (0 disables it), got {value}")
