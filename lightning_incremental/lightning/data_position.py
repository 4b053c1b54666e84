"""Where a Lightning run stands in its training data, and how a resumed run gets back there.

Lightning restores a stateful dataloader (``state_dict``/``load_state_dict``, e.g. torchdata's
``StatefulDataLoader``) to its position, but restarts a plain ``DataLoader``'s interrupted epoch
from its first batch — with a different order when the sampler draws from a random state. This
module makes a plain loader's resumed epoch the same epoch:

* At the start of every epoch (``record_epoch_start``) it records what the epoch's order depends
  on: the global torch random state and the state of every ``torch.Generator`` reachable from the
  loaders (``DataLoader(generator=...)``, ``RandomSampler(generator=...)``, a wrapped sampler's),
  and whether the epoch's iterator already existed then (Lightning creates the first epoch's
  iterator before ``on_train_epoch_start``, the later ones after it).
* On resume (``replay``) it sets the sampler epoch (``DistributedSampler.set_epoch``), puts those
  random states back, recreates the epoch iterator exactly as the original run did, and skips the
  batches already trained on: by advancing the sampler alone for a map-style dataset read in the
  main process (no data is loaded), by re-reading them otherwise (worker processes, iterable
  datasets), which keeps worker processes' random streams aligned too.

Everything returned is plain data, for checkpoints. The functions read a few private attributes of
Lightning's fit loop (its combined loader, data fetcher and epoch iterator): that is where Lightning
keeps the iterator, and no public API exposes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import resize
from lightning_incremental.runtime.state import data_position as position
from lightning_incremental.runtime.state import rng

_FOLLOW = ("sampler", "batch_sampler", "_sampler", "dataset")
_MAX_DEPTH = 4
_SAMPLERS = (Sampler, BatchSampler, _compat.DatasetSamplerWrapper)

# How a resumed epoch reaches its position.
LIGHTNING = "lightning"  # stateful loaders: Lightning restores their position itself
FAST_FORWARD = "fast_forward"  # advance the sampler only, load nothing
REREAD = "reread"  # re-read the consumed batches and drop them
IMPOSSIBLE = "impossible"


@dataclass
class Plan:
    """How the position in an epoch can be restored, and what keeps it from being exact."""

    mode: str
    caveats: list[str] = field(default_factory=list)


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The training dataloaders as Lightning iterates them (after it injected its samplers)."""
    combined = _compat.combined_loader(trainer)
    return list(combined.flattened) if combined is not None else []


def epoch_iterator(trainer: pl.Trainer) -> object | None:
    """The object Lightning iterates this epoch; a new one each time it recreates the iterator."""
    return _compat.combined_iterator(trainer)


def generators(loaders: list[Any]) -> dict[str, torch.Generator]:
    """Every distinct ``torch.Generator`` a loader or its samplers draw from, by attribute path
    (``"0.generator"``, ``"0.sampler.generator"``, ...)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for index, loader in enumerate(loaders):
        found.update(
            position.find_generators(
                loader,
                path=str(index),
                follow=_FOLLOW,
                max_depth=_MAX_DEPTH,
                accept=lambda value: isinstance(value, _SAMPLERS),
                seen=seen,
            )
        )
    return found


def generator_states(loaders: list[Any]) -> dict[str, torch.Tensor]:
    return position.generator_states(generators(loaders))


def set_generator_states(loaders: list[Any], states: dict[str, torch.Tensor]) -> list[str]:
    """Put recorded generator states back; returns the paths that no longer match a generator."""
    return position.set_generator_states(generators(loaders), states)


def generators_changed(paths: list[str]) -> str:
    return (
        "the random generators of the training dataloaders changed since the checkpoint "
        f"(saved and current ones differ at {', '.join(paths)})"
    )


def record_epoch_start(trainer: pl.Trainer, iter_created: bool) -> dict[str, Any]:
    """What this epoch's order of batches depends on (see the module docstring)."""
    torch_state = rng.capture_torch()
    loaders = train_loaders(trainer)
    record: dict[str, Any] = {
        "torch": torch_state.pop("torch"),
        "generators": generator_states(loaders),
        "iter_created": iter_created,
        "data_order": resize.describe(loaders, trainer.world_size),  # for another world size
        **torch_state,  # "cuda", where CUDA is initialised
    }
    return record


