"""Checks that an accelerator is ready to checkpoint and that a checkpoint fits it, with errors
that name what differs."""

from __future__ import annotations

from typing import Any

import torch

from accelerate_incremental import _compat

_SHOWN = 8


def check_prepared(accelerator: Any) -> None:
    """Raises RuntimeError when nothing was prepared yet."""
    if not _compat.models(accelerator):
        raise RuntimeError(
            "no prepared model: call accelerator.prepare(model, optimizer, ...) before saving or "
            "loading a checkpoint (the checkpointer restores into the prepared objects)"
        )


def check_loaders(accelerator: Any) -> None:
    """Raises ValueError for a prepared torchdata ``StatefulDataLoader`` (not covered)."""
    for i, loader in enumerate(_compat.dataloaders(accelerator)):
        if getattr(loader, "use_stateful_dataloader", False) is True:
            raise ValueError(
                f"prepared DataLoader {i} uses use_stateful_dataloader=True, which "
                "accelerate_incremental does not cover yet; use a plain DataLoader iterated "
                "through checkpointer.iterate(loader), which resumes mid-epoch exactly"
            )


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _count(what: str, saved: int, now: int) -> None:
    if saved != now:
        raise ValueError(
            f"the checkpoint holds {saved} {what} but this run has {now}: restore into the same "
            "set of prepared/registered objects, in the same order, as the saved run"
        )


def check_model(index: int, model: torch.nn.Module, saved: dict[str, Any]) -> None:
    """Raises ValueError naming missing / unexpected keys and shape or dtype mismatches."""
    current = model.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    problems = []
    if missing:
        problems.append(f"missing keys {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_names(unexpected)}")
    mismatched = [
        f"{key!r}: saved {tuple(saved[key].shape)}, model {tuple(value.shape)}"
        for key, value in current.items()
        if key in saved
        and isinstance(value, torch.Tensor)
        and isinstance(saved[key], torch.Tensor)
        and saved[key].shape != value.shape
    ]
    if mismatched:
        problems.append("shape mismatch " + "; ".join(mismatched[:_SHOWN]))
    if problems:
        raise ValueError(
            f"the checkpoint's model {index} does not fit this run's model {index} "
            f"({type(model).__name__}): " + "; ".join(problems)
        )


def check_optimizer(index: int, optimizer: Any, saved: dict[str, Any]) -> None:
    """Raises ValueError when the parameter groups differ in number or size."""
    groups = optimizer.param_groups
    saved_groups = saved.get("param_groups", [])
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"the checkpoint's optimizer {index} has parameter groups of sizes {saved_sizes}, this "
            f"run's optimizer {index} has {sizes}: a different model or optimizer layout"
        )
    params = [p for g in groups for p in g["params"]]
    ids = [i for g in saved_groups for i in g["params"]]
    by_id = dict(zip(ids, params, strict=True))
    for pid, entry in saved.get("state", {}).items():
        param = by_id.get(pid)
        if param is None or not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.shape != param.shape
                and value.dim() == param.dim()
            ):
                raise ValueError(
                    f"the checkpoint's optimizer {index} state {name!r} of parameter {pid} has "
                    f"shape {tuple(value.shape)}, the parameter has {tuple(param.shape)}: a "
                    "different model layout"
                )


def check_compatible(
    accelerator: Any,
    state: dict[str, Any],
    fmt: str,
    models: list[Any] | None = None,
    *,
    weights: bool = True,
    resizable: bool = True,
) -> None:
    """Raises ValueError when ``state`` is not a checkpoint of this accelerator's layout.
    ``models``: the models the checkpoint's weights go to (default: every prepared model; fewer
    when a load pre-hook loaded some itself). ``weights``: also compare the models' keys and
    shapes and the optimizers' groups (False for sharded state dicts, which torch's
    ``set_model_state_dict`` / ``set_optimizer_state_dict`` check). ``resizable``: a checkpoint
    of another number of processes may be loaded (see :mod:`~._resize`)."""
    if models is None:
        models = list(_compat.models(accelerator))
    if not isinstance(state, dict) or state.get("format") != fmt:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"not an accelerate_incremental checkpoint (format {found!r}, expected {fmt!r}); "
            "was it written by another adapter?"
        )
    _count("prepared models", len(state["models"]), len(models))
    _count("prepared optimizers", len(state["optimizers"]), len(_compat.optimizers(accelerator)))
    _count("prepared schedulers", len(state["schedulers"]), len(_compat.schedulers(accelerator)))
    _count(
        "objects registered with register_for_checkpointing",
        len(state["custom"]),
        len(_compat.custom_objects(accelerator)),
    )
    saved_processes = len(state["processes"])
    if saved_processes != accelerator.num_processes and not resizable:
        raise ValueError(
            f"the checkpoint was written by {saved_processes} processes, this run has "
            f"{accelerator.num_processes}: a sharded state is resumed on the same number of "
            "processes here; resume with --num_processes "
            f"{saved_processes}"
        )
    loaders = len(state["processes"][0]["loaders"])
    _count("prepared DataLoaders", loaders, len(_compat.dataloaders(accelerator)))
    if not weights:
        return
    for i, (model, saved_weights) in enumerate(zip(models, state["models"], strict=True)):
        check_model(i, accelerator.unwrap_model(model), saved_weights)
    for i, (opt, saved) in enumerate(
        zip(_compat.optimizers(accelerator), state["optimizers"], strict=True)
    ):
        check_optimizer(i, opt, saved)
