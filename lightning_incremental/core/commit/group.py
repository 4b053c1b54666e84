"""The group a distributed store's saves talk over, and how an outcome reaches every rank.

Like ``torch.distributed.checkpoint.async_save``, a distributed :class:`CheckpointStore` creates
its own gloo process group when it is constructed (on every rank: creating a group is itself a
collective), and only the store's background saver thread uses it: the training's own
collectives (NCCL or gloo) never interleave with the checkpoint's. Every call on it is bounded by
the group's timeout, so a rank that died or hangs makes the others' save fail instead of waiting
forever.

Errors cross ranks as ``(type name, message)``: :func:`rebuild` makes the same exception type
again on every rank (a type of :mod:`~lightning_incremental.core.errors` or a builtin; anything
else becomes a :class:`~lightning_incremental.core.errors.CheckpointError`).
"""

from __future__ import annotations

import builtins
import datetime
from typing import Any, Protocol

from lightning_incremental.core import errors
from lightning_incremental.core.errors import CheckpointError, ConfigError


class Group(Protocol):
    """Gather to the coordinator (rank 0) and broadcast from it."""

    rank: int
    world: int

    def gather(self, value: Any) -> list[Any] | None: ...

    def broadcast(self, value: Any) -> Any: ...


class Alone:
    """The group of a single process."""

    rank = 0
    world = 1

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def broadcast(self, value: Any) -> Any:
        return value


class GlooGroup:
    """A dedicated gloo group over every rank of the default process group.

    Raises:
        ConfigError: ``torch.distributed`` is not initialised, or ``timeout_s`` is not > 0.
    """

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s must be a number > 0, got {timeout_s!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "distributed=True needs torch.distributed initialised on every rank before the "
                "store is created (torch.distributed.init_process_group, as torchrun scripts "
                "and Lightning/Accelerate do)"
            )
        self._dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
        )

    def gather(self, value: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(value, out, dst=0, group=self.group)
        return out

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        try:
            self._dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError):  # the default group went first: nothing to free
            pass


def describe_error(exc: BaseException) -> tuple[str, str]:
    """What crosses ranks of an error: its type's name and its message."""
    return type(exc).__name__, str(exc)


def rebuild(kind: str, message: str) -> Exception:
    """The exception ``describe_error`` described, as the same type where it is one of ours or a
    builtin."""
    cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:
            pass
    return CheckpointError(f"{kind}: {message}")
