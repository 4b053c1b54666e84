"""One training run's memory tier, whatever the framework: every process makes one
:class:`MemorySteps` at once; the adapter hands it a step's checkpoint to take
(:meth:`MemorySteps.take`) and asks it for the step to resume from (:meth:`MemorySteps.resume`).

It joins the pieces under it: the tier on this node (:mod:`.memory_tier`), the replication to
the next nodes over a gloo group (:mod:`.memory_replica`) and the agreement on the step every
rank can restore (:mod:`.memory_agree`). The adapters build the checkpoint and put it back;
this module neither knows nor imports a framework.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lightning_incremental.core import ConfigError
from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.runtime import collectives
from lightning_incremental.runtime.memory_agree import Inventory, agree
from lightning_incremental.runtime.memory_replica import Replicator, fetch_plan
from lightning_incremental.runtime.memory_tier import MemoryTier, default_dir

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 120.0  # one transfer of the side group; then replication stops, warned


@dataclass(frozen=True)
class MemoryOptions:
    """The ``memory_*`` arguments of an adapter, checked (``every_name``: how the adapter
    spells the interval, for its errors)."""

    every_n_train_steps: int | None = None
    replicas: int = 1
    directory: str | None = None
    every_name: str = field(default="memory_every_n_train_steps", compare=False)

    def __post_init__(self) -> None:
        n = self.every_n_train_steps
        if n is not None and (type(n) is not int or n < 1):
            raise ConfigError(f"{self.every_name} must be None or >= 1, got {n!r}")
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


Say = Callable[[str], None]


class MemorySteps:
    """One run's memory tier. Create on every process at once (with more than one, it makes a
    gloo group and gathers the generation).

    Args:
        options: the checked ``memory_*`` arguments (enabled).
        rank, world_size: this process in the job.
        ranks_per_node: processes per node (a replica goes to the same local rank of the next
            nodes).
        url: the persistent store's location (the job the parts belong to).
        generation: the store's fencing generation; None (a single process): one newer than
            any this node's memory holds.
        owner: names the adapter in messages.
        info, warn: say a line once for the job (the adapter's rank-zero logging and warning).
    """

    def __init__(
        self,
        options: MemoryOptions,
        *,
        rank: int,
        world_size: int,
        ranks_per_node: int,
        url: str,
        generation: int | None,
        allow_pickle: bool,
        owner: str,
        info: Say,
        warn: Say,
    ) -> None:
        self.every = int(options.every_n_train_steps or 1)
        self.owner, self.info, self.warn = owner, info, warn
        self.job = job_of(url)
        self.rank, self.world = rank, world_size
        directory = Path(options.directory) if options.directory else default_dir()
        self.tier = MemoryTier(
            directory, job=self.job, generation=0, world_size=world_size, allow_pickle=allow_pickle
        )
        held = [h.generation for h in self.tier.inventory() if h.job == self.job]
        # single process: no store generation; every run is newer than what its memory holds
        mine = generation if generation is not None else max(held, default=0) + 1
        self.tier.generation = max(collectives.gather(mine)) if world_size > 1 else mine
        self.group = None
        if world_size > 1:
            self.group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S)
            )
        per_node = max(1, int(ranks_per_node))
        self.pool = BufferPool()  # one snapshot's buffers, reused step after step
        self.replicator = Replicator(
            self.tier,
            rank=rank,
            world_size=world_size,
            ranks_per_node=per_node,
            replicas=options.replicas,
            group=self.group,
            pool=self.pool,
        )
        self.last_step: int | None = None  # the newest step this process took
        nodes = max(1, world_size // per_node)
        if world_size > 1 and options.replicas > nodes - 1:
            warn(
                f"{owner}: memory_replicas={options.replicas}, but the job has "
                f"{nodes} node(s): each memory step is held by {nodes} node(s)"
            )

    def due(self, step: int) -> bool:
        """Whether ``step`` falls on the memory tier's interval."""
        return step > 0 and step % self.every == 0

    def take(self, step: int, checkpoint: Any) -> None:
        """Copy ``checkpoint`` (this rank's part of ``step``) now, into the file in the node's
        memory that becomes its part (host buffers on a process's first step); it is hashed,
        made visible and replicated in the background."""
        self.replicator.wait()  # the previous step's slot (or buffers) free again: reused
        snap = self.tier.snapshot(checkpoint, self.rank, pool=self.pool)
        self.replicator.submit(step, snap)
        self.last_step = step

    def resume(
        self, newest_persistent: int | None, check: Callable[[Any, int], None]
    ) -> tuple[int, Any, str] | None:
        """Every process together: ``(step, checkpoint, tier)`` from the memory tier (tier
        ``"memory"`` or ``"peer"``), or None for the store (after saying why). ``check(
        checkpoint, step)`` raises when the restored part does not hold ``step``; any rank's
        failure sends every rank to the store."""
        world = self.world
        inventory = Inventory(self.rank, tuple(self.tier.inventory()))
        plan = agree(
            collectives.gather(inventory) if world > 1 else [inventory],
            job=self.job,
            world_size=world,
            generation=self.tier.generation,
            newest_persistent=newest_persistent,
        )
        if plan.step is None:
            self.info(f"{self.owner}: memory tier not used: {plan.reason}")
            return None
        checkpoint, error = None, None
        try:
            received = fetch_plan(plan, self.tier, self.rank, self.group) if world > 1 else None
            if received is not None:
                checkpoint = self.tier.restore(received)
            else:  # this node's copy: read into the tensors, hashed on the way (one pass)
                checkpoint = self.tier.load(self.rank, plan.step, plan.generation)
            check(checkpoint, plan.step)
        except Exception as exc:  # every rank learns below; all resume from the store
            error = exc
        failed = collectives.any_true(error is not None) if world > 1 else error is not None
        if failed:
            where = f"rank {self.rank}: {error!r}" if error is not None else "another rank"
            self.warn(
                f"{self.owner}: memory step {plan.step} could not be restored "
                f"({where}); resuming from the persistent store"
            )
            if error is not None and self.rank != 0:
                log.warning("memory step %s unusable here: %r", plan.step, error)
            return None
        return plan.step, checkpoint, plan.tier_used

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for this rank's memory step in flight (written and replicated)."""
        return self.replicator.wait(timeout)

    def finish(self) -> None:
        """Training ended and the store holds its last step: delete this rank's parts (its own
        and the replicas it keeps) from the node's memory."""
        self.replicator.close()
        self.tier.prune([self.rank, *self.replicator.srcs], keep=set(), recycle=False)
        self.tier.release()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the background work; then the gloo group goes too (left to the interpreter's
        exit, gloo's threads can abort a finished process), unless a transfer still uses it."""
        stopped = self.replicator.close(timeout)
        if stopped:  # the spare slots go; the parts stay for a resume
            self.tier.release()
        group, self.group = self.group, None
        if stopped and group is not None:
            torch.distributed.destroy_process_group(group)  # this process's handle only


def how(tier: str) -> str:
    """The words for where a memory step came from, in the resume line."""
    return "own node's memory" if tier != "peer" else "memory, some parts from peers"
