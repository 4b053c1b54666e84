"""One training run's memory tier, whatever the framework: every process makes one
:class:`MemorySteps` at once; the adapter hands it a step's checkpoint to take
(:meth:`MemorySteps.take`) and asks it for the step to resume from (:meth:`MemorySteps.resume`).

It joins the pieces under it: the tier on this node (:mod:`.tier`), the replication to
the next nodes over a gloo group (:mod:`.replica`) and the agreement on the step every
rank can restore (:mod:`.agree`). The adapters build the checkpoint and put it back;
this module neither knows nor imports a framework.

One copy of replicated state a node
-----------------------------------
Under DDP every rank holds the same weights and optimizer state; only its random state and data
position are its own. With ``replicated=True`` and several ranks a node, only the first rank of
each node (its *leader*) takes the whole checkpoint; the others take their own state alone
(:attr:`MemorySteps.whole` tells the adapter which). A node's memory then holds the state once,
and so does each replica, not once a rank: 8 ranks a node, 1/8 of the memory and of the bytes
sent. Every part still counts for the agreement (a step needs every rank's); the parts carry
the layout (the ranks a node), so a step written with another number of ranks a node is
ignored. A resume gives each other rank its leader's part besides its own, read from the
node's memory, or — when the node's memory was lost and the leader received its part from a
peer — sent on by the leader; the adapter's ``merge(whole, own)`` makes the rank's checkpoint.
The persistent store is laid out the same way (rank 0 writes the replicated state once). A
rank's own state includes its buffers where DDP does not broadcast them
(:mod:`lightning_incremental.runtime.state.rank_buffers`), so a resume from memory stays exact.
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
from lightning_incremental.runtime.cluster import collectives
from lightning_incremental.runtime.memory.agree import Inventory, Plan, agree
from lightning_incremental.runtime.memory.replica import (
    GroupLinks,
    Replicator,
    exchange,
    fetch_plan,
)
from lightning_incremental.runtime.memory.tier import MemoryPartError, MemoryTier, Part, default_dir

log = logging.getLogger(__name__)

# Where a part holds the replicated state (its header's layout; see the module's notes):
WHOLE = 0  # every part holds this rank's whole state
SHARDS = 1  # every part holds this rank's shards (a sharded strategy)
# k >= 2: one copy a node of k ranks, in the part of its first rank
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
        replicated: every rank holds the same model and optimizer state (DDP): only each
            node's first rank takes it (see the module's notes), when every rank tells the same
            ``ranks_per_node``, it divides the world, and each rank's ``local_rank`` is its
            rank modulo it (a node's ranks in a row); else every rank takes it.
        sharded: every rank's part holds its own shards (layout :data:`SHARDS`: never read
            as a whole state, nor the other way round).
        local_rank: this process's rank on its node (None: not known, assumed in a row).
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
        replicated: bool = False,
        sharded: bool = False,
        local_rank: int | None = None,
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
        per_node = max(1, int(ranks_per_node))
        placed = local_rank is None or local_rank == rank % per_node  # a node's ranks in a row
        told = collectives.gather((mine, per_node, placed)) if world_size > 1 else [(mine, 1, True)]
        self.tier.generation = max(t[0] for t in told)
        # the same on every rank, or the ring's sends and receives would not pair up
        agreed = all(t[1] == per_node for t in told) and world_size % per_node == 0
        self.per_node = per_node = per_node if agreed else 1
        self.tier.layout = layout([(t[1], t[2]) for t in told], replicated, sharded)
        self.group = None
        if world_size > 1:
            self.group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S)
            )
        self.pool = BufferPool()  # one snapshot's buffers, reused step after step
        self.replicator = Replicator(
            self.tier,
            rank=rank,
            world_size=world_size,
            ranks_per_node=per_node,
            replicas=options.replicas,
            links=GroupLinks(self.group) if self.group is not None else None,
            pool=self.pool,
        )
        self.last_step: int | None = None  # the newest step this process took
        nodes = max(1, world_size // per_node)
        if world_size > 1 and options.replicas > nodes - 1:
            warn(
                f"{owner}: memory_replicas={options.replicas}, but the job has "
                f"{nodes} node(s): each memory step is held by {nodes} node(s)"
            )

    @property
    def whole(self) -> bool:
        """Whether this rank takes the whole checkpoint (else its own state alone; see the
        module's notes)."""
        return self.tier.layout < 2 or self.rank % self.per_node == 0

    @property
    def leader(self) -> int:
        """The rank whose part holds this rank's replicated state (itself when whole)."""
        return self.rank if self.whole else self.rank - self.rank % self.per_node

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
        self,
        newest_persistent: int | None,
        check: Callable[[Any, int], None],
        merge: Callable[[Any, Any], Any] | None = None,
    ) -> tuple[int, Any, str] | None:
        """Every process together: ``(step, checkpoint, tier)`` from the memory tier (tier
        ``"memory"`` or ``"peer"``), or None for the store (after saying why). ``check(
        checkpoint, step)`` raises when the restored part does not hold ``step``; any rank's
        failure sends every rank to the store. ``merge(whole, own)``: a rank that took its own
        state alone (not :attr:`whole`) gets its leader's part and its own merged."""
        world = self.world
        inventory = Inventory(self.rank, tuple(self.tier.inventory()))
        plan = agree(
            collectives.gather(inventory) if world > 1 else [inventory],
            job=self.job,
            world_size=world,
            generation=self.tier.generation,
            newest_persistent=newest_persistent,
            layout=self.tier.layout,
        )
        if plan.step is None:
            self.info(f"{self.owner}: memory tier not used: {plan.reason}")
            return None
        checkpoint, error, received, whole = None, None, None, None
        try:
            received = fetch_plan(plan, self.tier, self.rank, self.group) if world > 1 else None
        except Exception as exc:  # every rank learns below; all resume from the store
            error = exc
        try:  # the leaders whose part came from a peer send it on to their node (see notes)
            if self.tier.layout >= 2:
                whole = self._pass_on(plan, received if error is None else None)
        except Exception as exc:
            error = error or exc
        try:
            if error is None:
                checkpoint = self._read(plan, self.rank, received)
                if not self.whole:
                    assert merge is not None, "an adapter taking own state alone must merge"
                    checkpoint = merge(self._read(plan, self.leader, whole), checkpoint)
                check(checkpoint, plan.step)
        except Exception as exc:
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
        # kept until every rank holds a newer step of this run (an earlier run's part, and no
        # step of this run is complete yet)
        self.replicator.recoverable = (plan.step, plan.generation)
        return plan.step, checkpoint, plan.tier_used

    def _read(self, plan: Plan, rank: int, received: Part | None) -> Any:
        """``rank``'s part of the plan's step: ``received`` from a peer, else this node's copy,
        read into the tensors and hashed on the way (one pass)."""
        assert plan.step is not None
        if received is not None:
            return self.tier.restore(received)
        if rank != self.rank and plan.sources[rank] != rank:
            raise MemoryPartError(f"rank {rank} could not pass on its part of step {plan.step}")
        return self.tier.load(rank, plan.step, plan.generation)

    def _pass_on(self, plan: Plan, received: Part | None) -> Part | None:
        """Where a node's memory lacked its leader's part, the leader received it from a peer
        and sends it on (``None`` when it failed: the others then fail too) to the other ranks
        of its node; returns what this rank received so (None: nothing to receive)."""
        leader = self.leader  # one copy a node here: this rank or its node's first
        if plan.sources[leader] == leader:  # the node holds it: each rank reads it there
            return None
        if self.rank == leader:
            mates = range(leader + 1, min(leader + self.per_node, self.world))
            exchange({m: received for m in mates}, [], self.group)
            return None
        return exchange({}, [leader], self.group)[leader]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for this rank's memory step in flight (written and replicated)."""
        return self.replicator.wait(timeout)

    def finish(self) -> None:
        """Training ended and the store holds its last step: delete this rank's parts (its own
        and the replicas it keeps) from the node's memory."""
        self.replicator.close()
        self.tier.prune([self.rank, *self.replicator.srcs], keep=set(), recycle=False)
        self.tier.release()

    def end(self, newest_persistent: Callable[[], int | None] | None) -> None:
        """The run ended. ``newest_persistent`` (None: it failed) gives the store's newest
        step once its saves committed; when that is at least this rank's last memory step, its
        parts and the replicas it keeps are deleted (:meth:`finish`), else they stay for a
        resume (also when the store cannot be listed: warned in the log). Then :meth:`close`."""
        done = False
        if newest_persistent is not None and self.last_step is not None:
            self.wait()
            try:
                newest = newest_persistent()
                done = newest is not None and newest >= self.last_step
            except Exception as exc:  # the parts stay; a resume can still use them
                log.warning(
                    "%s: memory parts kept (the store could not be listed: %r)", self.owner, exc
                )
        if done:
            self.finish()
        self.close()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the background work; then the gloo group goes too (left to the interpreter's
        exit, gloo's threads can abort a finished process), unless a transfer still uses it."""
        stopped = self.replicator.close(timeout)
        if stopped:  # the spare slots go; the parts stay for a resume
            self.tier.release()
        group, self.group = self.group, None
        if stopped and group is not None:
            torch.distributed.destroy_process_group(group)  # this process's handle only


def layout(told: list[tuple[int, bool]], replicated: bool, sharded: bool) -> int:
    """Where the parts hold the replicated state (:data:`WHOLE`, :data:`SHARDS` or ``k``: one
    copy a node of ``k`` ranks), from what every rank told: its ranks a node and whether its
    local rank is its rank modulo that. One copy a node only when every rank told the same
    ``k > 1``, ``k`` divides the world and every node's ranks are in a row: else ``rank % k``
    would not name a node's first rank."""
    if sharded:
        return SHARDS
    per_node = told[0][0]
    one_copy = (
        replicated
        and len(told) > 1
        and per_node > 1
        and len(told) % per_node == 0
        and all(k == per_node and in_row for k, in_row in told)
    )
    return per_node if one_copy else WHOLE


def how(tier: str) -> str:
    """The words for where a memory step came from, in the resume line."""
    return "own node's memory" if tier != "peer" else "memory, some parts from peers"
