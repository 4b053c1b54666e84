"""A stateful property test of the memory tier's pruning: the ranks of a job (1 to 3 nodes of 1
or 2 ranks, 0 to 2 replicas) each run their own :class:`Replicator` over their own real
:class:`MemoryTier` directory, and Hypothesis decides when each rank takes a step and when each
rank's background write of its part ends (done, or failed as a full tmpfs fails it) — so a
node's first rank can take far longer than the others, as under DDP, where it writes the whole
state and the others their own state alone.

The ranks run as threads of this process; the job's side group (the ring's exchange and the
agreement's all-reduce) is a rendezvous of those threads (a real gloo group of several ranks
cannot live in one process; ``tests/multiprocess/test_memory_pruning.py`` runs the real one).
Every rule ends when every rank is idle or waits for something only a later rule gives (its
write's end, or a peer that waits for its own): a kill could come at any of those points.

Invariants, checked at each of them on the parts the nodes' directories hold:

- a restart with every node finds (:func:`agree`) a step at least as new as the newest step
  whose every rank's part was written: no rank deletes the last step every rank holds before
  every rank holds a newer one;
- a restart after the loss of any one node finds a step at least as new as the newest step
  whose every part was held by ``replicas + 1`` nodes (or every node);
- no directory holds more than two steps of any rank once its rank is idle (the newest
  recoverable step and its newest part), three while a step is being agreed on;
- no transfer failed (the agreement never gave up).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.runtime.memory.agree import Inventory, agree
from lightning_incremental.runtime.memory.replica import Replicator
from lightning_incremental.runtime.memory.tier import MemoryTier, Part, Snapshot
from tests.conftest import DEEP

JOB = "memory-stateful"
GENERATION = 1
QUIET_S = 20.0  # how long the ranks may take to reach a point where each waits (a hang: fails)


class Killed(BaseException):
    """Ends a rank's thread where it waits, as a SIGKILL ends a process: nothing more runs."""


class World:
    """What one incarnation's ranks share: one lock, the gates of the writes, the side group."""

    def __init__(self, world_size: int) -> None:
        self.size = world_size
        self.cond = threading.Condition()
        self.parked: dict[int, Callable[[], bool] | None] = dict.fromkeys(range(world_size))
        self.gates: dict[int, list[bool]] = defaultdict(list)  # outcomes released, in order
        self.queues: dict[tuple[int, int], list[Part | None]] = defaultdict(list)
        self.rounds: dict[int, dict[int, bool]] = defaultdict(dict)
        self.calls: dict[int, int] = defaultdict(int)
        self.draining = self.killed = False

    def park(self, rank: int, ready: Callable[[], bool]) -> None:
        """Wait (the lock held) until ``ready()``; a waiting rank counts as quiet."""
        self.parked[rank] = ready
        self.cond.notify_all()
        self.cond.wait_for(lambda: ready() or self.killed)
        if self.killed:
            raise Killed
        self.parked[rank] = None

    def quiet(self, replicators: Sequence[Replicator]) -> bool:
        """Whether every rank is idle or waits for what no running rank will give it."""
        with self.cond:
            for rank, rep in enumerate(replicators):
                ready = self.parked[rank]
                if (ready is None or ready()) and not rep.wait(timeout=0):
                    return False
            return True


