"""Nothing quadratic in a resharded load: the work of planning and scattering a restore of a
tensor stored as many pieces into many other boxes grows about linearly (a log factor allowed)
in the pieces, the boxes and the chunks. Measured by counting box tests (calls of ``intersect``
and of the box index's ``meets``), never by wall-clock; each case also checks the restore is
bit-exact."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_incremental.core.format import boxindex, pieces
from lightning_incremental.core.format.pieces import Box, check_tiling, plan_reads
from lightning_incremental.core.format.records import ChunkRecipe, PieceEntry, TensorEntry
from lightning_incremental.core.load import scatter
from lightning_incremental.core.load.scatter import piece_targets
from lightning_incremental.core.load.targets import Regions
from tests.engine.gc_counts import collections_started
from tests.engine.test_pieces import near_tilings

GROWTH = 2  # the log factor allowed: 4x the pieces may cost at most 4 * GROWTH x the tests


class _Count:
    """Wraps a box test to count its calls."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[_Count]:
    counters = []
    for module, name in ((pieces, "intersect"), (scatter, "intersect"), (boxindex, "meets")):
        counter = _Count(getattr(module, name))
        monkeypatch.setattr(module, name, counter)
        counters.append(counter)
    return counters


def _stored(full: torch.Tensor, tiling: list[Box], chunk_bytes: int):
    """``full`` stored as the pieces ``tiling``, each in chunks of ``chunk_bytes``."""
    blobs: dict[str, np.ndarray] = {}
    recipes: dict[str, ChunkRecipe] = {}
    entries = []
    for index, box in enumerate(tiling):
        raw = full[box.slices()].contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        hashes = []
        for offset in range(0, raw.size, chunk_bytes):
            digest = f"{index}:{offset}"
            blobs[digest] = raw[offset : offset + chunk_bytes]
            recipes[digest] = ChunkRecipe("z", "p", 0, 0, blobs[digest].size, 1)
            hashes.append(digest)
        entries.append(PieceEntry(box.offsets, box.sizes, tuple(hashes)))
    entry = TensorEntry(
        path="state['w']",
        dtype="float32",
        shape=tuple(full.shape),
        nbytes=full.numel() * 4,
        width=1,
        device="cpu",
        numpy=False,
        param=False,
        requires_grad=False,
        chunks=tuple(d for p in entries for d in p.chunks),
        pieces=tuple(entries),
    )
    return entry, recipes, blobs


def _restore(full, tiling, wanted, chunk_bytes, monkeypatch, contiguous=True) -> int:
    """Restores the boxes ``wanted`` of ``full`` stored as ``tiling``; checks every byte and
    returns the box tests the plan and the scatter took."""
    entry, recipes, blobs = _stored(full, tiling, chunk_bytes)
    if contiguous:
        outs = [torch.zeros(box.sizes) for box in wanted]
    else:  # strided destinations (as on a device): every chunk goes through the scatter
        outs = [torch.zeros(tuple(reversed(box.sizes))).t() for box in wanted]
    counters = _counting(monkeypatch)
    for item in piece_targets(entry, Regions(tuple(zip(outs, wanted))), recipes):
        offset = 0
        direct = item.direct or {}
        for i, digest in enumerate(item.chunks):
            if i in direct:
                direct[i][:] = blobs[digest]
            if item.wanted is None or i in item.wanted:
                assert not isinstance(item.target, np.ndarray)
                item.target.put(offset, blobs[digest].copy())
            offset += recipes[digest].size
    tests = sum(c.calls for c in counters)
    monkeypatch.undo()
    for box, out in zip(wanted, outs):
        assert torch.equal(out, full[box.slices()])
    return tests


def _rows(total: int, cuts: list[int], width: int) -> list[Box]:
    stops = [*cuts, total]
    starts = [0, *cuts]
    return [Box((a, 0), (b - a, width)) for a, b in zip(starts, stops)]


def _grid(side: int, rows: int, cols: int) -> list[Box]:
    h, w = side // rows, side // cols
    return [Box((r * h, c * w), (h, w)) for r in range(rows) for c in range(cols)]


def _linear(counts: dict[int, int]) -> None:
    sizes = sorted(counts)
    for small, big in itertools.pairwise(sizes):
        assert counts[big] <= counts[small] * big / small * GROWTH, counts


def test_rows_resharded_across_a_shifted_layout_cost_linear_box_tests(monkeypatch):
    """N pieces of 4 rows read as N + 1 boxes cut 2 rows later (save on N ranks, load on N
    others): each box meets two pieces, and the plan meets only those."""
    counts = {}
    for n in (64, 256, 1024):
        full = torch.arange(4 * n * 2, dtype=torch.float32).reshape(4 * n, 2)
        stored = _rows(4 * n, list(range(4, 4 * n, 4)), 2)
        wanted = _rows(4 * n, list(range(2, 4 * n, 4)), 2)
        counts[n] = _restore(full, stored, wanted, 16, monkeypatch)
    _linear(counts)


