"""Every use of an Accelerate internal, in one module, read against the Accelerate sources of the
releases we support (:data:`OLDEST_SUPPORTED`, the ``accelerate>=1.0`` of the requirements, to
:data:`NEWEST_CHECKED`).

Accelerate has no public API for what the adapter must see of an ``Accelerator``: the objects
``prepare`` returned, in order (``_models``, ``_optimizers``, ``_schedulers``,
``_dataloaders``), the objects given to ``register_for_checkpointing`` (``_custom_objects``),
and the hooks given to ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
(``_save_model_state_pre_hook`` / ``_load_model_state_pre_hook``, ordered dicts of handle id to
hook). All of them are plain instance attributes with these names and meanings in every release
from 1.0 to 1.15; ``free_memory`` replaces the lists with new ones, so they are read on every use,
never kept.

Version differences handled here:

- ``ACCELERATE_USE_FSDP``: Accelerate itself takes only ``"true"`` for FSDP (exactly before 1.10,
  in any case from 1.10 on) and sets it to ``"true"`` when given an FSDP plugin.
  :func:`fsdp_requested` reads it as the adapter always has (``1``, ``true`` or ``yes``, in any
  case) for every release: it only decides whether the checkpointer warns about a run that
  asked for FSDP and got DDP.

Signals (read for the preemption path, :mod:`~._preemption`): no Accelerate release up to 1.16
installs a signal handler in the training processes, so the checkpointer's handler has nothing
to chain to there but the user's, and nothing of Accelerate's runs a collective inside a handler;
``Accelerator.set_trigger`` / ``check_trigger`` are a flag and an all-reduce the script calls
itself, in its own loop. The launcher is another process: ``accelerate launch --multi_gpu`` runs
torch's elastic agent in the launcher, which forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to every
process (``TORCHELASTIC_SIGNALS_TO_HANDLE`` adds others, e.g. SLURM's SIGUSR1) and SIGKILLs them
30 s later; a single-process ``accelerate launch`` (1.16) turns SIGTERM into the termination of
the process tree, SIGKILL 5 s after SIGTERM — too short for most last checkpoints: signal the
training process itself there, or launch it directly.

Importing this module does not import Accelerate: every function takes the accelerator (or
reads the environment) it is about.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: The oldest Accelerate release the adapter supports (the requirement ``accelerate>=1.0``).
OLDEST_SUPPORTED = (1, 0)
#: The newest Accelerate release whose sources the uses here were checked against.
NEWEST_CHECKED = (1, 15)

_FSDP_ENV = "ACCELERATE_USE_FSDP"
_TRUE = ("1", "true", "yes")


# --- what accelerator.prepare returned, and what was registered for checkpointing


def models(accelerator: Any) -> list[Any]:
    """The prepared models, in ``prepare`` order (the accelerator's own list: do not change it)."""
    found: list[Any] = accelerator._models
    return found


def buffers_kept_apart(accelerator: Any) -> bool:
    """Whether the prepared models keep each process's buffers apart: several processes under
    DDP (a ``MULTI_*`` distributed type, not FSDP or DeepSpeed) with
    ``DistributedDataParallelKwargs(broadcast_buffers=False)`` (the accelerator's
    ``ddp_handler``; its ``_models`` hold the modules, not the DDP wrappers)."""
    handler = getattr(accelerator, "ddp_handler", None)
    ddp = str(getattr(accelerator.distributed_type, "value", "")).startswith("MULTI_")
    return ddp and accelerator.num_processes > 1 and not getattr(handler, "broadcast_buffers", True)


def optimizers(accelerator: Any) -> list[Any]:
    """The prepared optimizers (``AcceleratedOptimizer``), in ``prepare`` order."""
    found: list[Any] = accelerator._optimizers
    return found


def schedulers(accelerator: Any) -> list[Any]:
    """The prepared learning-rate schedulers (``AcceleratedScheduler``), in ``prepare`` order."""
    found: list[Any] = accelerator._schedulers
    return found


def dataloaders(accelerator: Any) -> list[Any]:
    """The prepared DataLoaders (Accelerate's wrappers), in ``prepare`` order."""
    found: list[Any] = accelerator._dataloaders
    return found


def custom_objects(accelerator: Any) -> list[Any]:
    """The objects given to ``register_for_checkpointing``, in registration order."""
    found: list[Any] = accelerator._custom_objects
    return found


# --- save_state / load_state pre-hooks


def save_state_pre_hooks(accelerator: Any) -> list[Any]:
    """The hooks registered with ``register_save_state_pre_hook``, in registration order (each
    called ``hook(models, weights, output_dir)``)."""
    return list(accelerator._save_model_state_pre_hook.values())


def load_state_pre_hooks(accelerator: Any) -> list[Any]:
    """The hooks registered with ``register_load_state_pre_hook``, in registration order (each
    called ``hook(models, input_dir)``)."""
    return list(accelerator._load_model_state_pre_hook.values())


# --- methods the takeover shadows on the instance


def skip_first_batches(accelerator: Any, dataloader: Any, num_batches: int) -> Any:
    """Accelerate's own ``accelerator.skip_first_batches(dataloader, num_batches)``: the class's
    method, not an instance attribute that shadows it (the takeover's)."""
    return type(accelerator).skip_first_batches(accelerator, dataloader, num_batches)


def loader_over(dataloader: Any, batch_sampler: Any) -> Any:
    """A copy of the prepared ``dataloader`` over ``batch_sampler`` (batches of sample indices),
    built as Accelerate's ``skip_first_batches`` builds its copy of a ``DataLoaderShard``: the
    same dataset, collate function, workers, device placement and synchronized generator."""
    from accelerate.data_loader import _PYTORCH_DATALOADER_KWARGS, DataLoaderShard

    ignore = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
    kwargs = {
        k: getattr(dataloader, k, default)
        for k, default in _PYTORCH_DATALOADER_KWARGS.items()
        if k not in ignore
    }
    return DataLoaderShard(
        dataloader.dataset,
        device=dataloader.device,
        rng_types=dataloader.rng_types,
        synchronized_generator=dataloader.synchronized_generator,
        iteration=dataloader.iteration,
        batch_sampler=batch_sampler,
        **kwargs,
    )


# --- FSDP


def fsdp_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ACCELERATE_USE_FSDP`` asks for FSDP (``accelerate launch --use_fsdp``, an FSDP
    config, or an ``Accelerator`` given an FSDP plugin, which sets it); see the module's notes
    on how Accelerate's own reading differs by version."""
    env = os.environ if environ is None else environ
    return env.get(_FSDP_ENV, "false").lower() in _TRUE
