"""What becomes of a failed save: the adapters' ``max_consecutive_failures`` policy.

A save that fails in the background (the storage refused a write, the disk is full, the network
is down) commits nothing: the store still holds the previous committed checkpoint. The adapters
(:class:`~lightning_incremental.IncrementalCheckpoint`,
:class:`~lightning_incremental.IncrementalCheckpointIO`,
:class:`~accelerate_incremental.IncrementalCheckpointer`) then warn and let training go on, until
``max_consecutive_failures`` saves in a row have failed: that one raises
:class:`~lightning_incremental.core.CheckpointError`, naming every failed save of the streak and
chained from the first one's error. A committed save ends the streak. A save refused because a
newer generation of the job took over the store (:class:`~lightning_incremental.core.FencedError`)
raises at once.

:class:`FailurePolicy` keeps the count and words the warning or the error. Under several
processes only one of them saves: it makes the :meth:`FailurePolicy.report`, and hands it to the
others, so that every process warns or raises alike (:meth:`FailurePolicy.apply`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from lightning_incremental.core.errors import CheckpointError, ConfigError, FencedError
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.cluster.coordinate import describe

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_CONSECUTIVE_FAILURES",
    "FailurePolicy",
    "Report",
    "check_max_consecutive_failures",
    "describe",
    "share_report",
    "text_of",
]

DEFAULT_MAX_CONSECUTIVE_FAILURES = 3

#: What :meth:`FailurePolicy.report` hands to every process: the message, and whether to raise it.
Report = tuple[str, bool]


def check_max_consecutive_failures(value: Any) -> int:
    """``value`` as a ``max_consecutive_failures`` argument.

    Raises:
        TypeError: not an int (a bool is not one).
        ConfigError: below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"max_consecutive_failures must be an int >= 1, got {type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ConfigError(
            f"max_consecutive_failures must be >= 1 (1: stop at the first failed save), got {value}"
        )
    return value


class _Handle(Protocol):
    step: int

    def done(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


H = TypeVar("H", bound=_Handle)


class FailurePolicy:
    """The failed saves of one adapter, and what to do about them.

    Args:
        who: the adapter's name, for messages.
        url: where it saves, for messages (None: each failure's ``what`` names it).
        limit: ``max_consecutive_failures``.
    """

    def __init__(self, who: str, url: str | None, limit: int) -> None:
        self.who = who
        self.url = url
        self.limit = check_max_consecutive_failures(limit)
        self._lock = threading.Lock()  # the plug-in records from its background thread
        self._streak: list[tuple[str, BaseException]] = []  # consecutive failed saves
        self._new: list[tuple[str, BaseException]] = []  # failed saves not reported yet
        self._count = 0  # the streak's length at the newest unreported failure
        self._fatal: list[tuple[str, BaseException]] | None = None  # the streak that hit limit

    # ------------------------------------------------------------------ recording

    def committed(self) -> None:
        """A save committed: the streak ends."""
        with self._lock:
            self._streak = []

    def failed(self, what: str, error: BaseException) -> None:
        """The save of ``what`` (e.g. ``"step 6"``) failed with ``error``."""
        with self._lock:
            self._streak.append((what, error))
            self._new.append((what, error))
            self._count = len(self._streak)
            # A fenced-off writer must stop at once: a restarted job owns the store now.
            fenced = isinstance(error, FencedError)
            if (self._count >= self.limit or fenced) and self._fatal is None:
                self._fatal = list(self._streak)

    @property
    def new(self) -> list[tuple[str, BaseException]]:
        """The failed saves not reported yet, oldest first."""
        with self._lock:
            return list(self._new)

    @property
    def fatal(self) -> bool:
        """Whether ``limit`` saves in a row failed (the next report raises)."""
        return self._fatal is not None

    def collect(self, pending: list[H], *, block: bool) -> list[H]:
        """Record the engine handles in ``pending`` that finished (all with ``block``), in
        order; remove them from ``pending`` and return the committed ones."""
        committed, still = [], []
        for handle in pending:
            if not block and not handle.done():
                still.append(handle)
                continue
            error = handle.exception()  # the error counts as delivered
            if error is None:
                self.committed()
                committed.append(handle)
            else:
                self.failed(f"step {handle.step}", error)
        pending[:] = still
        return committed

    def start(self, save: Callable[[], H], collect: Callable[[], object]) -> H | None:
        """``save()`` (an engine ``store.save``); None when nothing was started because
        ``limit`` saves in a row failed. The engine raises an earlier save's error that was not
        delivered yet from ``save``: ``collect()`` (the caller's non-blocking collect) then
        records it as that save's failure, and this save is tried again.

        Raises:
            Exception: ``save``'s own error (bad input: ``UnsupportedValueError``, ...).
        """
        while not self.fatal:
            try:
                return save()
            except Exception as exc:
                collect()
                if not any(e is exc for _, e in self.new):
                    raise
        return None

    def take(self) -> list[tuple[str, BaseException]]:
        """The unreported failures, now reported by the caller (e.g. logged)."""
        with self._lock:
            new, self._new = self._new, []
            return new

    # ------------------------------------------------------------------ reporting

    @property
    def _to(self) -> str:
        return f" to {self.url}" if self.url else ""

    def report(self) -> Report | None:
        """What the unreported failures mean: a warning, or (at the limit) the error; None when
        no save failed since the last report. Computed where the saves run; :meth:`apply` it on
        every process."""
        with self._lock:
            if not self._new:
                return None
            if self._fatal is not None:
                text = "; ".join(f"{what}: {describe(e)}" for what, e in self._fatal)
                return (
                    f"{self.who}: saving{self._to} failed {len(self._fatal)} times in a row "
                    f"(max_consecutive_failures={self.limit}), stopping: {text}",
                    True,
                )
            text = "; ".join(f"{what}: {describe(e)}" for what, e in self._new)
            return (
                f"{self.who}: a save{self._to} failed ({text}); nothing of it was committed, "
                "training goes on from the previous committed checkpoint "
                f"({self._count} consecutive failed save{'s' if self._count > 1 else ''} of "
                f"max_consecutive_failures={self.limit}; the next committed save resets the count)",
                False,
            )

    def apply(self, report: Report | None = None) -> None:
        """Warn about the unreported failures, or raise them at the limit. ``report``: the saving
        process's :meth:`report` (by default this process's own).

        Raises:
            CheckpointError: ``max_consecutive_failures`` saves in a row failed.
        """
        if report is None:
            report = self.report()
        with self._lock:
            self._new = []
            fatal, self._fatal = self._fatal, None
            if report is not None and report[1]:
                self._streak = []
        if report is None:
            return
        message, stop = report
        if stop:
            cause = fatal[0][1] if fatal else None
            raise CheckpointError(message) from cause
        log.warning(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def text_of(failures: Sequence[tuple[str, BaseException]]) -> str | None:
    """``"step 6: StorageError: ...; ..."``, or None without failures."""
    if not failures:
        return None
    return "; ".join(f"{what}: {describe(error)}" for what, error in failures)


def share_report(report: Report | None) -> Report | None:
    """Process 0's ``report`` on every process of an initialised ``torch.distributed`` group
    (a collective: call it on every process); ``report`` itself otherwise."""
    return collectives.broadcast(report)
