"""Resuming a Lightning run on another number of ranks: the rest of the interrupted epoch, each
sample once, and one account of what is and is not as an uninterrupted run.

At every epoch's start :func:`describe` records what the epoch's order of samples is a function of
(see :mod:`lightning_incremental.runtime.state.data_order`): Lightning's ``DistributedSampler``
under DDP, a ``SequentialSampler`` in one process. A resume on another world size (or of an epoch
that a resize already cut anew) computes the rest of that order and gives this rank its share
through :class:`RestOfEpoch`, for the interrupted epoch only; Lightning's batch counters and the
epoch's length are set so that the epoch ends when the shares do. An order that cannot be computed
again (a ``RandomSampler`` in one process, a custom sampler, an ``IterableDataset``) is not
remapped: the account says what Lightning does instead and how to avoid it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_incremental.lightning import compat as _compat
from lightning_incremental.runtime.state import data_order as order_of

UNMAPPED = "unmapped"


class RestOfEpoch(Sampler[int]):
    """This rank's share of an interrupted epoch's rest, handed out once in place of the
    loader's sampler (``batch_sampler.sampler``); :meth:`undo` puts the sampler back."""

    def __init__(self, batch_sampler: BatchSampler, share: list[int], before: int) -> None:
        self.batch_sampler = batch_sampler
        self.original = batch_sampler.sampler
        self.share = share
        self.before = before  # samples this rank's epoch counts as done (batches * batch size)
        batch_sampler.sampler = self

    def __iter__(self) -> Iterator[int]:
        return iter(self.share)

    def __len__(self) -> int:  # the whole epoch's, as Lightning counts its batches
        return self.before + len(self.share)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.original, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def undo(self) -> None:
        if self.batch_sampler.sampler is self:
            self.batch_sampler.sampler = self.original


def batch_sampler(loaders: list[Any]) -> BatchSampler | str:
    """The one training loader's ``BatchSampler``, whose sampler a remap replaces; or why there
    is none to replace."""
    if len(loaders) != 1:
        return f"there are {len(loaders)} training dataloaders"
    loader = loaders[0]
    if not isinstance(loader, DataLoader):
        return f"the training dataloader is a {type(loader).__name__}"
    if isinstance(loader.dataset, IterableDataset):
        return "the training dataloader reads an IterableDataset"
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler:
        return f"the training dataloader's batch sampler is a {type(batches).__name__}"
    return batches


def describe(loaders: list[Any], world: int) -> dict[str, Any]:
    """What this epoch's order is a function of, as plain data for the epoch's record; or
    ``{"unmapped": why}`` when it cannot be computed again."""
    batches = batch_sampler(loaders)
    if isinstance(batches, str):
        return {UNMAPPED: batches}
    sampler = batches.sampler
    if isinstance(sampler, RestOfEpoch):
        sampler = sampler.original
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas != world:
        return {
            UNMAPPED: f"the training DistributedSampler cuts the data into {sampler.num_replicas} "
            f"parts in a run of {world} rank(s)"
        }
    if isinstance(sampler, DistributedSampler) and (
        type(sampler).__iter__ is DistributedSampler.__iter__
    ):
        kind = order_of.PERMUTATION if sampler.shuffle else order_of.SEQUENTIAL
        dataset: Any = sampler.dataset  # sized: DistributedSampler took its len()
        order = order_of.EpochOrder(
            kind, len(dataset), sampler.seed, sampler.epoch, sampler.drop_last
        )
    elif type(sampler) is SequentialSampler and world == 1:
        order = order_of.EpochOrder(order_of.SEQUENTIAL, len(sampler.data_source))
    else:
        why = f"its sampler is a {type(sampler).__name__}"
        if type(sampler) is RandomSampler:
            why += " (drawn from the random state of one process)"
        return {UNMAPPED: f"the order of the training data cannot be computed again: {why}"}
    return {
        "order": order.to_dict(),
        "segment": order_of.Segment(0, world, 0).to_dict(),
        "batch_size": batches.batch_size,
        "drop_last": batches.drop_last,
    }


