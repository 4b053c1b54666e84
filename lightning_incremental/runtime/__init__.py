"""The distributed runtime every adapter shares: framework-free, over ``torch.distributed``.

Imports torch, numpy and :mod:`lightning_incremental.core` only, never Lightning or Accelerate.
Its folders follow the concerns:

- :mod:`~lightning_incremental.runtime.session`: one run's lifecycle, its options and fork;
- :mod:`~lightning_incremental.runtime.cluster`: the job's processes as one — collectives, the
  coordinator, the heartbeat watchdog, the writer's start;
- :mod:`~lightning_incremental.runtime.policy`: decisions — cadence, failed saves,
  back-pressure, diverged replicas, preemption;
- :mod:`~lightning_incremental.runtime.state`: a rank's own state — random state, buffers, data
  position, replica fingerprints;
- :mod:`~lightning_incremental.runtime.memory`: the memory tier.
"""

from lightning_incremental.runtime.cluster.coordinate import CoordinatorError, Outcome, coordinated
from lightning_incremental.runtime.cluster.watchdog import Failure, Watchdog, WatchdogConfig
from lightning_incremental.runtime.policy.failures import FailurePolicy
from lightning_incremental.runtime.policy.preemption import PreemptionConfig
from lightning_incremental.runtime.session.options import RecoveryOptions
from lightning_incremental.runtime.state.replicas import ReplicaDivergedError, ReplicaReport

__all__ = [
    "CoordinatorError",
    "Failure",
    "FailurePolicy",
    "Outcome",
    "PreemptionConfig",
    "RecoveryOptions",
    "ReplicaDivergedError",
    "ReplicaReport",
    "Watchdog",
    "WatchdogConfig",
    "coordinated",
]
