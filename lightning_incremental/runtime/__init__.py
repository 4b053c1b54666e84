"""The distributed runtime both adapters share: framework-free, over ``torch.distributed``.

Imports torch, numpy and :mod:`lightning_incremental.core` only, never Lightning or Accelerate.

- :mod:`~lightning_incremental.runtime.collectives`: is a process group up, rank, world size,
  gather, broadcast, barrier;
- :mod:`~lightning_incremental.runtime.coordinate`: the coordinator acts, every rank learns the
  outcome (:func:`coordinated`, :class:`CoordinatorError`);
- :mod:`~lightning_incremental.runtime.options`: :class:`RecoveryOptions`, what the adapters do
  about dead peers, diverged replicas and failed saves;
- :mod:`~lightning_incremental.runtime.watchdog`: heartbeats, dead/hung/isolated ranks, judged
  by :mod:`~lightning_incremental.runtime.judgement` over store calls that
  :mod:`~lightning_incremental.runtime.bounded` bounds by a deadline;
- :mod:`~lightning_incremental.runtime.replicas`: replica fingerprints, comparison, repair;
  :mod:`~lightning_incremental.runtime.replica_policy`: warn, repair or stop before a save;
- :mod:`~lightning_incremental.runtime.failures`: the ``max_consecutive_failures`` policy;
- :mod:`~lightning_incremental.runtime.backpressure`: waiting for room among pending saves;
- :mod:`~lightning_incremental.runtime.rng` and :mod:`~lightning_incremental.runtime.data_position`:
  each rank's random state and what its data order depends on.
"""

from lightning_incremental.runtime.coordinate import CoordinatorError, Outcome, coordinated
from lightning_incremental.runtime.failures import FailurePolicy
from lightning_incremental.runtime.options import RecoveryOptions
from lightning_incremental.runtime.replicas import ReplicaDivergedError, ReplicaReport
from lightning_incremental.runtime.watchdog import Failure, Watchdog, WatchdogConfig

__all__ = [
    "CoordinatorError",
    "Failure",
    "FailurePolicy",
    "Outcome",
    "RecoveryOptions",
    "ReplicaDivergedError",
    "ReplicaReport",
    "Watchdog",
    "WatchdogConfig",
    "coordinated",
]
