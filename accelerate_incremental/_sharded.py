"""Accelerate's FSDP plugin (FSDP2 ``fully_shard``, FSDP1): the sharded state the checkpointer
saves and restores, and the check for Accelerate's silent fallback from FSDP to DDP.

Under ``distributed_type == FSDP`` every process holds its shards only. The checkpointer then
saves the *sharded* state dicts of ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=False``: DTensors
for FSDP2, ``ShardedTensor`` objects for FSDP1, whatever ``state_dict_type`` the plugin was given)
through a store every process opens with ``distributed=True``: each process writes its own
pieces, the main process the plain values and the one manifest; nothing is gathered. A load
fills the live shards in place and sets them with ``set_model_state_dict`` /
``set_optimizer_state_dict``.

On a machine without GPUs Accelerate drops an FSDP plugin without a word: ``Accelerator`` sets
``ACCELERATE_USE_FSDP=true`` but the distributed type stays ``MULTI_CPU`` (DDP), every process
holding the whole model. :func:`fsdp_fallback_warning` names that.
"""

from __future__ import annotations

from typing import Any

from accelerate_incremental import _compat


def is_sharded(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs FSDP (FSDP1 or FSDP2): its models hold shards."""
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    return str(kind).upper() == "FSDP"


def fsdp_fallback_warning(accelerator: Any) -> str | None:
    """The warning for an FSDP run Accelerate turned into DDP (None when FSDP runs, or was not
    asked for)."""
    if not _compat.fsdp_requested():
        return None
    if is_sharded(accelerator):
        return None
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    return (
        "FSDP was asked for (ACCELERATE_USE_FSDP=true, an FSDP plugin or config) but Accelerate "
        f"runs distributed_type {kind}: without GPUs it silently falls back to DDP, every process "
        "holding the whole model and optimizer state. IncrementalCheckpointer saves this run as "
        "the DDP run it is (one full checkpoint from the main process), not as FSDP shards. Run "
        "on GPUs for FSDP, or drop the FSDP config to silence this."
    )


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer wraps it


def owner(models: list[Any], optimizer: Any) -> Any:
    """The prepared model whose parameters ``optimizer`` updates.

    Raises:
        ValueError: no prepared model holds the optimizer's parameters.
    """
    params = {id(p) for group in _inner(optimizer).param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ValueError(
        "an optimizer's parameters belong to no prepared model: prepare the model and its "
        "optimizer together (accelerator.prepare(model, optimizer))"
    )


def state(accelerator: Any) -> dict[str, Any]:
    """This process's sharded model and optimizer state dicts (``models``, ``optimizers``),
    sharing memory with the live shards. Every process calls it (FSDP1's is a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    models = list(_compat.models(accelerator))
    return {
        "models": [get_model_state_dict(m, options=_options()) for m in models],
        "optimizers": [
            get_optimizer_state_dict(owner(models, opt), _inner(opt), options=_options())
            for opt in _compat.optimizers(accelerator)
        ],
    }


def apply(accelerator: Any, models: list[Any], loaded: dict[str, Any]) -> None:
    """Set ``models`` (those the checkpoint's weights go to) and every prepared optimizer from
    ``loaded`` (restored into :func:`state`'s tensors). Every process calls it."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for model, weights in zip(models, loaded["models"], strict=True):
        set_model_state_dict(model, weights, options=_options())
    everything = list(_compat.models(accelerator))
    for opt, saved in zip(_compat.optimizers(accelerator), loaded["optimizers"], strict=True):
        set_optimizer_state_dict(owner(everything, opt), _inner(opt), saved, options=_options())
