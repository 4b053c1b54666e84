"""The memory tier under :class:`~.callback.IncrementalCheckpoint`: every
``memory_every_n_train_steps`` optimizer steps each rank puts its part of the checkpoint — what a
persistent save of that step would hold — into node-local memory and, in the background, onto
``memory_replicas`` other nodes (:mod:`lightning_incremental.runtime.memory_replica`); a
restarted job resumes from the newest step every rank agrees on
(:mod:`lightning_incremental.runtime.memory_agree`), else from the persistent store.

A memory step is taken after a training batch, where a persistent save of the same step
would be; a step whose batch ends an epoch or is followed by validation is not taken (the
previous memory step stays). Sharded strategies keep the persistent store only.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_incremental.core import ConfigError
from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.lightning import compat as _compat
from lightning_incremental.lightning import resume
from lightning_incremental.lightning.resume import FORMAT, KEY
from lightning_incremental.runtime import collectives
from lightning_incremental.runtime.memory_agree import Inventory, agree
from lightning_incremental.runtime.memory_replica import Replicator, fetch_plan
from lightning_incremental.runtime.memory_tier import MemoryTier, default_dir, snapshot

log = logging.getLogger("lightning_incremental.lightning.callback")

GROUP_TIMEOUT_S = 120.0  # one transfer of the side group; then replication stops, warned


@dataclass(frozen=True)
class MemoryOptions:
    """The callback's ``memory_*`` arguments, checked."""

    every_n_train_steps: int | None = None
    replicas: int = 1
    directory: str | None = None

    def __post_init__(self) -> None:
        n = self.every_n_train_steps
        if n is not None and (type(n) is not int or n < 1):
            raise ConfigError(f"memory_every_n_train_steps must be None or >= 1, got {n!r}")
        if type(self.replicas) is not int or self.replicas < 0:
            raise ConfigError(f"memory_replicas must be an int >= 0, got {self.replicas!r}")
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(f"memory_dir must be a path, got {type(self.directory).__name__}")

    @property
    def enabled(self) -> bool:
        return self.every_n_train_steps is not None


