"""The coordinator's merge of many ranks' records (``commit.sharded.merge``): the table it
builds is exact, and its cost grows with the pieces, not faster. Counted, never timed."""

from __future__ import annotations

import gc

import pytest

from lightning_incremental.core.chunks.encode import Encoded
from lightning_incremental.core.commit.committer import Part
from lightning_incremental.core.commit.sharded import PartRecord, merge
from lightning_incremental.core.format.records import TensorEntry
from lightning_incremental.core.format.tree import ShardedInfo
from tests.engine.gc_counts import collections_started

ROWS, COLS, TENSORS = 4, 8, 4


def _records(ranks: int) -> list[PartRecord]:
    """The records of ``ranks`` ranks, each holding rows of every one of ``TENSORS`` tensors."""
    shape = (ranks * ROWS, COLS)
    sharded = {
        s: ShardedInfo(f"state['t{s}']", "float32", shape, "cpu", 4, True, True)
        for s in range(TENSORS)
    }
    records = []
    for rank in range(ranks):
        entries = tuple(
            TensorEntry(info.path, "float32", (ROWS, COLS), ROWS * COLS * 4, 4, "cpu", False,
                        True, True, (f"{rank}:{slot}",))
            for slot, info in sharded.items()
        )  # fmt: skip
        part = Part(1, None, 0, entries, {}, {}, frozenset(), Encoded([], {}, {}))
        arrays = tuple((slot, (rank * ROWS, 0)) for slot in sharded)
        records.append(PartRecord(rank, 1, TENSORS, part, arrays, sharded))
    return records


def test_the_merged_table_holds_every_piece_once_in_order() -> None:
    records = _records(16)
    table = merge(records + records[:3])  # three records again: a piece reported twice
    assert [t.path for t in table] == [f"state['t{s}']" for s in range(TENSORS)]
    for slot, tensor in enumerate(table):
        assert tensor.shape == (16 * ROWS, COLS)
        assert [p.offsets for p in tensor.pieces] == [(r * ROWS, 0) for r in range(16)]
        assert tensor.chunks == tuple(f"{r}:{slot}" for r in range(16))


@pytest.mark.parametrize("ranks", [256, 4096])
def test_a_merge_triggers_no_garbage_collection_growing_with_the_ranks(ranks: int) -> None:
    """A merge makes a few objects per piece, all of them live (the manifest's table): the
    collections they triggered rescanned the records again and again, a full one now and then
    (a merge of 4,096 ranks' records took 55 ms, or over 200 ms when one struck). Merging
    pauses collection: their number does not grow with the ranks."""
    records = _records(ranks)
    with collections_started() as started:
        table = merge(records)
    assert sum(len(t.pieces) for t in table) == ranks * TENSORS
    assert len(started) <= 3, started  # the young generation, once collection resumes
    assert gc.isenabled()
