"""Helpers over nested checkpoint states: walk tensors, count bytes, compare bit-exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def tensors(state: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` for every tensor in a nest of dicts/lists/tuples."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from tensors(value, f"{path}/{key}")
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from tensors(value, f"{path}/{index}")


def tensor_bytes(state: Any) -> int:
    """Bytes of tensor data in ``state``, each storage view counted once."""
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for _, t in tensors(state):
        nbytes = int(t.numel()) * t.element_size()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), nbytes)
        if nbytes and key not in seen:
            seen.add(key)
            total += nbytes
    return total


def map_tensors(state: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of the nest of dicts/lists/tuples with ``fn(tensor)`` in the place of every
    tensor (other leaves shared)."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return type(state)((k, map_tensors(v, fn)) for k, v in state.items())
    if isinstance(state, list):
        return [map_tensors(v, fn) for v in state]
    if isinstance(state, tuple):
        return tuple(map_tensors(v, fn) for v in state)
    return state


def clone(state: Any) -> Any:
    """A deep copy whose tensors own their bytes (a point-in-time snapshot)."""
    return map_tensors(state, lambda t: t.detach().clone())


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as the widest integer words that divide their length (``torch.equal``
    on uint8 is tens of times slower than on int64); the choice depends on the byte count only,
    so two tensors of one dtype and shape get the same view."""
    t = t.detach().contiguous().reshape(-1)
    if not t.numel():
        return t
    nbytes = t.numel() * t.element_size()
    for size, dtype in _WORDS:
        if nbytes % size == 0:
            if t.storage_offset() * t.element_size() % size:
                t = t.clone()  # an unaligned view: words need an aligned start
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


def first_difference(actual: Any, expected: Any, path: str = "") -> str | None:
    """None when ``actual`` equals ``expected`` bit for bit (tensors: dtype, shape, bytes),
    else the key path of the first difference."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or actual.dtype != expected.dtype:
            return path or "/"
        if actual.shape != expected.shape or not torch.equal(_raw(actual), _raw(expected)):
            return path or "/"
        return None
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return path or "/"
        for key in expected:
            diff = first_difference(actual[key], expected[key], f"{path}/{key}")
            if diff:
                return diff
        return None
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return path or "/"
        for index, (a, e) in enumerate(zip(actual, expected)):
            diff = first_difference(a, e, f"{path}/{index}")
            if diff:
                return diff
        return None
    return None if actual == expected else (path or "/")
