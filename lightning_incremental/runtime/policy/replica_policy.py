"""The adapters' replica policy: what to do when data-parallel replicas diverged.

Before each save the adapters compare the replicas' weights and optimizer state
(:mod:`lightning_incremental.runtime.state.replicas`) and act as their ``replica_check`` argument
says: ``"warn"``, ``"repair"`` (broadcast the majority's copy), ``"stop"`` (every rank exits with
:data:`~lightning_incremental.runtime.state.replicas.EXIT_REPLICA_DIVERGED`) or ``"off"``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.state.replicas import (
    EXIT_REPLICA_DIVERGED,
    ReplicaDivergedError,
    ReplicaReport,
    check_replicas,
    repair_,
)

log = logging.getLogger("lightning_incremental")

ACTIONS = ("off", "warn", "repair", "stop")


def check_action(action: Any) -> str:
    """Validate an adapter's ``replica_check`` argument.

    Raises:
        TypeError / ConfigError: not one of :data:`ACTIONS`.
    """
    if not isinstance(action, str):
        raise TypeError(f"replica_check must be one of {ACTIONS}, got {action!r}")
    if action not in ACTIONS:
        raise ConfigError(f"replica_check must be one of {ACTIONS}, got {action!r}")
    return action


@dataclass(frozen=True)
class Verdict:
    """What a replica check found and did: ``report`` (None when not checked), ``repaired``
    (the keys broadcast from the reference rank), ``skip_save`` (the coordinator's own copy is
    not the reference one, so its state must not be committed)."""

    report: ReplicaReport | None
    repaired: tuple[str, ...] = ()
    skip_save: bool = False

    def audit(self) -> dict[str, Any] | None:
        """The audit-trail record of a repair (None when nothing was repaired)."""
        if self.report is None or not self.repaired:
            return None
        return {
            "diverged_ranks": sorted(self.report.diverged),
            "source_rank": self.report.source,
            "repaired": list(self.repaired[:20]),
            "repaired_count": len(self.repaired),
        }


def enforce(state: Any, action: str, *, coordinator: int = 0, group: Any = None) -> Verdict:
    """Check that replicas agree on ``state`` and act (a collective: call on every rank, with
    the same ``action``). The outcome is identical on every rank.

    - ``warn``: log and warn; when the coordinator is itself in the minority, ``skip_save``;
    - ``repair``: broadcast the reference copy into ``state``'s tensors in place, on every rank;
    - ``stop``: raise :class:`ReplicaDivergedError` (the adapters end the process with
      :data:`EXIT_REPLICA_DIVERGED` so the group restarts from the last good checkpoint).

    Raises:
        ReplicaDivergedError: ``stop``, or ``repair`` of a divergence a broadcast cannot fix.
    """
    if action == "off" or not collectives.is_distributed(group):
        return Verdict(None)
    report = check_replicas(state, coordinator=coordinator, group=group)
    if report.ok:
        return Verdict(report)
    message = report.describe()
    if action == "stop":
        log.error("%s Stopping (exit code %d).", message, EXIT_REPLICA_DIVERGED)
        raise ReplicaDivergedError(report)
    if action == "repair":
        repaired = repair_(state, report, group=group)
        log.warning("%s Repaired %d values from the majority's copies.", message, len(repaired))
        if collectives.rank(group) == coordinator:
            warnings.warn(
                f"{message} Repaired: {len(repaired)} values broadcast from the ranks holding "
                "the majority's version; training continues from a common state.",
                stacklevel=2,
            )
        return Verdict(report, tuple(repaired))
    skip = coordinator in report.diverged
    suffix = (
        " This checkpoint is skipped: the coordinator's copy is not the reference one."
        if skip
        else ""
    )
    log.warning("%s%s", message, suffix)
    if collectives.rank(group) == coordinator:
        warnings.warn(message + suffix, stacklevel=2)
    return Verdict(report, skip_save=skip)


def check_before_save(
    state: Callable[[], Any],
    action: str,
    *,
    finish_saves: Callable[[], object],
    barrier: Callable[[], object] = collectives.barrier,
) -> Verdict:
    """The adapters' replica check before a save (a collective: every rank calls it).
    ``state()`` builds the replicated state to compare (only when a check runs: ``action`` is
    not ``"off"`` and there is more than one rank). On a divergence under ``"stop"``, the
    earlier, good saves commit first (``finish_saves()``, a no-op on the ranks that do not
    save), every rank waits for the others (``barrier()``), then every rank ends with
    :data:`EXIT_REPLICA_DIVERGED` so the group restarts from the last good checkpoint.

    Raises:
        SystemExit: ``"stop"`` and the replicas diverged (exit code 89).
        ReplicaDivergedError: ``"repair"`` of a divergence a broadcast cannot fix.
    """
    if action == "off" or not collectives.is_distributed():
        return Verdict(None)
    try:
        return enforce(state(), action)
    except ReplicaDivergedError as exc:
        if action != "stop":
            raise
        finish_saves()  # the earlier, good checkpoints commit first ...
        barrier()  # ... before any rank exits and the group is torn down
        raise SystemExit(EXIT_REPLICA_DIVERGED) from exc
