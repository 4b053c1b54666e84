"""The memory tier under :class:`~.callback.IncrementalCheckpoint`: every
``memory_every_n_train_steps`` optimizer steps each rank puts its part of the checkpoint — what a
persistent save of that step would hold — into node-local memory and, in the background, onto
``memory_replicas`` other nodes (:mod:`lightning_incremental.runtime.memory.replica`); a
restarted job resumes from the newest step every rank agrees on
(:mod:`lightning_incremental.runtime.memory.agree`), else from the persistent store. The
framework-free part is :mod:`lightning_incremental.runtime.memory.steps`; this module builds
Lightning's checkpoint of a step and puts a restored one back.

A memory step is taken after a training batch, where a persistent save of the same step
would be; a step whose batch ends an epoch or is followed by validation is not taken (the
previous memory step stays). Under ``ModelParallelStrategy`` (FSDP2, tensor parallel) each rank
keeps its own shards (:mod:`lightning_incremental.runtime.memory.shards`); a resume on another
mesh falls back to the store, which reshards. ``FSDPStrategy`` (FSDP1) keeps the persistent
store only.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import memory_model_checkpoints, resume
from lightning_incremental.lightning import sharded as _sharded
from lightning_incremental.lightning.resume import FORMAT, KEY
from lightning_incremental.runtime.memory import shards as memory_shards
from lightning_incremental.runtime.memory import steps as memory_steps
from lightning_incremental.runtime.memory.steps import MemoryOptions, job_of

__all__ = ["MemoryOptions", "MemorySteps", "job_of", "start"]

log = logging.getLogger("lightning_incremental.lightning.callback")


class MemorySteps(memory_steps.MemorySteps):
    """One ``fit``'s memory tier. Create on every rank at once (it makes a gloo group)."""

    def __init__(
        self,
        options: MemoryOptions,
        trainer: pl.Trainer,
        url: str,
        generation: int | None,
        *,
        sharded: bool = False,
        allow_pickle: bool,
    ) -> None:
        self.sharded = sharded
        super().__init__(
            options,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            ranks_per_node=int(trainer.num_devices),
            url=url,
            generation=generation,
            allow_pickle=allow_pickle,
            owner="IncrementalCheckpoint",
            info=rank_zero_info,
            warn=rank_zero_warn,
            replicated=not sharded,
            sharded=sharded,
            local_rank=trainer.local_rank,
        )
        self.zero: bool | None = None  # an optimizer is torch's ZeroRedundancyOptimizer

    def after_batch(self, trainer: pl.Trainer, step_changed: bool, epoch_record: Any) -> None:
        """Take this step into memory when it is due and a resume could continue from it."""
        step = trainer.global_step
        if not step_changed or not self.due(step):
            return
        if _compat.epoch_ends_here(trainer) or _compat.validation_follows(trainer):
            return
        if self._refused(trainer):
            return
        # every rank dumps, as for Trainer.save_checkpoint (a save hook may be a collective)
        checkpoint = _sharded.dump_checkpoint(trainer, self.sharded)
        if not self.whole:  # the node's first rank takes the replicated state (memory_steps)
            for name in _STATE_KEYS:  # (a rank's own buffers are in its rank state, if any)
                del checkpoint[name]
        own = resume.rank_state(trainer, False, epoch_record)
        checkpoint[KEY] = {"format": FORMAT, "world_size": trainer.world_size, "ranks": [own]}
        if self.sharded:  # this rank's shards as plain tensors, and how they were laid out
            for name in _STATE_KEYS:
                checkpoint[name], notes = memory_shards.to_local(checkpoint[name], (name,))
                checkpoint[KEY].setdefault("shards", {}).update(notes)
        self.take(step, checkpoint)

    def _refused(self, trainer: pl.Trainer) -> bool:
        """Whether an optimizer is a ``ZeroRedundancyOptimizer`` (said once): its state is
        sharded over the ranks and consolidated on rank 0 only when a checkpoint is dumped, so
        no rank's memory part could restore it; such a run keeps the store only."""
        if self.zero is None:
            self.zero = any(
                hasattr(_compat.raw_optimizer(o), "consolidate_state_dict")
                for o in trainer.optimizers
            )
            if self.zero:
                rank_zero_warn(
                    "IncrementalCheckpoint: the memory tier does not support "
                    "ZeroRedundancyOptimizer (its state is consolidated on rank 0 only); this run "
                    "checkpoints to the persistent store only"
                )
        return self.zero

    def resume(  # type: ignore[override]
        self, trainer: pl.Trainer, newest_persistent: int | None
    ) -> tuple[int, Any, str] | None:
        """Every rank together: ``(step, checkpoint, tier)`` from the memory tier, or None for
        the store (after saying why)."""
        check, live = _check_step, None
        if self.sharded:  # the live shards to fill (every rank: FSDP may create optimizer state)
            live = _sharded.live_state(trainer)
            check = partial(_check_shards, live)
        found = super().resume(newest_persistent, check, _merge)
        if found is None:
            return None
        step, checkpoint, tier = found
        if live is not None:  # the live shards filled, in their places; the rest as restored
            memory_shards.fill(live, checkpoint)
            _sharded.apply(trainer, checkpoint)
        saved = checkpoint[KEY]
        saved["ranks"] = saved["ranks"] * trainer.world_size  # this rank's own, at its index
        memory_model_checkpoints.drop_unsaved(trainer, checkpoint)
        rank_zero_info(
            f"IncrementalCheckpoint: resuming from step {step} (epoch "
            f"{checkpoint.get('epoch')}) of the memory tier ({memory_steps.how(tier)}); "
            f"tier={tier}"
        )
        return step, checkpoint, tier


# the weights and optimizer state: DTensors when sharded; when replicated, only a node's first
# rank takes them
_STATE_KEYS = ("state_dict", "optimizer_states")


def _merge(whole: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """This rank's checkpoint: its own (loops, callbacks, schedulers, random state and data
    position; its buffers, where DDP does not broadcast them, go back with its rank state), with
    the weights and optimizer state of its node's first rank."""
    for name in _STATE_KEYS:
        own[name] = whole[name]
    return own


def _check_step(checkpoint: Any, step: int) -> None:
    if checkpoint.get("global_step") != step:
        raise ValueError(f"global_step {checkpoint.get('global_step')!r} in the part")


def _check_shards(live: dict[str, Any], checkpoint: Any, step: int) -> None:
    """The part holds ``step`` and a shard for each live DTensor, laid out as now."""
    _check_step(checkpoint, step)
    memory_shards.check(live, checkpoint, checkpoint.get(KEY, {}).get("shards"))


def start(
    options: MemoryOptions,
    trainer: pl.Trainer,
    url: str,
    generation: int | None,
    *,
    sharded: bool,
    allow_pickle: bool,
) -> MemorySteps | None:
    """The fit's memory tier, or None when it is off (or the strategy is FSDP1's)."""
    if not options.enabled:
        return None
    if isinstance(trainer.strategy, FSDPStrategy):
        rank_zero_warn(
            "IncrementalCheckpoint: the memory tier does not support FSDPStrategy (FSDP1's "
            "ShardedTensor state) yet; this run checkpoints to the persistent store only. "
            "ModelParallelStrategy (FSDP2) is supported"
        )
        return None
    return MemorySteps(
        options, trainer, url, generation, sharded=sharded, allow_pickle=allow_pickle
    )