def test_a_grid_resharded_to_another_grid_costs_linear_box_tests(monkeypatch):
    """A tensor split over N ranks as an a x b grid read as a 2a x b/2 grid (N = a * b): each
    wanted box meets two pieces."""
    counts = {}
    side = 512
    full = torch.arange(side * side, dtype=torch.float32).reshape(side, side)
    for n, a in ((64, 8), (256, 16), (1024, 32)):
        piece_bytes = (side // a) * (side // a) * 4
        stored, wanted = _grid(side, a, a), _grid(side, 2 * a, a // 2)
        counts[n] = _restore(full, stored, wanted, piece_bytes // 2, monkeypatch)
    _linear(counts)


@pytest.mark.parametrize("contiguous", [True, False], ids=["direct", "scattered"])
def test_one_piece_of_many_chunks_read_as_many_boxes_costs_linear_box_tests(
    monkeypatch, contiguous
):
    """A tensor saved whole (4N chunks of a row each) loaded as N shards of 4 rows: which chunks
    each shard needs, which decode straight into it, and where a decoded chunk's elements go
    are found per chunk, not by meeting every chunk with every shard."""
    counts = {}
    for n in (64, 256, 1024):
        full = torch.arange(4 * n * 8, dtype=torch.float32).reshape(4 * n, 8)
        wanted = _rows(4 * n, list(range(4, 4 * n, 4)), 8)
        counts[n] = _restore(full, [Box((0, 0), (4 * n, 8))], wanted, 32, monkeypatch, contiguous)
    _linear(counts)


def test_the_sweep_for_pieces_split_along_many_dims_costs_linear_box_tests(monkeypatch):
    """The bounded sweep (for pieces split along more dims than corners are counted for) meets
    each piece only with the ones overlapping it. A staircase: row r split at column r + 1, so
    every row's first piece is still open in the sweep when the others start."""
    counts = {}
    for rows in (64, 256):
        shape = (rows, rows + 1)
        boxes = [
            b
            for r in range(rows)
            for b in (Box((r, 0), (1, r + 1)), Box((r, r + 1), (1, rows - r)))
        ]
        counters = _counting(monkeypatch)
        monkeypatch.setattr(pieces, "_CORNER_DIMS", 0)
        monkeypatch.setattr(pieces, "_CORNER_BUDGET", 0)
        check_tiling(shape, boxes)
        # row 0's first piece grows over (0, 1), row 1's last piece shrinks: the same count
        grown = [Box((0, 0), (1, 2)), *boxes[1:3], Box((1, 2), (1, rows - 2)), *boxes[4:]]
        with pytest.raises(ValueError, match=r"overlaps .*\[0, 1\]"):
            check_tiling(shape, grown)
        counts[len(boxes)] = sum(c.calls for c in counters)
        monkeypatch.undo()
    _linear(counts)


@settings(max_examples=300, deadline=None)
@given(near_tilings(), near_tilings())
def test_indexed_reads_are_plan_reads(case, other):
    """The indexed plan gives what ``plan_reads`` gives: the same reads, or the same error."""
    # imported here: the counting tests above also run (and fail) against the code before it
    from lightning_incremental.core.load.scatter import PieceReads

    shape, boxes = case
    plan = PieceReads(boxes)
    wanted = [Box(tuple(0 for _ in shape), shape), *other[1][:3]]
    for box in wanted:
        try:
            expect = plan_reads(boxes, box)
        except ValueError as exc:
            with pytest.raises(ValueError) as got:
                plan(box)
            assert str(got.value) == str(exc)
        else:
            assert plan(box) == expect


@pytest.mark.parametrize("n", [256, 4096])
def test_a_resharded_plan_triggers_no_garbage_collection_growing_with_the_pieces(n: int) -> None:
    """A plan makes a few objects per stored piece and wanted box, all live until the restore
    ends: each collection they triggered scanned them again (two fifths of planning 4,096
    pieces onto 2,048 boxes). Planning pauses collection: their number does not grow with the
    pieces."""
    import gc

    full = torch.arange(4 * n * 2, dtype=torch.float32).reshape(4 * n, 2)
    entry, recipes, _ = _stored(full, _rows(4 * n, list(range(4, 4 * n, 4)), 2), 16)
    wanted = _rows(4 * n, list(range(8, 4 * n, 8)), 2)
    outs = [torch.zeros(box.sizes) for box in wanted]
    with collections_started() as started:
        targets = piece_targets(entry, Regions(tuple(zip(outs, wanted))), recipes)
    assert len(targets) == n
    assert len(started) <= 3, started  # the young generation, once collection resumes
    assert gc.isenabled()


def _boxes_in(dims: int):
    side = st.tuples(st.integers(0, 6), st.integers(0, 4))  # a start and a size, 0 allowed
    return st.lists(side, min_size=dims, max_size=dims).map(
        lambda s: (tuple(a for a, _ in s), tuple(a + n for a, n in s))
    )


@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_meets_is_whether_two_boxes_share_an_element(data) -> None:
    """The box test, spelled out as comparisons, against its definition: some element lies in
    both boxes (an empty box meets nothing)."""
    dims = data.draw(st.integers(1, 3))
    (lo_a, hi_a), (lo_b, hi_b) = data.draw(_boxes_in(dims)), data.draw(_boxes_in(dims))
    shared = any(
        all(a <= x < c and b <= x < d for x, a, c, b, d in zip(point, lo_a, hi_a, lo_b, hi_b))
        for point in itertools.product(range(11), repeat=dims)
    )
    assert boxindex.meets(lo_a, hi_a, lo_b, hi_b) == shared
