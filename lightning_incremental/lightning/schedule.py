"""When a checkpoint is due: ModelCheckpoint's three schedules, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_incremental.core import ConfigError


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Save every ``every_n_train_steps`` optimizer steps, every ``every_n_epochs`` epochs, or
    when ``train_time_interval`` passed since the last save. ``0``/None disables one; at most one
    is active (as with ModelCheckpoint).

    Raises:
        TypeError: a value of the wrong type.
        ConfigError: a negative count, a non-positive interval, or two active schedules.
    """

    every_n_train_steps: int = 0
    every_n_epochs: int = 0
    train_time_interval: timedelta | None = None

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
        if len(active) > 1:
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
    ) -> Schedule:
        """ModelCheckpoint's defaults: when none is given, ``every_n_epochs=1``."""
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1
        _count("every_n_train_steps", every_n_train_steps, optional=True)
        _count("every_n_epochs", every_n_epochs, optional=True)
        return cls(
            every_n_train_steps=every_n_train_steps or 0,
            every_n_epochs=every_n_epochs or 0,
            train_time_interval=train_time_interval,
        )

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
