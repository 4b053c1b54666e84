"""The memory tier's agreement: which step a restarted job resumes from and where each rank finds
its part, as a pure function of every rank's inventory — examples, and properties over random
inventories."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.runtime.memory.agree import MEMORY, PEER, STORE, Inventory, agree
from lightning_incremental.runtime.memory.tier import Held

JOB = "job"


def _held(rank: int, step: int, gen: int = 1, job: str = JOB, ws: int = 2) -> Held:
    return Held(rank, step, gen, job, ws)


def _agree(invs: list[Inventory], ws: int = 2, gen: int = 2, persistent: int | None = None):
    return agree(invs, job=JOB, world_size=ws, generation=gen, newest_persistent=persistent)


def test_each_rank_its_own_newest_common_step() -> None:
    plan = _agree(
        [
            Inventory(0, (_held(0, 24), _held(0, 25), _held(1, 24))),
            Inventory(1, (_held(1, 24), _held(0, 24))),
        ]
    )
    assert (plan.step, plan.sources, plan.tier_used) == (24, (0, 1), MEMORY)


def test_a_lost_node_is_served_by_its_replica() -> None:
    plan = _agree([Inventory(0, (_held(0, 25), _held(1, 25))), Inventory(1, ())])
    assert (plan.step, plan.sources) == (25, (0, 0))
    assert (plan.tier(0), plan.tier(1), plan.tier_used) == (MEMORY, PEER, PEER)


def test_the_store_when_memory_is_older_or_foreign() -> None:
    both = [Inventory(0, (_held(0, 18),)), Inventory(1, (_held(1, 18),))]
    assert _agree(both, persistent=20).step is None
    assert _agree(both, persistent=20).tier_used == STORE
    assert _agree(both, persistent=18).step == 18
    foreign = [
        Inventory(0, (_held(0, 30, job="other"), _held(0, 31, ws=4))),
        Inventory(1, (_held(1, 30, job="other"), _held(1, 31, ws=4))),
    ]
    assert _agree(foreign).step is None


def test_parts_of_another_layout_are_ignored() -> None:
    """Parts written with the replicated state once a node of 2 ranks (layout 2) serve only a
    job of that layout: not one whose every rank takes the whole state (0), nor another
    number of ranks a node."""
    ws = 4
    invs = [Inventory(r, tuple(Held(q, 30, 1, JOB, ws, 2) for q in range(ws))) for r in range(ws)]
    plan = agree(invs, job=JOB, world_size=ws, generation=2, newest_persistent=None, layout=2)
    assert (plan.step, plan.tier_used) == (30, MEMORY)
    for other in (0, 4):
        plan = agree(
            invs, job=JOB, world_size=ws, generation=2, newest_persistent=None, layout=other
        )
        assert plan.step is None


def test_parts_of_two_generations_never_make_a_step() -> None:
    invs = [Inventory(0, (_held(0, 30, gen=1),)), Inventory(1, (_held(1, 30, gen=2),))]
    assert _agree(invs, gen=3).step is None


def test_the_newest_generation_wins_over_a_later_step_of_an_older_one() -> None:
    invs = [
        Inventory(0, (_held(0, 40, gen=1), _held(0, 31, gen=2))),
        Inventory(1, (_held(1, 40, gen=1), _held(1, 31, gen=2))),
    ]
    plan = _agree(invs, gen=3)
    assert (plan.step, plan.generation) == (31, 2)
    # a zombie of generation 1 alone never completes a step; the current generation's own
    # (impossible) parts are ignored
    invs = [Inventory(0, (_held(0, 50, gen=1), _held(0, 60, gen=3))), Inventory(1, ())]
    assert _agree(invs, gen=3).step is None


held = st.builds(
    Held,
    rank=st.integers(0, 3),
    step=st.integers(0, 6),
    generation=st.integers(0, 4),
    job=st.sampled_from([JOB, "other"]),
    world_size=st.sampled_from([3, 4]),
)
inventories = st.lists(st.lists(held, max_size=12), min_size=3, max_size=3).map(
    lambda parts: [Inventory(r, tuple(p)) for r, p in enumerate(parts)]
)


@settings(max_examples=300, deadline=None)
@given(inventories, st.integers(1, 5), st.none() | st.integers(0, 6))
def test_the_plan_is_sound_and_the_newest_possible(
    invs: list[Inventory], gen: int, persistent: int | None
) -> None:
    plan = _agree(invs, ws=3, gen=gen, persistent=persistent)
    usable = {
        (h.generation, h.step, h.rank, inv.rank)
        for inv in invs
        for h in inv.parts
        if h.job == JOB and h.world_size == 3 and h.generation < gen and h.rank < 3
    }
    complete = {
        (g, s)
        for g, s, _, _ in usable
        if all(any(u[:3] == (g, s, r) for u in usable) for r in range(3))
    }
    if plan.step is None:  # nothing complete, or older than the store
        assert not complete or (persistent is not None and max(complete)[1] < persistent)
        return
    assert (plan.generation, plan.step) == max(complete)  # newest generation, then step
    assert persistent is None or plan.step >= persistent
    for rank, source in enumerate(plan.sources):  # every part comes from a node that holds it
        assert (plan.generation, plan.step, rank, source) in usable
        own = (plan.generation, plan.step, rank, rank) in usable
        assert (source == rank) == own  # own memory first


@settings(max_examples=100, deadline=None)
@given(inventories, st.integers(1, 5), st.permutations(range(3)))
def test_every_rank_computes_the_same_plan_whatever_the_order(
    invs: list[Inventory], gen: int, order: list[int]
) -> None:
    shuffled = [invs[i] for i in order]
    assert _agree(invs, ws=3, gen=gen) == _agree(shuffled, ws=3, gen=gen)


def test_the_ring_sends_to_the_same_local_rank_on_the_next_nodes() -> None:
    from lightning_incremental.runtime.memory.replica import ring

    # 3 nodes of 2 ranks: rank 1 (node 0) sends to rank 3 (node 1), keeps rank 5's (node 2)
    assert ring(1, 6, 2, 1) == ([3], [5])
    assert ring(1, 6, 2, 2) == ([3, 5], [5, 3])
    assert ring(0, 6, 2, 5) == ([2, 4], [4, 2])  # at most the other nodes
    assert ring(0, 2, 2, 1) == ([], [])  # one node: nowhere to send
    for rank in range(8):  # every part is kept by exactly `replicas` other nodes
        dsts, _ = ring(rank, 8, 2, 2)
        assert len({d // 2 for d in dsts} | {rank // 2}) == 3
        assert all(rank in ring(d, 8, 2, 2)[1] for d in dsts)


def test_one_copy_a_node_only_where_every_rank_agrees_on_the_nodes() -> None:
    from lightning_incremental.runtime.memory.steps import SHARDS, WHOLE, layout

    four = [(2, True)] * 4
    assert layout(four, replicated=True, sharded=False) == 2
    assert layout(four, replicated=True, sharded=True) == SHARDS
    assert layout(four, replicated=False, sharded=False) == WHOLE
    assert layout([(1, True)] * 4, replicated=True, sharded=False) == WHOLE  # a rank a node
    assert layout([(2, True)], replicated=True, sharded=False) == WHOLE  # one process
    assert layout([(2, True)] * 3, replicated=True, sharded=False) == WHOLE  # 2 does not divide 3
    mixed = [(2, True), (2, True), (1, True), (1, True)]  # nodes of different sizes
    assert layout(mixed, replicated=True, sharded=False) == WHOLE
    cyclic = [(2, True), (2, False), (2, False), (2, True)]  # a node's ranks not in a row
    assert layout(cyclic, replicated=True, sharded=False) == WHOLE
