"""Turning decoded bytes into the tensors and arrays ``load`` returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch

from lightning_incremental.core.errors import CheckpointError, ConfigError
from lightning_incremental.core.tree import torch_dtype

MapLocation = Union[
    None, str, torch.device, dict[str, str], Callable[[torch.Tensor, str], torch.Tensor]
]


def allocate(entry: dict[str, Any]) -> tuple[Any, np.ndarray]:
    """An empty array for a (validated) manifest tensor entry, and its flat uint8 view."""
    nbytes = entry["nbytes"]
    if entry["numpy"]:
        raw = np.empty(nbytes, dtype=np.uint8)
        return raw, raw
    tensor = torch.empty(entry["shape"], dtype=torch_dtype(entry["dtype"]))
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else np.empty(0, np.uint8)
    return tensor, raw


def materialise(holder: Any, entry: dict[str, Any], map_location: MapLocation) -> Any:
    if entry["numpy"]:
        return holder.view(np.dtype(entry["dtype"])).reshape(entry["shape"])
    tensor = place(holder, entry["device"], map_location)
    if entry["param"]:
        return torch.nn.Parameter(tensor, requires_grad=entry["requires_grad"])
    if entry["requires_grad"] and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor


def place(tensor: torch.Tensor, saved: str, map_location: MapLocation) -> torch.Tensor:
    if callable(map_location):
        return map_location(tensor, saved)
    target: Any
    if map_location is None:
        target = saved
    elif isinstance(map_location, dict):
        target = map_location.get(saved, saved)
    elif isinstance(map_location, (str, torch.device)):
        target = map_location
    else:
        raise ConfigError(f"map_location must be a device, dict or callable, got {map_location!r}")
    device = torch.device(target)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            f"the checkpoint holds tensors saved on {saved} but CUDA is not available; "
            "pass map_location='cpu'"
        )
    return tensor.to(device)
