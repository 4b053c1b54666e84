"""Turning decoded bytes into the tensors and arrays ``load`` returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch

from lightning_incremental.core.errors import CheckpointError, ConfigError
from lightning_incremental.core.format.records import TensorEntry
from lightning_incremental.core.format.tree import torch_dtype

MapLocation = Union[
    None, str, torch.device, dict[str, str], Callable[[torch.UntypedStorage, str], Any]
]


def allocate(entry: TensorEntry) -> tuple[Any, np.ndarray]:
    """An empty array for a (validated) manifest tensor entry, and its flat uint8 view."""
    nbytes = entry.nbytes
    if entry.numpy:
        raw = np.empty(nbytes, dtype=np.uint8)
        return raw, raw
    tensor = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else np.empty(0, np.uint8)
    return tensor, raw


def materialise(holder: Any, entry: TensorEntry, map_location: MapLocation) -> Any:
    if entry.numpy:
        return holder.view(np.dtype(entry.dtype)).reshape(entry.shape)
    tensor = place(holder, entry.device, map_location)
    if entry.param:
        return torch.nn.Parameter(tensor, requires_grad=entry.requires_grad)
    if entry.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor


def place(tensor: torch.Tensor, saved: str, map_location: MapLocation) -> torch.Tensor:
    """``tensor`` (restored on the CPU) where ``map_location`` puts it, exactly as ``torch.load``
    would (``torch.serialization._get_restore_location``):

    - None: the device it was saved on (``saved``, e.g. ``"cuda:0"``);
    - a str or ``torch.device``: that device, for every tensor;
    - a dict: ``map_location.get(saved, saved)``;
    - a callable: called as ``map_location(storage, saved)`` with the tensor's CPU
      ``UntypedStorage``; it returns the storage to use (``storage``, ``storage.cuda(1)``, ...)
      or None for the default (the saved device). For convenience a tensor of the same dtype
      and shape is accepted too.

    Raises:
        ConfigError: ``map_location`` is none of these, or the callable returned something else.
        CheckpointError: the target is a CUDA device and CUDA is not available.
    """
    if map_location is None:
        return _restore(tensor, saved)
    if isinstance(map_location, dict):
        return _restore(tensor, map_location.get(saved, saved))
    if isinstance(map_location, (str, torch.device)):
        return _restore(tensor, map_location)
    if not callable(map_location):
        raise ConfigError(
            f"map_location must be None, a device, a dict or a callable, got {map_location!r}"
        )
    result = map_location(tensor.untyped_storage(), saved)
    if result is None:  # torch.load: "keep the default location"
        return _restore(tensor, saved)
    if isinstance(result, torch.TypedStorage):
        result = result._untyped_storage
    if isinstance(result, torch.UntypedStorage):
        if result.nbytes() < tensor.untyped_storage().nbytes():
            raise ConfigError(
                f"map_location returned a storage of {result.nbytes()} bytes for a tensor of "
                f"{tensor.untyped_storage().nbytes()} bytes saved on {saved}"
            )
        out = torch.empty((0,), dtype=tensor.dtype, device=result.device)
        return out.set_(result, 0, tensor.shape, tensor.stride())
    if (
        isinstance(result, torch.Tensor)
        and result.dtype == tensor.dtype
        and result.shape == tensor.shape
    ):
        return result
    raise ConfigError(
        f"map_location({saved!r}) returned {type(result).__name__}: a map_location callable "
        "must return a storage (e.g. the storage it was given, or storage.cuda()) or None, as "
        "with torch.load"
    )


def _restore(tensor: torch.Tensor, target: str | torch.device) -> torch.Tensor:
    """``tensor`` on the device ``target`` names (torch.load's ``default_restore_location``)."""
    try:
        device = torch.device(target)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"map_location names an unknown device {target!r}: {exc}") from exc
    if device.type == "cpu":
        return tensor
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            f"the checkpoint holds tensors for {target} but CUDA is not available; "
            "pass map_location='cpu'"
        )
    return tensor.to(device)