def job_of(url: str) -> str:
    """The job a memory part belongs to: its persistent store's location."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


class MemorySteps:
    """One ``fit``'s memory tier. Create on every rank at once (it makes a gloo group)."""

    def __init__(
        self,
        options: MemoryOptions,
        trainer: pl.Trainer,
        url: str,
        generation: int | None,
        *,
        allow_pickle: bool,
    ) -> None:
        self.every = int(options.every_n_train_steps or 1)
        world = trainer.world_size
        self.job = job_of(url)
        directory = Path(options.directory) if options.directory else default_dir()
        self.tier = MemoryTier(
            directory, job=self.job, generation=0, world_size=world, allow_pickle=allow_pickle
        )
        self.rank = trainer.global_rank
        held = [h.generation for h in self.tier.inventory() if h.job == self.job]
        # single process: no store generation; every run is newer than what its memory holds
        mine = generation if generation is not None else max(held, default=0) + 1
        self.tier.generation = max(collectives.gather(mine)) if world > 1 else mine
        self.group = None
        if world > 1:
            self.group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S)
            )
        per_node = max(1, int(trainer.num_devices))
        self.pool = BufferPool()  # one snapshot's buffers, reused step after step
        self.replicator = Replicator(
            self.tier,
            rank=self.rank,
            world_size=world,
            ranks_per_node=per_node,
            replicas=options.replicas,
            group=self.group,
            pool=self.pool,
        )
        nodes = max(1, world // per_node)
        if world > 1 and options.replicas > nodes - 1:
            rank_zero_warn(
                f"IncrementalCheckpoint: memory_replicas={options.replicas}, but the job has "
                f"{nodes} node(s): each memory step is held by {nodes} node(s)"
            )

    def after_batch(self, trainer: pl.Trainer, step_changed: bool, epoch_record: Any) -> None:
        """Take this step into memory when it is due and a resume could continue from it."""
        step = trainer.global_step
        if not step_changed or step % self.every:
            return
        if _compat.epoch_ends_here(trainer) or _compat.validation_follows(trainer):
            return
        checkpoint = _compat.dump_checkpoint(trainer)
        own = resume.rank_state(trainer, False, epoch_record)
        checkpoint[KEY] = {"format": FORMAT, "world_size": trainer.world_size, "ranks": [own]}
        self.replicator.wait()  # the previous step's buffers back in the pool: one set, reused
        snap = snapshot(checkpoint, allow_pickle=self.tier.allow_pickle, pool=self.pool)
        self.replicator.submit(step, snap)

    def resume(self, trainer: pl.Trainer, newest_persistent: int | None) -> Any:
        """Every rank together: ``(step, checkpoint)`` from the memory tier, or None for the store
        (after saying why)."""
        world = trainer.world_size
        inventory = Inventory(self.rank, tuple(self.tier.inventory()))
        plan = agree(
            collectives.gather(inventory) if world > 1 else [inventory],
            job=self.job,
            world_size=world,
            generation=self.tier.generation,
            newest_persistent=newest_persistent,
        )
        if plan.step is None:
            rank_zero_info(f"IncrementalCheckpoint: memory tier not used: {plan.reason}")
            return None
        checkpoint, error = None, None
        try:
            received = fetch_plan(plan, self.tier, self.rank, self.group) if world > 1 else None
            part = received or self.tier.part(self.rank, plan.step, plan.generation)
            checkpoint = self.tier.restore(part)
            if checkpoint.get("global_step") != plan.step:
                raise ValueError(f"global_step {checkpoint.get('global_step')!r} in the part")
        except Exception as exc:  # every rank learns below; all resume from the store
            error = exc
        failed = collectives.any_true(error is not None) if world > 1 else error is not None
        if failed:
            where = f"rank {self.rank}: {error!r}" if error is not None else "another rank"
            rank_zero_warn(
                f"IncrementalCheckpoint: memory step {plan.step} could not be restored "
                f"({where}); resuming from the persistent store"
            )
            if error is not None and not trainer.is_global_zero:
                log.warning("memory step %s unusable here: %r", plan.step, error)
            return None
        assert checkpoint is not None
        saved = checkpoint[KEY]
        saved["ranks"] = saved["ranks"] * world  # this rank's own state, read at its index
        how = "own node's memory" if plan.tier_used != "peer" else "memory, some parts from peers"
        rank_zero_info(
            f"IncrementalCheckpoint: resuming from step {plan.step} (epoch "
            f"{checkpoint.get('epoch')}) of the memory tier ({how}); tier={plan.tier_used}"
        )
        return plan.step, checkpoint, plan.tier_used

    def finish(self) -> None:
        """Training ended and the store holds its last step: delete this rank's parts (its own
        and the replicas it keeps) from the node's memory."""
        self.replicator.close()
        self.tier.prune([self.rank, *self.replicator.srcs], keep=set())

    def close(self, timeout: float = 60.0) -> None:
        """Stop the background work; then the gloo group goes too (left to the interpreter's
        exit, gloo's threads can abort a finished process), unless a transfer still uses it."""
        stopped = self.replicator.close(timeout)
        group, self.group = self.group, None
        if stopped and group is not None:
            torch.distributed.destroy_process_group(group)  # this process's handle only


def start(
    options: MemoryOptions,
    trainer: pl.Trainer,
    url: str,
    generation: int | None,
    *,
    sharded: bool,
    allow_pickle: bool,
) -> MemorySteps | None:
    """The fit's memory tier, or None when it is off (or the strategy shards the state)."""
    if not options.enabled:
        return None
    if sharded:
        rank_zero_warn(
            "IncrementalCheckpoint: the memory tier does not support sharded strategies yet; "
            "this run checkpoints to the persistent store only"
        )
        return None
    return MemorySteps(options, trainer, url, generation, allow_pickle=allow_pickle)
