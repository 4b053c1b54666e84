"""What a data loader's order of batches depends on: the ``torch.Generator`` objects it draws from.

A shuffled epoch's order is a function of the random state when its iterator starts: the global
torch state (:mod:`lightning_incremental.runtime.state.rng`) and every generator a loader, its
samplers or its dataset hold (``DataLoader(generator=...)``, ``RandomSampler(generator=...)``,
Accelerate's ``synchronized_generator``). Both adapters record them at each epoch's start and put
them back on resume; this module finds them and moves their states, by attribute path (the keys
checkpoints hold: ``"0.sampler.generator"``, ``"batch_sampler.sampler.generator"``).

Framework-free: each adapter says which attributes hold generators, which to follow and how deep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def find_generators(
    root: Any,
    *,
    path: str = "",
    names: Iterable[str] = ("generator",),
    follow: Iterable[str] = (),
    max_depth: int,
    accept: Callable[[Any], bool] = lambda value: True,
    seen: set[int] | None = None,
) -> dict[str, torch.Generator]:
    """Every distinct ``torch.Generator`` reachable from ``root``, by attribute path.

    Args:
        root: the loader.
        path: ``root``'s own path (``"0"`` for a trainer's first loader; ``""``: no prefix).
        names: the attributes that may hold a generator, looked at in this order.
        follow: the attributes to walk into, in this order.
        max_depth: how many levels below ``root`` to walk.
        accept: whether a followed attribute's value is walked into.
        seen: ids of generators already found (under another root): each is reported once.

    Paths join with ``.``: ``"0.sampler.generator"``; from ``path=""``, ``"sampler.generator"``.
    """
    names, follow = tuple(names), tuple(follow)
    found: dict[str, torch.Generator] = {}
    seen = set() if seen is None else seen

    def join(base: str, name: str) -> str:
        return f"{base}.{name}" if base else name

    def walk(obj: Any, at: str, depth: int) -> None:
        for name in names:
            gen = getattr(obj, name, None)
            if isinstance(gen, torch.Generator) and id(gen) not in seen:
                seen.add(id(gen))
                found[join(at, name)] = gen
        if depth >= max_depth:
            return
        for name in follow:
            value = getattr(obj, name, None)
            if value is not None and accept(value):
                walk(value, join(at, name), depth + 1)

    walk(root, path, 0)
    return found


def generator_states(found: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    """Each generator's state (``get_state``), by path: plain tensors for a checkpoint."""
    return {path: gen.get_state() for path, gen in found.items()}


def set_generator_states(
    found: dict[str, torch.Generator], states: dict[str, torch.Tensor]
) -> list[str]:
    """Put saved ``states`` back into the generators ``found`` at the same paths; returns the
    paths that are in only one of the two (sorted), whose states were not put back."""
    for path, state in states.items():
        if path in found:
            found[path].set_state(state.cpu())
    return sorted(set(states) ^ set(found))
