"""The coordinator acts, every rank learns the outcome.

Opening a store, claiming a fencing generation, picking the step to resume from, starting a
save: one rank (the coordinator, rank 0) does it, and every other rank must learn what came of
it — the value, or that it failed — or they wait in the next collective for a rank that raised.
:func:`coordinated` is that sequence: the coordinator runs the action, catching its error; one
broadcast carries the value (or the error's text); the coordinator re-raises its own error
unchanged and every other rank raises :class:`CoordinatorError`, which names the failing rank
and the cause. The same error type on every rank, whichever adapter runs.

:class:`Outcome` is the sequence in pieces, for a caller whose broadcast carries more than the
outcome (the failure report of earlier saves, say).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from lightning_incremental.core.errors import (
    CheckpointError,
    StoreNotWritableError,
    WriterLeaseError,
)
from lightning_incremental.runtime.cluster import collectives

T = TypeVar("T")

#: ``broadcast(value, src)``: the value of rank ``src`` on every rank (a collective), as
#: :func:`lightning_incremental.runtime.cluster.collectives.broadcast` or a Lightning strategy's.
Broadcast = Callable[[Any, int], Any]

#: What travels from the coordinator: the action's value (None after an error), the error's text.
Message = tuple[Any, "str | None"]


class CoordinatorError(CheckpointError, RuntimeError):
    """Raised on every other rank when the coordinator's action failed (the coordinator raises
    its own error). ``rank``: the coordinator's rank; ``what``: the action ("open the checkpoint
    store ..."); ``cause``: the coordinator's error as ``"TypeName: message"``."""

    def __init__(self, rank: int, what: str, cause: str) -> None:
        super().__init__(f"rank {rank} could not {what}: {cause}")
        self.rank = rank
        self.what = what
        self.cause = cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.what, self.cause))


class CoordinatorFileNotFoundError(CoordinatorError, FileNotFoundError):
    """:class:`CoordinatorError` for a coordinator's ``FileNotFoundError``: also a
    ``FileNotFoundError``, as a framework's loader raises on every rank for a missing file (code
    that catches it keeps working on every rank)."""


class CoordinatorWriterLeaseError(CoordinatorError, WriterLeaseError):
    """:class:`CoordinatorError` for a coordinator's ``WriterLeaseError`` (another process
    writes the store): also a ``WriterLeaseError``, on every rank alike."""


class CoordinatorStoreNotWritableError(CoordinatorError, StoreNotWritableError):
    """:class:`CoordinatorError` for a coordinator's ``StoreNotWritableError``: also one, on
    every rank alike."""


#: The coordinator's error type name → the type the other ranks raise, where callers are known
#: to catch by type (a missing checkpoint file, a store another process writes or that cannot
#: be written).
_MIRRORED: dict[str, type[CoordinatorError]] = {
    "FileNotFoundError": CoordinatorFileNotFoundError,
    "WriterLeaseError": CoordinatorWriterLeaseError,
    "StoreNotWritableError": CoordinatorStoreNotWritableError,
}


def error_for(rank: int, what: str, cause: str) -> CoordinatorError:
    """The error other ranks raise for the coordinator's ``cause`` (``"TypeName: message"``)."""
    kind = _MIRRORED.get(cause.partition(":")[0], CoordinatorError)
    return kind(rank, what, cause)


def describe(error: BaseException | None) -> str | None:
    """``"TypeName: message"`` (None for None): an error as text that any rank can read."""
    return None if error is None else f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What an action came to on this rank: ``ran`` (this rank ran it), its ``value`` or its
    ``error``. A rank that did not run it holds ``Outcome()``."""

    ran: bool = False
    value: T | None = None
    error: Exception | None = None

    @classmethod
    def of(cls, action: Callable[[], T]) -> Outcome[T]:
        """Run ``action``; its value, or the ``Exception`` it raised (``BaseException`` such
        as ``KeyboardInterrupt`` propagates)."""
        try:
            return cls(True, action())
        except Exception as exc:  # re-raised by result(), after the other ranks learn of it
            return cls(True, None, exc)

    def message(self) -> Message:
        """What the other ranks need: the value (None after an error) and the error's text.
        The value travels by pickle: keep it plain data."""
        if self.error is not None:
            return None, describe(self.error)
        return self.value, None

    def result(self, message: Message, *, what: str, coordinator: int = 0) -> T:
        """The outcome on this rank: the rank that ran the action returns its value or raises
        its own error; another rank returns the value in the coordinator's ``message`` or
        raises :class:`CoordinatorError`.

        Raises:
            Exception: this rank's own error, where it ran the action.
            CoordinatorError: the action failed on the coordinator (also a ``FileNotFoundError``
            where the coordinator's was one).
        """
        if self.ran:
            if self.error is not None:
                raise self.error
            return self.value  # type: ignore[return-value]  # None only where T allows it
        value, cause = message
        if cause is not None:
            raise error_for(coordinator, what, cause)
        shared: T = value
        return shared


def coordinated(
    action: Callable[[], T],
    *,
    what: str,
    is_coordinator: bool,
    broadcast: Broadcast | None = None,
    coordinator: int = 0,
) -> T:
    """Run ``action`` on the coordinator; return its value on every rank, or raise there.
    A collective: every rank calls it, ``is_coordinator`` True on exactly one.

    Args:
        action: what the coordinator does; its value must pickle (it is broadcast).
        what: the action for messages, after "could not" ("open the checkpoint store s3://b").
        is_coordinator: whether this rank runs ``action``.
        broadcast: the group's broadcast (default :func:`collectives.broadcast`).
        coordinator: the coordinator's rank.

    Raises:
        Exception: on the coordinator, the action's own error.
        CoordinatorError: on every other rank, when the action failed.
    """
    mine: Outcome[T] = Outcome.of(action) if is_coordinator else Outcome()
    send = broadcast if broadcast is not None else collectives.broadcast
    return mine.result(send(mine.message(), coordinator), what=what, coordinator=coordinator)
