"""Back-pressure: a new save waits until fewer than ``max_in_flight`` earlier ones may still run.

The engine bounds its own queue (``StoreConfig.max_in_flight``); an adapter that keeps its own
list of pending saves (engine handles, or futures of the work that follows a commit) waits for
the oldest ones here before it starts the next save, so their outcome is known — committed, or
an error to report — before the next save is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Pending(Protocol):
    """A save in flight: an engine ``SaveHandle`` or a ``concurrent.futures.Future``."""

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


def wait_for_room(pending: Sequence[Pending], limit: int) -> None:
    """Wait for the oldest of ``pending`` (oldest first) until at most ``limit - 1`` of them
    may still run, so that one more makes ``limit``. Their outcome stays theirs to collect:
    an error is returned by their ``exception()``, never raised here."""
    for item in list(pending)[: max(0, len(pending) - limit + 1)]:
        item.exception()
