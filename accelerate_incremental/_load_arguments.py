"""The checks on ``accelerator.load_state``'s arguments under the integration and on
:meth:`~accelerate_incremental.IncrementalCheckpointer.load`'s ``map_location``."""

from __future__ import annotations

from typing import Any

# Accelerate's own message for a map_location that `load_state` does not take.
_BAD_MAP_LOCATION = (
    "Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
    "`'on_device'`"
)


def map_location(accelerator: Any, value: Any) -> Any:
    """Accelerate's ``map_location`` (None, ``"cpu"`` or ``"on_device"``) as the store's load
    takes it: ``"cpu"`` (None too: the values are copied into the live objects wherever they are)
    or this process's device.

    Raises:
        TypeError: any other value, as Accelerate raises.
    """
    if value is not None and (not isinstance(value, str) or value not in ("cpu", "on_device")):
        raise TypeError(_BAD_MAP_LOCATION)
    return accelerator.device if value == "on_device" else "cpu"


def load_state_arguments(accelerator: Any, load_kwargs: Any, kwargs: dict[str, Any]) -> Any:
    """Check ``accelerator.load_state``'s arguments under the integration; returns the store's
    ``map_location``. Accelerate hands ``load_kwargs`` to ``torch.load`` of its own files and the
    other keyword arguments to the models' ``load_state_dict`` (or DeepSpeed): none of which the
    incremental restore has, so each is refused rather than ignored; ``strict=True`` (what it
    does anyway) and an empty ``load_kwargs`` are accepted.

    Raises:
        TypeError: a bad ``map_location``, or an argument that cannot be honoured.
    """
    location = map_location(accelerator, kwargs.get("map_location"))
    if load_kwargs is not None and not isinstance(load_kwargs, dict):
        raise TypeError(f"load_kwargs must be a dict or None, not {type(load_kwargs).__name__}")
    refused = [f"load_kwargs[{key!r}]" for key in load_kwargs or {}]
    refused += [
        key
        for key, value in kwargs.items()
        if key != "map_location" and not (key == "strict" and value is True)
    ]
    if refused:
        raise TypeError(
            f"accelerator.load_state(): {', '.join(refused)} cannot be honoured by the "
            "incremental checkpointer (Accelerate passes them to torch.load or load_state_dict "
            "of its own files; the restore here is strict and reads its own store): leave them "
            "out, or release() the integration to load an Accelerate checkpoint directory"
        )
    return location