def needs_remap(record: dict[str, Any] | None, world: int) -> bool:
    """Whether resuming ``record``'s epoch on ``world`` ranks needs the rest cut anew: the world
    changed, or the epoch was already cut anew by an earlier resize."""
    described = (record or {}).get("data_order") or {}
    if "segment" not in described:
        return False
    segment = order_of.Segment.from_dict(described["segment"])
    return segment.world != world or segment.start > 0


@dataclass
class Remap:
    """A remapped epoch in progress: undone when the next epoch starts."""

    trainer: pl.Trainer
    epoch: int  # the remapped epoch
    sampler: RestOfEpoch
    epoch_length: tuple[int | float, Any, Any]  # Lightning's own (see compat), put back after

    def undo(self) -> None:
        self.sampler.undo()
        _compat.set_epoch_length(self.trainer, *self.epoch_length)


def remap(
    trainer: pl.Trainer, loaders: list[Any], described: dict[str, Any], batches: int
) -> tuple[Remap, dict[str, Any], order_of.Resumed] | str:
    """Give this rank its share of the rest of the epoch described by ``described`` (from
    :func:`describe`, in the saved epoch record) after ``batches`` batches, and recreate the
    epoch's iterator over it. ``loaders``: the training dataloaders as Lightning iterates them.
    Returns the remap, the epoch's new description (for the next checkpoints) and the account;
    or why it cannot be done."""
    if UNMAPPED in described:
        return str(described[UNMAPPED])
    live = batch_sampler(loaders)  # its own sampler does not matter: the share replaces it
    if isinstance(live, str):
        return live
    if trainer.limit_train_batches not in (1.0, None):
        return "limit_train_batches is set"
    batch_size = int(described["batch_size"])
    if live.batch_size != batch_size:
        return f"the batch size changed from {batch_size} to {live.batch_size}"
    order = order_of.EpochOrder.from_dict(described["order"])
    segment = order_of.Segment.from_dict(described["segment"])
    world, rank = trainer.world_size, trainer.global_rank
    rest, account = order_of.resume(order, segment, batches, batch_size, world)
    share = order_of.split(rest, world, rank, order.drop_last)
    sampler = RestOfEpoch(live, share, batches * batch_size)
    length = _compat.epoch_length(trainer)
    remapped = Remap(trainer, trainer.current_epoch, sampler, length)
    rounded = math.floor if live.drop_last else math.ceil
    total = batches + rounded(len(share) / batch_size)
    # validation at the epoch's end (val_check_interval=1.0) stays at the epoch's end
    at_end = total if length[1] == length[0] else length[1]
    _compat.set_epoch_length(trainer, total, at_end, [total])
    fetcher = _compat.data_fetcher(trainer)
    assert fetcher is not None
    iter(fetcher)  # the epoch's iterator, over the share; its length counts the done batches too
    new = dict(described, segment=order_of.Segment(account.done, world, batches).to_dict())
    return remapped, new, account


def rescale_max_steps(trainer: pl.Trainer, old_world: int) -> str | None:
    """Keep ``max_steps`` meaning the same number of samples when the global batch changes with
    the world size: the steps left are scaled by old/new world. Returns what was done."""
    loop = trainer.fit_loop.epoch_loop
    max_steps, step, world = loop.max_steps, trainer.global_step, trainer.world_size
    if max_steps is None or max_steps < 0 or step >= max_steps or old_world == world:
        return None
    left = math.ceil((max_steps - step) * old_world / world)
    loop.max_steps = step + left
    return (
        f"max_steps={max_steps} counts steps of the old global batch: the {max_steps - step} "
        f"steps left are {left} steps of the new one (max_steps={step + left} for this run), "
        "the same samples; a learning-rate schedule sized by max_steps ends at its own length"
    )


def account(**parts: Any) -> str:
    """The account of a resize (see
    :func:`~lightning_incremental.runtime.state.data_order.account`)."""
    return order_of.account(
        who="IncrementalCheckpoint", unit="rank", splitter="a DistributedSampler", **parts
    )
