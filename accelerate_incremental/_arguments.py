"""The checks on :class:`~accelerate_incremental.IncrementalCheckpointer`'s arguments: the
accelerator it is given, its settings (also checked by the launch flag before the script runs,
with no accelerator yet), and a step to save."""

from __future__ import annotations

import os
import warnings
from typing import Any

from accelerate_incremental import _memory, _sharded
from lightning_incremental.core import ConfigError, StepError, StepTypeError, StoreConfig
from lightning_incremental.runtime.policy.cadence import CadenceConfig
from lightning_incremental.runtime.policy.failures import DEFAULT_MAX_CONSECUTIVE_FAILURES
from lightning_incremental.runtime.policy.preemption import PreemptionConfig
from lightning_incremental.runtime.session.options import RecoveryOptions

# Accelerate's distributed types whose state the engine behind them owns and writes in its own
# files (FSDP is covered: see _sharded).
_REFUSED = {
    "DEEPSPEED": "DeepSpeed's engine owns the partitioned optimizer state and saves and loads it "
    "itself (its own files per process), outside of the state dicts this checkpointer saves",
    "MEGATRON_LM": "Megatron-LM's engine partitions the model and optimizer itself and saves "
    "them with its own checkpointing",
    "XLA": "XLA devices hold the tensors (the state would be moved off the device and "
    "gathered without XLA's own sharding information)",
}


def check_accelerator(accelerator: Any) -> None:
    """Refuse an accelerator the checkpointer does not cover; warn (on the main process) when
    FSDP was asked for and Accelerate runs DDP. The warning names the checkpointer's caller.

    Raises:
        TypeError: ``accelerator`` is not an Accelerator.
        ValueError: a DeepSpeed, Megatron-LM or XLA accelerator, or an Accelerator that sees one
            process in a multi-process launch.
    """
    from accelerate import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind.upper() in _REFUSED:
        raise ValueError(
            f"IncrementalCheckpointer does not support {kind} accelerators: "
            f"{_REFUSED[kind.upper()]}. Covered: single process, data parallel (DDP on "
            "CPU/GPU/XPU/NPU, i.e. distributed_type NO or MULTI_*) and FSDP; use "
            "accelerator.save_state for DeepSpeed/Megatron-LM/XLA."
        )
    fallback = _sharded.fsdp_fallback_warning(accelerator)
    if fallback is not None and accelerator.is_main_process:
        warnings.warn(fallback, UserWarning, stacklevel=3)
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1 and accelerator.num_processes == 1:
        raise ValueError(
            f"this process was launched as one of WORLD_SIZE={launched} processes, but the "
            "Accelerator runs as a single process (distributed_type NO), so every process "
            "would write the same checkpoints on its own. On a machine without GPUs create "
            "Accelerator(cpu=True) or launch with ACCELERATE_USE_CPU=1"
        )


def check_arguments(
    dirpath: Any,
    *,
    storage_options: Any = None,
    keep_last: Any = None,
    every_n_steps: Any = None,
    max_consecutive_failures: Any = DEFAULT_MAX_CONSECUTIVE_FAILURES,
    watchdog: Any = None,
    heartbeat_interval: Any = 5.0,
    heartbeat_timeout: Any = 60.0,
    progress_timeout: Any = 900.0,
    replica_check: Any = "warn",
    recovery: Any = None,
    preemption: Any = True,
    max_overhead: Any = None,
    expected_mtbf: Any = None,
    memory_every_n_steps: Any = None,
    memory_replicas: Any = 1,
    memory_dir: Any = None,
    read_only: Any = False,
    fork_from: Any = None,
    **options: Any,
) -> RecoveryOptions:
    """Validate :class:`IncrementalCheckpointer`'s arguments without an accelerator or a store
    (the launch flag checks its settings before the script runs). Returns the recovery options
    (watchdog, replica check, ``max_consecutive_failures``), validated.

    Raises:
        TypeError: an argument of the wrong type (``preemption``: a bool or a
            ``PreemptionConfig``).
        ValueError: a bad ``every_n_steps``, ``max_consecutive_failures`` or ``replica_check``.
        ConfigError: an invalid store option, watchdog timing, ``max_overhead``,
            ``expected_mtbf``, ``memory_every_n_steps`` or ``memory_replicas``, ``recovery``
            given together with one of the arguments it holds, or ``read_only`` with an
            argument that writes.
    """
    if not isinstance(dirpath, str):
        raise TypeError(f"dirpath must be a str (a directory or URL), got {type(dirpath).__name__}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(
            f"storage_options must be a dict or None, got {type(storage_options).__name__}"
        )
    if every_n_steps is not None and (
        isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
    ):
        raise ValueError(f"every_n_steps must be an int >= 1 or None, got {every_n_steps!r}")
    recovery = RecoveryOptions.resolve(
        recovery,
        watchdog=watchdog,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        progress_timeout=progress_timeout,
        replica_check=replica_check,
        max_consecutive_failures=max_consecutive_failures,
    )
    PreemptionConfig.of(preemption)
    if max_overhead is not None or expected_mtbf is not None:
        CadenceConfig(
            max_overhead=max_overhead, expected_mtbf=expected_mtbf, min_interval=every_n_steps or 1
        )
    _memory.options(memory_every_n_steps, memory_replicas, memory_dir)
    _check_read_only(read_only, every_n_steps, memory_every_n_steps, fork_from)
    StoreConfig().replace(keep_last=keep_last, **options)
    return recovery


def _check_read_only(read_only: Any, every_n_steps: Any, memory: Any, fork_from: Any) -> None:
    """``read_only`` is a bool, and then with no argument that writes.

    Raises:
        TypeError: ``read_only`` is not a bool.
        ConfigError: ``read_only`` with ``every_n_steps``, ``memory_every_n_steps`` or
            ``fork_from``.
    """
    if not isinstance(read_only, bool):
        raise TypeError(f"read_only must be True or False, got {read_only!r}")
    writes = {
        "every_n_steps": every_n_steps,
        "memory_every_n_steps": memory,
        "fork_from": fork_from,
    }
    given = [name for name, value in writes.items() if value is not None]
    if read_only and given:
        raise ConfigError(
            f"read_only=True loads checkpoints and never saves, but {', '.join(given)} "
            "would write: leave read_only off to save, or drop them to only load"
        )


def check_step(step: Any) -> None:
    """The checks on a step the engine makes at ``save``, made on every process before any
    collective (so that every process raises alike).

    Raises:
        StepError: ``step`` is not an int (a ``StepTypeError``, also a ``TypeError``), or is
            negative.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise StepTypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise StepError(f"step must be >= 0, got {step}")
