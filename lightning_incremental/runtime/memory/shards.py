"""Sharded state in the memory tier: each rank keeps its own shards, as plain tensors.

Under a sharded strategy (FSDP2 ``fully_shard``, tensor parallel) a rank's state dicts hold
``DTensor`` s. The memory tier is a per-rank copy that only the same world resumes from, so a
rank does not need the engine's pieces and boxes (those let a store be read by any number of
ranks): :func:`to_local` puts each DTensor's local shard in its place and notes the DTensor's
layout (global shape, local shape, dtype, placements, mesh shape and this rank's coordinate in
the mesh). A resume checks the layout of every live DTensor against the note
(:func:`check`) — another mesh of the same world size, another model or a changed
sharding is refused, and the run resumes from the store, which reshards — and then
copies the shards into the live tensors, which take their places in the restored state
(:func:`fill`).

Only ``DTensor`` is handled; FSDP1's ``ShardedTensor`` is refused by the adapters before a
step is taken. The walk costs one visit per container and tensor, and the notes are a few
numbers per DTensor (the mesh is described by its shape, never by its list of ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

Path = tuple[Any, ...]


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


def layout(t: Any) -> list[Any]:
    """What a DTensor's local shard stands for, as plain data."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    local = t.to_local()
    return [
        list(t.shape),
        list(local.shape),
        str(t.dtype),
        [str(p) for p in t.placements],
        list(mesh.shape),
        None if coordinate is None else list(coordinate),
    ]


def key(path: Path) -> str:
    """A path into the state, as the notes' key."""
    return "/".join(repr(k) for k in path)


def _walk(value: Any, path: Path, visit: Callable[[Any, Path], Any]) -> Any:
    """``value`` with each DTensor replaced by ``visit(dtensor, path)``; containers rebuilt only
    where something was replaced."""
    if _is_dtensor(value):
        return visit(value, path)
    if isinstance(value, dict):
        items = {k: _walk(v, (*path, k), visit) for k, v in value.items()}
        return items if any(items[k] is not value[k] for k in value) else value
    if isinstance(value, list):
        out = [_walk(v, (*path, i), visit) for i, v in enumerate(value)]
        return out if any(a is not b for a, b in zip(out, value)) else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        out_t = tuple(_walk(v, (*path, i), visit) for i, v in enumerate(value))
        return out_t if any(a is not b for a, b in zip(out_t, value)) else value
    return value


def to_local(state: Any, path: Path = ()) -> tuple[Any, dict[str, list[Any]]]:
    """``state`` with every DTensor replaced by its local shard (a view: the snapshot copies
    it), and the layout of each, by :func:`key` of its path."""
    notes: dict[str, list[Any]] = {}

    def visit(t: Any, where: Path) -> torch.Tensor:
        notes[key(where)] = layout(t)
        return t.to_local().detach()

    return _walk(state, path, visit), notes


def dtensors(state: Any) -> Iterator[tuple[Path, Any]]:
    """Every DTensor in ``state``, with its path."""
    found: list[tuple[Path, Any]] = []

    def visit(t: Any, where: Path) -> Any:
        found.append((where, t))
        return t

    _walk(state, (), visit)
    return iter(found)


def _at(state: Any, path: Path) -> Any:
    for k in path:
        state = state[k]
    return state


def check(live: Any, restored: Any, notes: Any) -> None:
    """Raise ``ValueError`` naming the first difference unless ``restored`` holds, for each
    DTensor of ``live``, a tensor noted with the same layout, and nothing else was noted."""
    if not isinstance(notes, dict):
        raise ValueError("the memory step holds no notes of its shards")
    seen = 0
    for where, t in dtensors(live):
        name = key(where)
        saved = notes.get(name)
        if saved is None:
            raise ValueError(f"{name}: not in the memory step's shards")
        now = layout(t)
        if list(saved) != now:
            raise ValueError(f"{name}: sharded as {saved} in the memory step, as {now} now")
        try:
            value = _at(restored, where)
        except (KeyError, IndexError, TypeError):
            value = None
        if not isinstance(value, torch.Tensor) or list(value.shape) != now[1]:
            raise ValueError(f"{name}: the memory step holds no shard of shape {now[1]}")
        seen += 1
    if seen != len(notes):
        raise ValueError(f"the memory step holds {len(notes)} shards, the live state {seen}")


def fill(live: Any, restored: Any) -> None:
    """Copy each restored shard into the local tensor of the live DTensor at its path, and put
    that DTensor in its place in ``restored`` (after :func:`check`). Everything else in
    ``restored`` stays as the memory step holds it: an optimizer's plain ``step`` and
    ``param_groups``, buffers and parameters that are not sharded."""
    with torch.no_grad():
        for where, t in dtensors(live):
            t.to_local().copy_(_at(restored, where))
            _at(restored, where[:-1])[where[-1]] = t
