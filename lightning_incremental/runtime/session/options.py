"""How an adapter recovers from failures: the options both adapters take, in one place.

:class:`RecoveryOptions` gathers what :class:`~lightning_incremental.IncrementalCheckpoint` and
:class:`~accelerate_incremental.IncrementalCheckpointer` accept beside the store's own
configuration: the heartbeat watchdog and its windows, the replica check's action and the
failed-save policy. Frozen, keyword-only and validated on construction; the adapters take it
as ``recovery=`` or build it from their individual arguments (``heartbeat_timeout=``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.runtime.cluster.watchdog import Watchdog, WatchdogConfig, watch_job
from lightning_incremental.runtime.policy.failures import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    check_max_consecutive_failures,
)
from lightning_incremental.runtime.policy.replica_policy import check_action


@dataclass(frozen=True, kw_only=True)
class RecoveryOptions:
    """What to do about dead peers, diverged replicas and failed saves.

    Attributes:
        watchdog: run the heartbeat watchdog
            (:mod:`lightning_incremental.runtime.cluster.watchdog`);
            None: only when there is more than one process.
        heartbeat_interval, heartbeat_timeout, progress_timeout: the watchdog's windows in
            seconds (see :class:`~lightning_incremental.runtime.cluster.watchdog.WatchdogConfig`).
        replica_check: ``"warn"``, ``"repair"``, ``"stop"`` or ``"off"``
            (:mod:`lightning_incremental.runtime.policy.replica_policy`).
        max_consecutive_failures: failed saves in a row that stop training
            (:mod:`lightning_incremental.runtime.policy.failures`).

    Raises:
        TypeError: ``watchdog`` is not a bool or None, ``max_consecutive_failures`` not an int,
            ``replica_check`` not a str.
        ConfigError: an invalid window, replica action or failure limit.
    """

    watchdog: bool | None = None
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 60.0
    progress_timeout: float = 900.0
    replica_check: str = "warn"
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES

    def __post_init__(self) -> None:
        if self.watchdog is not None and not isinstance(self.watchdog, bool):
            raise TypeError(f"watchdog must be True, False or None, got {self.watchdog!r}")
        check_max_consecutive_failures(self.max_consecutive_failures)
        check_action(self.replica_check)
        self.watchdog_config  # noqa: B018 - validates the windows

    @property
    def watchdog_config(self) -> WatchdogConfig:
        """The watchdog's windows."""
        return WatchdogConfig(
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
            progress_timeout=self.progress_timeout,
        )

    def watchdog_on(self, world_size: int) -> bool:
        """Whether to run the watchdog in a job of ``world_size`` processes."""
        return self.watchdog if self.watchdog is not None else world_size > 1

    def start_watchdog(self, *, rank: int, world_size: int, generation: int) -> Watchdog | None:
        """This rank's watchdog over the job's TCPStore, started; None when it is off (see
        :meth:`watchdog_on`).

        Raises:
            ConfigError: the watchdog is on and there is no TCPStore to use.
        """
        if not self.watchdog_on(world_size):
            return None
        return watch_job(
            self.watchdog_config, rank=rank, world_size=world_size, generation=generation
        )

    @classmethod
    def resolve(cls, recovery: Any, **arguments: Any) -> RecoveryOptions:
        """The options of an adapter that takes both ``recovery=`` and the individual arguments
        (``arguments``: their values as passed, under the field names): ``recovery`` when given
        (then every individual argument must keep its default), else built from ``arguments``.

        Raises:
            TypeError: ``recovery`` is not a RecoveryOptions (nor None).
            ConfigError: ``recovery`` and an individual argument given together, or an invalid
                value (see the class).
        """
        if recovery is None:
            return cls(**arguments)
        if not isinstance(recovery, cls):
            raise TypeError(f"recovery must be a RecoveryOptions or None, got {recovery!r}")
        defaults = {f.name: f.default for f in fields(cls)}
        given = sorted(
            name
            for name, value in arguments.items()
            if value != defaults[name] or type(value) is not type(defaults[name])
        )
        if given:
            raise ConfigError(
                f"pass either recovery=RecoveryOptions(...) or {', '.join(given)}, not both: "
                f"put {', '.join(given)} into the RecoveryOptions"
            )
        return recovery
