"""An epoch's global order of samples, and how its unfinished rest is split over another world.

A ``DistributedSampler``'s epoch is a function of (seed, epoch, dataset length, shuffle): one
permutation of the dataset — the epoch's *global order* (``torch.randperm`` seeded with
``seed + epoch``, or ``0..n-1`` unshuffled) — cut into ranks by interleaving (rank ``r`` takes
positions ``r, r + W, r + 2W, ...``) after padding it to a multiple of ``W`` with its own first
samples, or truncating it to one (``drop_last=True``). Only the cut depends on the world size.
Each rank's first ``k`` samples are therefore positions ``[0, W*k)`` of the order: after ``b``
batches of ``B`` samples on each of ``W`` ranks, the epoch has trained the prefix of length
``W*b*B`` (capped at the order's length; beyond it, padding repeats samples already trained).

A run resumed on another number of ranks gives them the rest of that order, cut as a sampler of
the new world cuts an order (:func:`split`), so every sample of the interrupted epoch is trained
exactly once — apart from the padding, at most ``W-1`` samples trained twice (with the sampler's
``drop_last``: at most ``W-1`` left out), as in any epoch whose length ``W`` does not divide.

A resumed epoch can be interrupted again. Its position is therefore kept as a :class:`Segment`:
where in the order the current cut began, over how many ranks, and at which of the epoch's batch
counts. Pure functions of plain data; the adapters read the sampler and apply the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

PERMUTATION = "permutation"  # DistributedSampler(shuffle=True)
SEQUENTIAL = "sequential"  # DistributedSampler(shuffle=False), SequentialSampler


@dataclass(frozen=True)
class EpochOrder:
    """What one epoch's global order is a function of."""

    kind: str  # PERMUTATION or SEQUENTIAL
    length: int  # samples in the dataset
    seed: int = 0
    epoch: int = 0
    drop_last: bool = False  # the sampler's: truncate the order to a multiple of the world

    def __post_init__(self) -> None:
        if self.kind not in (PERMUTATION, SEQUENTIAL):
            raise ValueError(f"unknown kind of order {self.kind!r}")
        if self.length < 0:
            raise ValueError(f"length must be >= 0, got {self.length}")

    def indices(self) -> list[int]:
        """The order itself, exactly as ``torch.utils.data.DistributedSampler`` draws it."""
        if self.kind == SEQUENTIAL:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochOrder:
        return cls(**{k: data[k] for k in ("kind", "length", "seed", "epoch", "drop_last")})


@dataclass(frozen=True)
class Segment:
    """The part of an epoch's order being trained by one world: from position ``start`` of the
    order, cut over ``world`` ranks, beginning after the epoch's ``first_batch`` batches."""

    start: int
    world: int
    first_batch: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Segment:
        return cls(int(data["start"]), int(data["world"]), int(data["first_batch"]))


def position(order_length: int, segment: Segment, batches: int, batch_size: int) -> int:
    """How far into the order (of ``order_length`` samples) an epoch is after ``batches`` of
    its batches (the count of every rank; ranks under DDP agree on it)."""
    trained = max(0, batches - segment.first_batch) * batch_size * segment.world
    return min(order_length, segment.start + trained)


def cut(length: int, world: int, drop_last: bool) -> int:
    """How many positions a sampler of ``world`` ranks hands out for an order of ``length``:
    padded up to a multiple of ``world``, or truncated down to one with ``drop_last``."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if drop_last:
        return (length // world) * world
    return math.ceil(length / world) * world


def split(rest: Sequence[int], world: int, rank: int, drop_last: bool) -> list[int]:
    """``rank``'s share of ``rest`` over ``world`` ranks, cut as ``DistributedSampler`` cuts its
    order: padded with ``rest``'s own first samples (or truncated), then interleaved."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    total = cut(len(rest), world, drop_last)
    items = list(rest)
    if total > len(items):
        pad = total - len(items)
        items += (items * math.ceil(pad / len(items)))[:pad]
    else:
        items = items[:total]
    return items[rank:total:world]


@dataclass(frozen=True)
class Resumed:
    """The account of one interrupted epoch resumed on ``new_world`` ranks."""

    old_world: int
    new_world: int
    length: int  # the order's samples
    done: int  # trained before the interruption (a prefix of the order)
    per_rank: int  # the largest share of the rest on one rank
    repeated: int  # padding: samples of the rest trained twice
    left_out: int  # drop_last: samples of the rest not trained

    @property
    def rest(self) -> int:
        return self.length - self.done


def resume(
    order: EpochOrder, segment: Segment, batches: int, batch_size: int, world: int
) -> tuple[list[int], Resumed]:
    """The rest of ``order`` after ``batches`` batches, and the account of its cut over ``world``
    ranks (the shares themselves: :func:`split` of the returned rest)."""
    indices = order.indices()
    done = position(len(indices), segment, batches, batch_size)
    rest = indices[done:]
    total = cut(len(rest), world, order.drop_last)
    return rest, Resumed(
        old_world=segment.world,
        new_world=world,
        length=len(indices),
        done=done,
        per_rank=total // world,
        repeated=max(0, total - len(rest)),
        left_out=max(0, len(rest) - total),
    )


def account(
    *,
    who: str,
    unit: str,
    splitter: str,
    old: int,
    new: int,
    where: str,
    resumed: Resumed | None,
    batch_size: int,
    data_note: str,
    steps_note: str | None = None,
) -> str:
    """The one message of a resume on another number of ranks (``unit``: "rank" or "process";
    ``splitter``: what splits an epoch in this adapter): the worlds, what of the epoch was done,
    what runs, what is not bit-exact."""
    some = "process(es)" if unit == "process" else f"{unit}(s)"
    parts = [f"{who}: resuming on {new} {some} a checkpoint saved by {old} ({where})"]
    if resumed is not None:
        text = (
            f"{resumed.done} of the epoch's {resumed.length} samples were trained; the other "
            f"{resumed.rest} are split over the {new} {some} as {splitter} splits an epoch "
            f"({resumed.per_rank} per {unit}, batches of {batch_size}), each trained once"
        )
        if resumed.repeated:
            text += f" but {resumed.repeated} trained a second time to even out the {some}"
        if resumed.left_out:
            text += f" but {resumed.left_out} left out (drop_last)"
        parts.append(text)
    parts.append(data_note)
    if steps_note:
        parts.append(steps_note)
    parts.append(
        f"not bit-exact: {unit} r takes the random state of saved {unit} r mod {old}, and the "
        f"global batch changes by {new}/{old}, so the optimisation differs from an uninterrupted "
        "run"
    )
    return "; ".join(p for p in parts if p) + "."