class Links:
    """The side group of one rank, as :class:`GroupLinks` is over gloo: the same calls."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank

    def exchange(
        self,
        sends: Mapping[int, Part | None],
        receives: Sequence[int],
        into: Callable[[int, int], torch.Tensor | None] | None = None,
    ) -> dict[int, Part | None]:
        world, me = self.world, self.rank
        with world.cond:
            for dst, part in sends.items():
                sent = None if part is None else Part(part.header, part.index, part.data.clone())
                world.queues[(me, dst)].append(sent)
            world.cond.notify_all()
            got: dict[int, Part | None] = {}
            for src in receives:
                queue = world.queues[(src, me)]
                world.park(me, lambda q=queue: bool(q))
                got[src] = queue.pop(0)
        received: dict[int, Part | None] = {}
        for src, part in got.items():
            if part is None:
                received[src] = None
                continue
            buf = into(src, part.data.numel()) if into is not None else None
            buf = torch.empty(part.data.numel(), dtype=torch.uint8) if buf is None else buf
            buf.copy_(part.data)
            received[src] = Part(part.header, part.index, buf)
        return received

    def all_true(self, flag: bool) -> bool:
        world, me = self.world, self.rank
        with world.cond:
            n = world.calls[me]
            world.calls[me] += 1
            votes = world.rounds[n]
            votes[me] = flag
            world.cond.notify_all()
            world.park(me, lambda: len(votes) == world.size)
            return all(votes.values())


class GatedTier(MemoryTier):
    """A rank's tier whose writes end when the machine says (done, or failed as a full tmpfs),
    recording what was written: ``(generation, rank, step)`` of its own parts, ``(generation,
    rank, step, holder)`` of the replicas it keeps."""

    def __init__(self, world: World, rank: int, log: dict[str, set[Any]], **kw: Any) -> None:
        super().__init__(**kw)
        self.world, self.rank, self.log = world, rank, log

    def write(self, snap: Snapshot, rank: int, step: int) -> bool:
        world = self.world
        with world.cond:
            gate = world.gates[rank]
            world.park(rank, lambda: bool(gate) or world.draining)
            ok = gate.pop(0) if gate else True
        if not ok:
            self._failed(self._tmp(rank, step), f"rank {rank}, step {step}", OSError(28, "full"))
            return False
        done = super().write(snap, rank, step)
        if done:
            self.log["own"].add((self.generation, rank, step))
        return done

    def write_part(self, part: Part) -> bool:
        done = super().write_part(part)
        if done:
            head = json.loads(part.header)
            self.log["replica"].add((head["generation"], head["rank"], head["step"], self.rank))
        return done


class MemoryPruning(RuleBasedStateMachine):
    @initialize(
        nodes=st.integers(1, 3),
        per_node=st.integers(1, 2),
        replicas=st.integers(0, 2),
    )
    def start(self, nodes: int, per_node: int, replicas: int) -> None:
        self.nodes, self.per_node, self.replicas = nodes, per_node, replicas
        self.size = nodes * per_node
        self.root = Path(tempfile.mkdtemp(prefix="li-memory-stateful-"))
        self.log: dict[str, set[Any]] = {"own": set(), "replica": set()}
        self.generation = 0
        self.resumed: tuple[int, int] | None = None  # (generation, step) of the last resume
        self._incarnation(0)

    def _incarnation(self, step: int) -> None:
        """Every rank's process (re)starts, one generation newer, from ``step``."""
        self.generation += 1
        self.world = World(self.size)
        self.tiers: list[GatedTier] = []
        self.replicators: list[Replicator] = []
        self.pools: list[BufferPool] = []
        self.taken = [step] * self.size
        self.first = step
        for rank in range(self.size):
            tier = GatedTier(
                self.world,
                rank,
                self.log,
                directory=self.root / f"rank{rank}",  # its node's memory: see _inventories
                job=JOB,
                generation=self.generation,
                world_size=self.size,
            )
            pool = BufferPool()
            links = Links(self.world, rank) if self.size > 1 else None
            rep = Replicator(
                tier,
                rank=rank,
                world_size=self.size,
                ranks_per_node=self.per_node,
                replicas=self.replicas,
                links=links,  # type: ignore[arg-type]
                pool=pool,
            )
            self.tiers.append(tier)
            self.pools.append(pool)
            self.replicators.append(rep)

    def teardown(self) -> None:
        if not hasattr(self, "world"):
            return
        with self.world.cond:
            self.world.draining = True
            self.world.cond.notify_all()
        newest = max(self.taken)
        for rank, taken in enumerate(self.taken):  # a rank behind takes what the others did
            for step in range(taken + 1, newest + 1):
                self._take(rank, step)
        for rep in self.replicators:
            assert rep.close(timeout=QUIET_S), "a rank's memory step never ended"
        for tier in self.tiers:
            tier.release()
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ rules

    @rule(pick=st.integers(0, 5))
    def take(self, pick: int) -> None:
        """A rank's training thread takes its next step, once its previous step's background
        work ended (as MemorySteps.take waits), never more than one step ahead of the slowest
        rank (the training steps' collectives keep the ranks together)."""
        rank = pick % self.size
        if not self.replicators[rank].wait(timeout=0) or self.taken[rank] > min(self.taken):
            return
        self._take(rank, self.taken[rank] + 1)
        self._settle()

    @rule(pick=st.integers(0, 5), ok=st.sampled_from([True, True, True, False]))
    def write_ends(self, pick: int, ok: bool) -> None:
        """A rank's background write of its part ends: done, or failed (a full tmpfs)."""
        rank = pick % self.size
        with self.world.cond:
            self.world.gates[rank].append(ok)
            self.world.cond.notify_all()
        self._settle()

    @rule()
    def restart(self) -> None:
        """Every process is killed where it is and the job restarts, one generation newer:
        from the memory step every rank agrees on (as MemorySteps.resume), else from the
        store's step 0."""
        with self.world.cond:
            self.world.killed = True
            self.world.cond.notify_all()
        for rep in self.replicators:
            assert rep.close(timeout=QUIET_S), "a killed rank's thread did not end"
        plan = agree(
            self._inventories(),
            job=JOB,
            world_size=self.size,
            generation=self.generation + 1,
            newest_persistent=None,
        )
        self.resumed = None if plan.step is None else (plan.generation, plan.step)
        self._incarnation(plan.step or 0)
        if plan.step is not None:
            for rep in self.replicators:
                rep.recoverable = (plan.step, plan.generation)

    def _take(self, rank: int, step: int) -> None:
        state = {"rank": rank, "w": torch.full((64 * (rank + 1),), float(step))}
        tier = self.tiers[rank]
        self.replicators[rank].wait()
        self.replicators[rank].submit(step, tier.snapshot(state, rank, self.pools[rank]))
        self.taken[rank] = step

    def _settle(self) -> None:
        deadline = time.monotonic() + QUIET_S
        while not self.world.quiet(self.replicators):
            assert time.monotonic() < deadline, "the ranks never came to rest (a hang)"
            time.sleep(0.001)

    # ------------------------------------------------------------------ invariants

    def _node(self, rank: int) -> int:
        return rank // self.per_node

    def _inventories(self, lost: int | None = None) -> list[Inventory]:
        """What each rank would list after a restart: its node's memory (every rank's
        directory on that node); nothing on the node ``lost``."""
        held_by_node: dict[int, list[Any]] = defaultdict(list)
        for rank, tier in enumerate(self.tiers):
            held_by_node[self._node(rank)].extend(tier.inventory())
        return [
            Inventory(r, () if self._node(r) == lost else tuple(held_by_node[self._node(r)]))
            for r in range(self.size)
        ]

    def _found(self, lost: int | None = None) -> tuple[int, int] | None:
        """``(generation, step)`` a restart would resume from memory (None: the store)."""
        plan = agree(
            self._inventories(lost),
            job=JOB,
            world_size=self.size,
            generation=self.generation + 1,
            newest_persistent=None,
        )
        return None if plan.step is None else (plan.generation, plan.step)

    def _newest(self, held: Callable[[int, int, int], bool]) -> tuple[int, int] | None:
        """``(generation, step)``: the newest step of this run all of whose parts are
        ``held(generation, rank, step)``, else the step it resumed from if that held so."""
        g = self.generation
        steps = [
            s
            for s in range(self.first + 1, max(self.taken) + 1)
            if all(held(g, r, s) for r in range(self.size))
        ]
        if steps:
            return g, max(steps)
        before = self.resumed
        if before is not None and all(held(before[0], r, before[1]) for r in range(self.size)):
            return before
        return None

    @invariant()
    def a_restart_finds_the_newest_step_every_rank_wrote(self) -> None:
        if not hasattr(self, "world"):
            return
        written = self._newest(lambda g, r, s: (g, r, s) in self.log["own"])
        if written is not None:
            found = self._found()
            assert found is not None and found >= written, (
                f"every rank wrote (generation, step) {written}, but a restart finds {found}: "
                f"{[sorted(t.name for t in tier.parts.iterdir()) for tier in self.tiers]}"
            )

    @invariant()
    def a_restart_without_a_node_finds_the_newest_replicated_step(self) -> None:
        if not hasattr(self, "world") or min(self.replicas + 1, self.nodes) < 2:
            return
        copies = min(self.replicas + 1, self.nodes)

        def held(g: int, rank: int, step: int) -> bool:
            if (g, rank, step) not in self.log["own"]:
                return False
            holders = {h for gen, r, s, h in self.log["replica"] if (gen, r, s) == (g, rank, step)}
            return len({self._node(rank)} | {self._node(h) for h in holders}) >= copies

        replicated = self._newest(held)
        if replicated is None:
            return
        for lost in range(self.nodes):
            found = self._found(lost)
            assert found is not None and found >= replicated, (lost, replicated, found)

    @invariant()
    def memory_holds_two_steps_of_a_rank_at_rest(self) -> None:
        """The newest recoverable step and this rank's newest part; a third while a step is
        being agreed on (the step before it may be every rank's, not yet replicated). Counted
        once the rank took a step of its own run (an earlier run's parts go at its first)."""
        if not hasattr(self, "world"):
            return
        for rank, (tier, rep) in enumerate(zip(self.tiers, self.replicators)):
            idle = rep.wait(timeout=0)
            done = self.taken[rank] - self.first - (0 if idle else 1)
            if done < 1:
                continue
            steps: dict[int, set[tuple[int, int]]] = defaultdict(set)
            for held in tier.inventory():
                steps[held.rank].add((held.generation, held.step))
            most = 2 if idle else 3
            assert all(len(s) <= most for s in steps.values()), (tier.parts, dict(steps))

    @invariant()
    def no_transfer_failed(self) -> None:
        if hasattr(self, "world"):
            assert all(rep.agreeing for rep in self.replicators if rep.links is not None)


QUICK = settings(
    max_examples=200 if DEEP else 40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.filterwarnings("ignore:memory tier")  # the failed writes the machine chooses
def test_memory_pruning_state_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    before = threading.excepthook

    def killed_quietly(args: Any) -> None:  # a killed rank's thread ends by Killed
        if args.exc_type is not Killed:
            before(args)

    monkeypatch.setattr(threading, "excepthook", killed_quietly)
    MemoryPruning.TestCase.settings = QUICK
    MemoryPruning.TestCase().runTest()