def plan(trainer: pl.Trainer) -> Plan:
    """How this trainer's training data can be brought back to a position mid-epoch."""
    loaders = train_loaders(trainer)
    fetcher = _compat.data_fetcher(trainer)
    if isinstance(fetcher, _compat.DataLoaderIterDataFetcher):
        return Plan(
            IMPOSSIBLE,
            ["training_step takes `dataloader_iter`, so the batches it consumed are not known"],
        )
    stateful = [isinstance(dl, _compat.Stateful) for dl in loaders]
    if loaders and all(stateful):
        return Plan(LIGHTNING)
    if any(stateful):
        return Plan(
            IMPOSSIBLE,
            ["some training dataloaders are stateful and others are not: make all of them so"],
        )
    caveats = []
    for index, dl in enumerate(loaders):
        name = f"training dataloader {index}" if len(loaders) > 1 else "the training dataloader"
        if not isinstance(dl, DataLoader):
            caveats.append(
                f"{name} is a {type(dl).__name__}, not a DataLoader: its skipped batches are "
                "re-read, exact only if it yields the same batches when iterated again"
            )
            continue
        if isinstance(dl.dataset, IterableDataset):
            caveats.append(
                f"{name} reads an IterableDataset without state_dict: its skipped batches are "
                "re-read, exact only if its order depends on nothing but the restored random "
                "state (use a stateful dataloader, e.g. torchdata's StatefulDataLoader, to skip "
                "without reading)"
            )
        if dl.num_workers > 0 and dl.persistent_workers:
            caveats.append(
                f"{name} uses persistent_workers=True: its worker processes start afresh, so "
                "random state inside them (augmentations drawn in workers) differs from the "
                "uninterrupted run"
            )
    sized = isinstance(fetcher, _compat.PrefetchDataFetcher) and fetcher.length is not None
    if (
        len(loaders) == 1
        and isinstance(loaders[0], DataLoader)
        and not isinstance(loaders[0].dataset, IterableDataset)
        and loaders[0].num_workers == 0
        and sized
    ):
        return Plan(FAST_FORWARD, caveats)
    return Plan(REREAD, caveats)


def set_sampler_epoch(loaders: list[Any], epoch: int) -> None:
    """``set_epoch`` on every sampler that has it, as Lightning does at each epoch start."""
    for dl in loaders:
        samplers = {id(s): s for s in (getattr(dl, "sampler", None),) if s is not None}
        batch_sampler = getattr(dl, "batch_sampler", None)
        inner = getattr(batch_sampler, "sampler", None)
        if inner is not None:
            samplers[id(inner)] = inner
        for sampler in samplers.values():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)


def replay(
    trainer: pl.Trainer, record: dict[str, Any], batches: int, epoch: int, mode: str
) -> list[str]:
    """Bring the epoch in progress back to where it was after ``batches`` batches: recreate its
    iterator from ``record`` (from :func:`record_epoch_start`) and skip ``batches`` batches.
    Call before the first batch of the resumed run is fetched (``on_train_start``). Returns what
    did not match (generators that disappeared, data that ran out).

    Leaves the global random state as the skipping left it: the caller restores the state of the
    moment the checkpoint was taken afterwards.
    """
    notes = []
    loaders = train_loaders(trainer)
    set_sampler_epoch(loaders, epoch)
    rng.restore_torch(record)
    mismatched = set_generator_states(loaders, record["generators"])
    if mismatched:
        notes.append(generators_changed(mismatched))
    fetcher = _compat.data_fetcher(trainer)
    assert fetcher is not None
    if not record["iter_created"]:
        iter(fetcher)  # the epoch's iterator, created from the same random state as originally
    if batches <= 0:
        return notes
    done = 0
    if mode == FAST_FORWARD:
        done = _compat.skip_sampled_batches(trainer, batches)  # no data is loaded
    else:
        for _ in range(batches):
            try:
                next(fetcher)
            except StopIteration:
                break
            done += 1
        _compat.uncount_fetched(fetcher, done)
    if done < batches:
        notes.append(f"the training data ran out after {done} of the {batches} batches to skip")
    return notes
