"""A clock for the adaptive-cadence tests: one second per reading, so that a training step (one
reading) takes 1 s and a save (read at its start and its end) stalls training 1 s."""

from __future__ import annotations


class Clock:
    """Stands in for the ``time`` module of the code under test (``monotonic`` only)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now
