"""What one checkpoint of an ``Accelerator`` holds, and putting a loaded one back: the prepared
models (unwrapped state dicts, or this process's shards under FSDP: see
:mod:`accelerate_incremental._sharded`), optimizers, schedulers, the gradient scaler, the objects
registered with ``register_for_checkpointing``, the step counters and every process's own part
(gathered by the caller)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from accelerate_incremental import _compat, _sharded
from lightning_incremental.runtime.policy import replica_policy
from lightning_incremental.runtime.state import rank_buffers, rng

FORMAT = "accelerate_incremental/1"


def full(
    accelerator: Any, weights: list[dict[str, Any]] | None = None
) -> tuple[list[Any], list[Any]]:
    """The models' and optimizers' whole state dicts (``weights``: the models' state dicts as
    the save pre-hooks left them, instead of the models' own)."""
    acc = accelerator
    models = (
        weights
        if weights is not None
        else [acc.unwrap_model(m).state_dict() for m in _compat.models(acc)]
    )
    return models, [opt.state_dict() for opt in _compat.optimizers(acc)]


def sharded(accelerator: Any) -> tuple[list[Any], list[Any]]:
    """This process's shards of the models and optimizers (every process calls it)."""
    state = _sharded.state(accelerator)
    return state["models"], state["optimizers"]


def checkpoint(
    accelerator: Any,
    models: list[Any],
    optimizers: list[Any],
    iteration: int,
    processes: list[Any],
) -> dict[str, Any]:
    """The checkpoint dict: ``models`` and ``optimizers`` (from :func:`full` or
    :func:`sharded`), the rest of the accelerator's state, and ``processes`` (every process's
    own part, in process order)."""
    acc = accelerator
    return {
        "format": FORMAT,
        "models": models,
        "optimizers": optimizers,
        "schedulers": [s.state_dict() for s in _compat.schedulers(acc)],
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        "custom": [obj.state_dict() for obj in _compat.custom_objects(acc)],
        "counters": {"step": int(acc.step), "iteration": int(iteration)},
        "processes": processes,
    }


def process_state(accelerator: Any, loaders: Any) -> dict[str, Any]:
    """This process's own part of a checkpoint: its random state, its DataLoaders' positions
    and, where DDP does not broadcast them, its buffers."""
    local = {"rng": rng.capture(), "loaders": loaders.states()}
    buffers = own_buffers(accelerator)
    if buffers is not None:
        local["buffers"] = buffers
    return local


def own_buffers(accelerator: Any) -> list[dict[str, Any]] | None:
    """Each prepared model's buffers (batch norm statistics ...), copied to host memory, when a
    model keeps each process's apart (``DistributedDataParallel(broadcast_buffers=False)``:
    the models' state dicts hold the main process's only); else None."""
    acc = accelerator
    if not _compat.buffers_kept_apart(acc):
        return None
    return [rank_buffers.own(acc.unwrap_model(m)) for m in _compat.models(acc)]


def replicated(accelerator: Any) -> dict[str, Any]:
    """What the replica check compares: parameters and optimizer state, not buffers (running
    statistics legitimately differ per process under DDP); the tensors share storage with the
    live ones (for a repair)."""
    acc = accelerator
    return {
        "models": [
            {name: p.detach() for name, p in acc.unwrap_model(m).named_parameters()}
            for m in _compat.models(acc)
        ],
        "optimizers": [opt.state_dict() for opt in _compat.optimizers(acc)],
    }


def live(accelerator: Any, *, is_sharded: bool) -> dict[str, Any]:
    """The prepared models' own tensors, for the engine to restore into: their weights are
    decoded in place (``load_state_dict`` then copies each onto itself), not into a second
    copy of the model."""
    acc = accelerator
    if is_sharded:  # the live shards, optimizers' included
        return _sharded.state(acc)
    return {"models": [acc.unwrap_model(m).state_dict() for m in _compat.models(acc)]}


def restore(
    accelerator: Any,
    state: dict[str, Any],
    models: list[Any],
    *,
    is_sharded: bool,
    own: dict[str, Any] | None = None,
) -> None:
    """Put ``state`` back into the prepared objects: the weights into ``models`` (those the
    checkpoint's weights go to, after the load pre-hooks), every optimizer, scheduler, the
    scaler, the registered objects and the counters (``own``: this process's saved part, whose
    buffers, if any, replace the main process's). The caller checked that it fits."""
    acc = accelerator
    if is_sharded:  # torch checks the keys and sets every process's shards
        _sharded.apply(acc, models, state)
    else:
        for model, weights in zip(models, state["models"], strict=True):
            acc.unwrap_model(model).load_state_dict(weights)
        buffers = (own or {}).get("buffers")
        if buffers is None and _compat.buffers_kept_apart(acc) and acc.is_main_process:
            warnings.warn(
                "accelerate_incremental: this resume is not exact: DDP keeps each process's "
                "buffers apart (broadcast_buffers=False), but the checkpoint holds the main "
                "process's only (it was written by an earlier version), so every process "
                "resumes with those",
                UserWarning,
                stacklevel=3,
            )
        for model, saved in zip(models, buffers or [None] * len(models), strict=True):
            rank_buffers.put(acc.unwrap_model(model), saved)  # this process's own, if saved
        for opt, opt_state in zip(_compat.optimizers(acc), state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
    for sched, sched_state in zip(_compat.schedulers(acc), state["schedulers"], strict=True):
        sched.load_state_dict(sched_state)
    if acc.scaler is not None and state["scaler"] is not None:
        acc.scaler.load_state_dict(state["scaler"])
    for obj, obj_state in zip(_compat.custom_objects(acc), state["custom"], strict=True):
        obj.load_state_dict(obj_state)
    acc.step = int(state["counters"]["step"])
    acc.project_configuration.iteration = int(state["counters"]["iteration"])


def check_replicas(
    acc: Any, sharded: bool, mode: str, collect: Callable[..., None]
) -> replica_policy.Verdict:
    """Compare the processes' weights and optimizer state (every process at once; ``collect``
    with ``block=True`` finishes the main process's saves first); see
    :func:`~lightning_incremental.runtime.policy.replica_policy.check_before_save`."""
    if sharded:  # every process holds other shards, by design
        return replica_policy.Verdict(None)
    return replica_policy.check_before_save(
        lambda: replicated(acc),
        mode,
        finish_saves=lambda: collect(block=True),
        barrier=acc.wait_for_everyone,
    )
