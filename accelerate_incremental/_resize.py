"""Resuming an Accelerate run on another number of processes: the rest of the interrupted epoch,
each sample once (see :mod:`lightning_incremental.runtime.state.data_order` for why it can be).

A prepared DataLoader (``DataLoaderShard``) hands its processes whole batches of one base
``BatchSampler`` in turn (``BatchSamplerShard``: batch ``i`` to process ``i mod W``; one process:
the base sampler itself). So after ``k`` batches on each of ``W`` processes the epoch has trained
the first ``W*k`` base batches, whatever ``W`` is. The base order is a function of the random
state at the epoch's start — the sampler's generator (Accelerate's synchronized generator, the
main process's state) or, without one, the global torch state — which every position records
(:mod:`~._position`). :func:`base_batches` draws that order again with torch's own
``RandomSampler`` and ``DataLoader`` from the recorded states (over the indices: no data is
loaded), and :func:`plan` hands this process its share of the rest, cut by Accelerate's own
``BatchSamplerShard`` (so ``even_batches`` pads as Accelerate pads). A resumed epoch keeps its
rest (``rest``, a tensor of sample indices) and a :class:`~lightning_incremental.runtime.
data_order.Segment`, so that a second interruption in it resumes from them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_incremental.runtime.state import data_order as order_of

WHO = "accelerate_incremental"


class FixedBatches:
    """A batch sampler that hands out the given batches of sample indices, once per epoch."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@dataclass(frozen=True)
class Layout:
    """What a prepared DataLoader's batches are cut from."""

    base: BatchSampler  # the batch sampler of the whole dataset
    even_batches: bool


def layout(loader: Any) -> Layout | str:
    """The base batch sampler of a prepared DataLoader, or why its epoch cannot be cut anew."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher

    if isinstance(loader, DataLoaderDispatcher):  # slices each batch of the main process's
        return "the DataLoader dispatches batches from the main process (dispatch_batches=True)"
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return "the DataLoader reads an IterableDataset"
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, BatchSamplerShard):
        if sampler.split_batches:
            return "the DataLoader splits batches across processes (split_batches=True)"
        base, even = sampler.batch_sampler, sampler.even_batches
    else:
        base, even = sampler, True
    if type(base) is not BatchSampler or base.batch_size is None:
        return f"the DataLoader's batch sampler is a {type(base).__name__}"
    return Layout(base, even)


def base_batches(
    loader: Any, layout_: Layout, torch_state: torch.Tensor, generators: dict[str, torch.Tensor]
) -> list[list[int]] | str:
    """The epoch's base batches as the saved run drew them, from the random states recorded at
    the epoch's start (``torch_state``, ``generators`` by path: the main process's); or why
    they cannot be drawn again. Leaves the global torch state as it found it."""
    base = layout_.base
    sampler = base.sampler
    n = len(sampler)  # type: ignore[arg-type]
    if type(sampler) is SequentialSampler:
        indices = list(range(n))
        return [indices[i : i + base.batch_size] for i in range(0, n, base.batch_size)][: len(base)]
    if type(sampler) is not RandomSampler or sampler.replacement or sampler.num_samples != n:
        return f"its sampler is a {type(sampler).__name__}, whose order cannot be drawn again"
    saved = generators.get("synchronized_generator", generators.get("generator"))
    generator = None
    if saved is not None:
        generator = torch.Generator()
        generator.set_state(saved.cpu())
    shares = getattr(loader, "generator", None) is not None and loader.generator is getattr(
        sampler, "generator", None
    )  # then the DataLoader draws its workers' seed from the sampler's generator first
    replay: DataLoader[Any] = DataLoader(
        range(n),  # type: ignore[arg-type]
        batch_sampler=BatchSampler(
            RandomSampler(range(n), generator=generator), base.batch_size, base.drop_last
        ),
        generator=generator if shares else None,
    )
    before = torch.get_rng_state()
    try:
        torch.set_rng_state(torch_state.cpu())
        # draws as the saved run's iterator drew; its "samples" are the indices themselves
        return [batch.tolist() for batch in replay]
    finally:
        torch.set_rng_state(before)


@dataclass(frozen=True)
class Plan:
    """This process's share of an interrupted epoch's rest, and what to record about it."""

    batches: list[list[int]]
    rest: torch.Tensor  # the rest, for the next checkpoints of this epoch
    segment: order_of.Segment
    batch_size: int
    account: order_of.Resumed


def plan(
    layout_: Layout,
    rest: list[int],
    *,
    consumed_before: int,
    world: int,
    rank: int,
    old_world: int,
    done_before: int,
    length: int,
) -> Plan:
    """Cut ``rest`` (the samples of the epoch not trained yet, in order) over ``world``
    processes as Accelerate cuts an epoch, for process ``rank``; ``consumed_before``: the batches
    per process the epoch counts as done; ``done_before`` of its ``length`` samples are."""
    from accelerate.data_loader import BatchSamplerShard

    base = layout_.base
    rebatched = BatchSampler(rest, base.batch_size, base.drop_last)
    if world == 1:
        mine = [list(b) for b in rebatched]
        per_process = [mine]
    else:
        per_process = [
            [
                list(b)
                for b in BatchSamplerShard(
                    rebatched,
                    num_processes=world,
                    process_index=p,
                    even_batches=layout_.even_batches,
                )
            ]
            for p in range(world)
        ]
        mine = per_process[rank]
    handed = sum(len(b) for batches in per_process for b in batches)
    resumed = order_of.Resumed(
        old_world=old_world,
        new_world=world,
        length=length,
        done=done_before,
        per_rank=max(sum(len(b) for b in batches) for batches in per_process),
        repeated=max(0, handed - len(rest)),
        left_out=max(0, len(rest) - handed),
    )
    return Plan(
        batches=mine,
        rest=torch.tensor(rest, dtype=torch.int64),
        segment=order_of.Segment(0, world, consumed_before),
        batch_size=base.batch_size,
        account=resumed,
    )


def rest_of(
    loader: Any, layout_: Layout, saved: dict[str, Any], old_world: int
) -> tuple[list[int], int, int] | str:
    """The samples of the saved epoch not trained yet (in order), how many were, and the
    epoch's length; ``saved``: the main process's saved position (see :mod:`~._position`).
    An epoch already cut anew carries its rest; otherwise its base order is drawn again."""
    consumed = int(saved["consumed"])
    if "rest" in saved:  # a resumed epoch, interrupted again
        rest = saved["rest"].tolist()
        segment = order_of.Segment.from_dict(saved["segment"])
        at = order_of.position(len(rest), segment, consumed, int(saved["batch_size"]))
        done = int(saved["done"]) + at
        return rest[at:], done, done + len(rest) - at
    drawn = base_batches(loader, layout_, saved["torch"], saved["generators"])
    if isinstance(drawn, str):
        return drawn
    done_batches = drawn[: old_world * consumed]
    done = sum(len(b) for b in done_batches)
    rest = [i for b in drawn[old_world * consumed :] for i in b]
    return rest, done, done + len(rest)


def needed(processes: list[dict[str, Any]], world: int) -> bool:
    """Whether positions saved by ``processes`` need cutting anew for ``world`` processes: the
    number changed, or an epoch was already cut anew (it continues from its recorded rest)."""
    return len(processes) != world or any("rest" in p for p in processes[0]["loaders"])


def account(**parts: Any) -> str:
    return order_of.account(
        who=WHO, unit="process", splitter="Accelerate's sharded batch sampler", **parts
    )
