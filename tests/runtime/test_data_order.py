"""The epoch's global order and its cut over another world (runtime.data_order), checked against
torch's own ``DistributedSampler`` and by counting every sample of an epoch interrupted once or
twice and resumed on other numbers of ranks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from lightning_incremental.runtime.state.data_order import (
    PERMUTATION,
    SEQUENTIAL,
    EpochOrder,
    Segment,
    cut,
    position,
    resume,
    split,
)


def sampler_shares(
    n: int, world: int, *, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> list[list[int]]:
    """What torch's DistributedSampler hands every rank for this epoch."""
    shares = []
    for rank in range(world):
        sampler = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def batches_of(share: list[int], size: int, drop_last: bool) -> list[list[int]]:
    out = [share[i : i + size] for i in range(0, len(share), size)]
    return [b for b in out if len(b) == size] if drop_last else out


orders = st.builds(
    EpochOrder,
    kind=st.sampled_from([PERMUTATION, SEQUENTIAL]),
    length=st.integers(1, 120),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
    drop_last=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(order=orders, world=st.integers(1, 5))
def test_the_cut_of_the_whole_order_is_what_distributed_sampler_hands_out(
    order: EpochOrder, world: int
) -> None:
    expected = sampler_shares(
        order.length,
        world,
        shuffle=order.kind == PERMUTATION,
        seed=order.seed,
        epoch=order.epoch,
        drop_last=order.drop_last,
    )
    got = [split(order.indices(), world, rank, order.drop_last) for rank in range(world)]
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(
    order=orders,
    worlds=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    batch_size=st.integers(1, 9),
    loader_drop_last=st.booleans(),
    data=st.data(),
)
def test_an_epoch_resumed_on_other_worlds_trains_every_sample_once_but_the_padding(
    order: EpochOrder,
    worlds: list[int],
    batch_size: int,
    loader_drop_last: bool,
    data: st.DataObject,
) -> None:
    """Train part of the epoch on worlds[0], stop after some batches, resume on worlds[1], stop
    again ... and finish on the last world. Count what every rank trained."""
    trained: Counter[int] = Counter()
    segment = Segment(0, worlds[0], 0)
    shares = [split(order.indices(), worlds[0], r, order.drop_last) for r in range(worlds[0])]
    first = cut(order.length, worlds[0], order.drop_last)
    padding = max(0, first - order.length)  # samples the cuts hand out twice
    left_out = max(0, order.length - first)  # samples the cuts or the loader leave out
    batches = 0  # the epoch's batch count (every rank's)
    for index, world in enumerate(worlds):
        per_rank = [batches_of(s, batch_size, loader_drop_last) for s in shares]
        assert len({len(b) for b in per_rank}) == 1  # every rank has as many batches
        last = index == len(worlds) - 1
        run = len(per_rank[0]) if last else data.draw(st.integers(0, len(per_rank[0])))
        for rank_batches in per_rank:
            for batch in rank_batches[:run]:
                trained.update(batch)
        batches += run
        if last:
            left_out += sum(map(len, shares)) - sum(len(b) for rb in per_rank for b in rb)
            break
        new_world = worlds[index + 1]
        rest, account = resume(order, segment, batches, batch_size, new_world)
        assert account.done == position(order.length, segment, batches, batch_size)
        assert account.rest == len(rest) and (account.old_world, account.new_world) == (
            world,
            new_world,
        )
        shares = [split(rest, new_world, r, order.drop_last) for r in range(new_world)]
        assert sum(map(len, shares)) == len(rest) + account.repeated - account.left_out
        assert max(map(len, shares)) == account.per_rank
        padding += account.repeated
        left_out += account.left_out
        segment = Segment(account.done, new_world, batches)
    assert set(trained) <= set(range(order.length))
    repeats = sum(c - 1 for c in trained.values())
    never = order.length - len(trained)
    assert repeats <= padding, f"{repeats} repeats, but the cuts padded only {padding}"
    assert never <= left_out, f"{never} samples never trained, {left_out} left out by design"
    if not order.drop_last and not loader_drop_last:
        assert never == 0


def test_the_numbers_of_the_issue_two_to_one_mid_epoch() -> None:
    """256 samples, batch 8, 2 ranks, 12 batches each done: 192 trained, 64 left for 1 rank."""
    order = EpochOrder(PERMUTATION, 256, seed=0, epoch=0)
    rest, account = resume(order, Segment(0, 2, 0), 12, 8, 1)
    assert (account.done, account.rest, account.per_rank, account.repeated) == (192, 64, 64, 0)
    done = {
        i
        for share in sampler_shares(256, 2, shuffle=True, seed=0, epoch=0, drop_last=False)
        for i in share[: 12 * 8]
    }
    assert done.isdisjoint(rest) and done | set(rest) == set(range(256))


def test_a_resumed_epoch_reports_its_padding() -> None:
    rest, account = resume(EpochOrder(SEQUENTIAL, 256), Segment(0, 2, 0), 12, 8, 3)
    assert account.rest == 64 and account.per_rank == 22 and account.repeated == 2
    shares = [split(rest, 3, r, False) for r in range(3)]
    assert [len(s) for s in shares] == [22, 22, 22]
    assert Counter(i for s in shares for i in s).most_common(1)[0][1] == 2


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="kind"):
        EpochOrder("random", 3)
    with pytest.raises(ValueError, match="rank 2"):
        split([1, 2], 2, 2, False)
    with pytest.raises(ValueError, match="world"):
        cut(3, 0, False)


def test_records_round_trip() -> None:
    order = EpochOrder(PERMUTATION, 10, seed=3, epoch=2, drop_last=True)
    assert EpochOrder.from_dict(order.to_dict()) == order
    segment = Segment(4, 3, 7)
    assert Segment.from_dict(segment.to_dict()) == segment
