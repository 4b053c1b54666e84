"""Which memory step a restarted job resumes from, and where each rank finds its part.

:func:`agree` is a pure function of what every rank tells (its :class:`Inventory`, gathered on
every rank), so every rank computes the same :class:`Plan` without a coordinator:

- parts of another job, of another world size (a resize resumes from the store) or of another
  layout (where the replicated state is: every part, or one part a node of that many ranks,
  see :mod:`.steps`) are ignored;
- a step counts only when one generation wrote every rank's part of it (a zombie's lone write
  never completes a step; parts of two incarnations are never mixed), and the generation is
  older than the one resuming;
- the newest generation that completed a step wins (an older incarnation's later steps are
  another history), then its newest complete step; it must be at least the persistent store's
  newest step, else the store is the better source;
- each rank reads its own node's copy when it has one ("memory"), else receives it from the
  lowest rank of the nodes that hold one ("peer").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_incremental.runtime.memory.part import Held

MEMORY, PEER, STORE = "memory", "peer", "store"


@dataclass(frozen=True)
class Inventory:
    """What one rank can read from its node's memory directory."""

    rank: int
    parts: tuple[Held, ...]


@dataclass(frozen=True)
class Plan:
    """The agreed step (None: resume from the store), the generation that wrote it, for every
    rank the rank whose node sends its part (itself: its own node's memory), and why."""

    step: int | None
    generation: int
    sources: tuple[int, ...]
    reason: str

    def tier(self, rank: int) -> str:
        if self.step is None:
            return STORE
        return MEMORY if self.sources[rank] == rank else PEER

    @property
    def tier_used(self) -> str:
        """``"memory"`` when every rank reads its own node's copy, ``"peer"`` when any rank
        receives its part, ``"store"`` without a memory step."""
        tiers = {self.tier(r) for r in range(len(self.sources))} or {STORE}
        return PEER if PEER in tiers else tiers.pop()


def agree(
    inventories: Sequence[Inventory],
    *,
    job: str,
    world_size: int,
    generation: int,
    newest_persistent: int | None,
    layout: int = 0,
) -> Plan:
    """The plan every rank follows (see the module's description); ``generation`` is the one
    resuming, ``newest_persistent`` the persistent store's newest step (None: empty)."""
    holders: dict[tuple[int, int], dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    layouts = set()  # of this job's parts otherwise usable
    for inventory in inventories:
        for held in inventory.parts:
            if (
                held.job != job
                or held.world_size != world_size
                or held.generation >= generation
                or not 0 <= held.rank < world_size
            ):
                continue
            layouts.add(held.layout)
            if held.layout == layout:
                holders[(held.generation, held.step)][held.rank].add(inventory.rank)
    complete = [key for key, ranks in holders.items() if len(ranks) == world_size]
    if not complete:
        why = "no step has every rank's part in memory" if holders else "no memory step found"
        if layouts - {layout}:
            why += (
                f" of this run's layout {layout}; parts of layout {sorted(layouts - {layout})} "
                "are ignored (written with another number of ranks a node, or by another "
                "strategy: see memory_steps)"
            )
        return Plan(None, 0, (), why)
    gen, step = max(complete)
    if newest_persistent is not None and step < newest_persistent:
        return Plan(
            None,
            0,
            (),
            f"the newest complete memory step ({step}) is older than the store's "
            f"({newest_persistent})",
        )
    sources = tuple(
        r if r in holders[(gen, step)][r] else min(holders[(gen, step)][r])
        for r in range(world_size)
    )
    return Plan(step, gen, sources, f"every rank's part of step {step} is held in memory")
