"""Property tests of the piece model (pure parts; DTensor itself as ground truth, in-process)."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from lightning_incremental.core.format import pieces
from lightning_incremental.core.format.pieces import (
    Box,
    check_tiling,
    flat_runs,
    local_boxes,
    plan_reads,
    range_boxes,
    shard_indices,
    writes_replica,
)

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@st.composite
def guillotine(draw, shape):
    """A random tiling of ``shape`` by recursive cuts (not necessarily a grid)."""
    boxes: list[Box] = []

    def split(box: Box, depth: int) -> None:
        cuttable = [d for d, s in enumerate(box.sizes) if s > 1]
        if depth > 4 or not cuttable or draw(st.booleans()):
            boxes.append(box)
            return
        d = draw(st.sampled_from(cuttable))
        at = draw(st.integers(1, box.sizes[d] - 1))
        left = Box(box.offsets, box.sizes[:d] + (at,) + box.sizes[d + 1 :])
        right = Box(
            box.offsets[:d] + (box.offsets[d] + at,) + box.offsets[d + 1 :],
            box.sizes[:d] + (box.sizes[d] - at,) + box.sizes[d + 1 :],
        )
        split(left, depth + 1)
        split(right, depth + 1)

    if math.prod(shape) == 0:
        return []
    split(Box(tuple(0 for _ in shape), tuple(shape)), 0)
    return boxes


@st.composite
def grid(draw, shape):
    """A random grid tiling: random cut points per dim (the layout of N-d DTensor shards)."""
    if math.prod(shape) == 0:
        return []
    per_dim = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        edges = [0, *cuts, n]
        per_dim.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    return [
        Box(tuple(o for o, _ in c), tuple(s for _, s in c)) for c in itertools.product(*per_dim)
    ]


@st.composite
def region(draw, shape):
    offsets, sizes = [], []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        offsets.append(a)
        sizes.append(b - a)
    return Box(tuple(offsets), tuple(sizes))


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


@st.composite
def stored_and_wanted(draw):
    shape = draw(shapes)
    tiling = draw(st.one_of(guillotine(shape), grid(shape)))
    # a few replicated duplicates, in random order
    dupes = draw(st.lists(st.sampled_from(tiling), max_size=3)) if tiling else []
    pieces = draw(st.permutations(tiling + dupes))
    return shape, pieces, draw(region(shape))


@settings(max_examples=400, deadline=None)
@given(stored_and_wanted(), st.sampled_from([torch.float32, torch.bfloat16, torch.int8]))
def test_assembly_is_exact_and_covers_once(case, dtype):
    shape, pieces, wanted = case
    full = (torch.randn(shape) * 100).to(dtype)
    if math.prod(shape):
        check_tiling(shape, list(dict.fromkeys(pieces)))  # a manifest lists each piece once
        if len(set(pieces)) < len(pieces):
            with pytest.raises(ValueError):
                check_tiling(shape, pieces)
    stored = [full[_slices(b)].clone() for b in pieces]
    reads = plan_reads(pieces, wanted)
    out = torch.empty(wanted.sizes, dtype=dtype)
    count = torch.zeros(wanted.sizes, dtype=torch.int32)
    for r in reads:
        out[r.dst] = stored[r.piece][r.src]
        count[r.dst] += 1
    assert bool((count == 1).all())
    assert _bits(out) == _bits(full[_slices(wanted)])
    assert len({r.piece for r in reads}) == len(reads)  # each piece read at most once


@settings(max_examples=200, deadline=None)
@given(stored_and_wanted(), st.data())
def test_missing_or_overlapping_piece_is_refused(case, data):
    shape, pieces, _ = case
    distinct = list(dict.fromkeys(pieces))
    if not distinct:
        return
    whole = Box(tuple(0 for _ in shape), tuple(shape))
    victim = data.draw(st.integers(0, len(distinct) - 1))
    with pytest.raises(ValueError, match="cover"):
        plan_reads(distinct[:victim] + distinct[victim + 1 :], whole)
    grow = [d for d in range(len(shape)) if distinct[victim].stops()[d] < shape[d]]
    if grow:  # stretch one piece into its neighbour
        d = data.draw(st.sampled_from(grow))
        b = distinct[victim]
        big = Box(b.offsets, b.sizes[:d] + (b.sizes[d] + 1,) + b.sizes[d + 1 :])
        with pytest.raises(ValueError, match=r"overlaps|hold"):
            check_tiling(shape, distinct[:victim] + [big] + distinct[victim + 1 :])


def test_tiling_sweep_finds_an_overlap_that_keeps_the_count():
    # two pieces overlap and together leave a gap of the same size: only the sweep sees it
    with pytest.raises(ValueError, match="overlaps"):
        check_tiling((4, 2), [Box((0, 0), (2, 2)), Box((1, 0), (2, 2))])
    with pytest.raises(ValueError, match="empty"):
        check_tiling((2,), [Box((0,), (2,)), Box((1,), (0,))])


def test_outside_and_rank_mismatch():
    with pytest.raises(ValueError, match="outside"):
        check_tiling((4,), [Box((0,), (5,))])
    with pytest.raises(ValueError, match="rank"):
        plan_reads([Box((0, 0), (2, 2))], Box((0,), (2,)))


# --- exact cover: near-linear, and the same answer as counting every element ----------------


def _counts(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        count[_slices(b)] += 1
    return count


@st.composite
def near_tilings(draw):
    """A tiling of a small shape, then perhaps damaged: a piece dropped, duplicated, grown,
    shrunk or shifted (the damage a manifest could carry)."""
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple))
    boxes = list(dict.fromkeys(draw(st.one_of(guillotine(shape), grid(shape)))))
    for _ in range(draw(st.integers(0, 2))):
        if not boxes or not shape:
            break
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        d = draw(st.integers(0, len(shape) - 1))
        kind = draw(st.sampled_from(["drop", "dup", "grow", "shrink", "shift"]))
        if kind == "drop":
            del boxes[i]
        elif kind == "dup":
            boxes.append(b)
        elif kind == "grow" and b.stops()[d] < shape[d]:
            boxes[i] = Box(b.offsets, b.sizes[:d] + (b.sizes[d] + 1,) + b.sizes[d + 1 :])
        elif kind == "shrink" and b.sizes[d] > 1:
            boxes[i] = Box(b.offsets, b.sizes[:d] + (b.sizes[d] - 1,) + b.sizes[d + 1 :])
        elif kind == "shift" and b.stops()[d] < shape[d]:
            at = b.offsets[:d] + (b.offsets[d] + 1,) + b.offsets[d + 1 :]
            boxes[i] = Box(at, b.sizes)
    return shape, draw(st.permutations(boxes))


def _agrees_with_brute_force(shape: tuple[int, ...], boxes: list[Box]) -> None:
    exact = bool((_counts(shape, boxes) == 1).all()) if shape else len(boxes) == 1
    if exact:
        check_tiling(shape, boxes)
    else:
        with pytest.raises(ValueError, match=r"overlaps|hold|cover|0-dim"):
            check_tiling(shape, boxes)
    wanted = Box(tuple(0 for _ in shape), tuple(shape))
    distinct = list(dict.fromkeys(boxes))  # plan_reads skips a repeated box
    exact = bool((_counts(shape, distinct) == 1).all()) if shape else len(distinct) == 1
    if exact:
        reads = plan_reads(boxes, wanted)
        assert sum(r.box.numel for r in reads) == wanted.numel
    else:
        with pytest.raises(ValueError, match=r"overlaps|cover"):
            plan_reads(boxes, wanted)


@settings(max_examples=500, deadline=None)
@given(near_tilings())
def test_tiling_check_agrees_with_counting_every_element(case):
    shape, boxes = case
    _agrees_with_brute_force(shape, boxes)


@settings(max_examples=150, deadline=None)
@given(near_tilings())
def test_bounded_sweep_agrees_with_counting_every_element(case):
    """The fallback for pieces split along many dims gives the same answers."""
    shape, boxes = case
    with mock.patch.multiple(pieces, _CORNER_DIMS=0, _CORNER_BUDGET=0):
        _agrees_with_brute_force(shape, boxes)


class _Counted:
    """``intersect`` wrapped to count its calls: the work a check does, not its wall time."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = pieces.intersect

    def __call__(self, a: Box, b: Box) -> Box | None:
        self.calls += 1
        return self.inner(a, b)


def _unit_grid(n: int) -> list[Box]:
    return [Box((i, j), (1, 1)) for i in range(n) for j in range(n)]


def test_tiling_and_reads_do_linear_work_on_a_grid_of_tiny_pieces(monkeypatch):
    boxes = _unit_grid(40)  # 1600 pieces: a quadratic check does ~1.3M intersections
    counted = _Counted()
    monkeypatch.setattr(pieces, "intersect", counted)
    check_tiling((40, 40), boxes)
    reads = plan_reads(boxes, Box((0, 0), (40, 40)))
    assert len(reads) == len(boxes)
    assert counted.calls <= 2 * len(boxes)


@pytest.mark.timeout(120)
def test_a_grid_of_40k_pieces_validates_and_one_fault_in_it_is_found():
    n = 200
    boxes = _unit_grid(n)
    shape = (n, n)
    wanted = Box((0, 0), shape)
    check_tiling(shape, boxes)
    assert len(plan_reads(boxes, wanted)) == n * n
    # a gap
    gap = boxes[: 123 * n + 45] + boxes[123 * n + 46 :]
    with pytest.raises(ValueError, match="hold 39999 elements"):
        check_tiling(shape, gap)
    with pytest.raises(ValueError, match=r"cover .*\[123, 45\]"):
        plan_reads(gap, wanted)
    # an overlap that keeps the count: (150, 7) grows over (150, 8) and (150, 9) is dropped, so
    # the pieces still hold 40000 elements
    at = 150 * n + 7
    grown = [*boxes[:at], Box((150, 7), (1, 2)), boxes[at + 1], *boxes[at + 3 :]]
    with pytest.raises(ValueError, match=r"overlaps .*\[150, 8\]"):
        check_tiling(shape, grown)
    with pytest.raises(ValueError, match=r"overlaps .*\[150, 8\]"):
        plan_reads(grown, wanted)
    # an overlap that keeps the count and leaves a gap before it
    moved = [Box((0, 0), (1, 1)) if b == Box((0, 1), (1, 1)) else b for b in boxes]
    with pytest.raises(ValueError, match=r"overlaps|element \[0, 1\]"):
        check_tiling(shape, moved)


def test_pieces_split_along_too_many_dims_are_refused_not_checked_for_minutes():
    shape = (2,) * 14
    boxes = [Box(c, (1,) * 14) for c in itertools.product((0, 1), repeat=14)]  # 16384 pieces
    with pytest.raises(ValueError, match=r"16384 pieces .* 14 dims"):
        check_tiling(shape, boxes)


def test_dims_every_piece_spans_cost_nothing():
    # 30 dims, split along one: the 29 others are dropped before the corners are counted
    shape = (4,) + (1,) * 20 + (3,) * 9
    rest = (0,) * 29
    boxes = [Box((i, *rest), (1, *shape[1:])) for i in range(4)]
    check_tiling(shape, boxes)
    assert len(plan_reads(boxes, Box((0,) * 30, shape))) == 4


@settings(max_examples=400, deadline=None)
@given(shapes.flatmap(lambda s: st.tuples(st.just(s), region(s))))
def test_flat_runs_match_brute_force(case):
    shape, box = case
    ids = np.arange(math.prod(shape)).reshape(shape)
    expect = np.sort(ids[_slices(box)].reshape(-1))
    runs = flat_runs(shape, _slices(box))
    got = np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.empty(0, int)
    assert np.array_equal(got, expect)
    assert all(b0 < a1 for (_, b0), (a1, _) in itertools.pairwise(runs))  # merged, ascending


@settings(max_examples=300, deadline=None)
@given(
    shapes.flatmap(lambda s: st.tuples(st.just(s), st.integers(0, max(math.prod(s), 1)))).flatmap(
        lambda c: st.tuples(
            st.just(c[0]), st.just(c[1]), st.integers(c[1], max(math.prod(c[0]), 1))
        )
    )
)
def test_range_boxes_are_the_range_in_order(case):
    shape, start, stop = case
    total = math.prod(shape)
    stop = min(stop, total)
    start = min(start, stop)
    ids = np.arange(total).reshape(shape)
    got = []
    for flat, box in range_boxes(shape, start, stop):
        block = ids[_slices(box)].reshape(-1)
        assert list(block) == list(range(flat, flat + box.numel))  # contiguous, starting there
        got += list(block)
    assert got == list(range(start, stop))
    assert len(range_boxes(shape, start, stop)) <= max(2 * len(shape) - 1, 1)


# --- placements ------------------------------------------------------------------------------

placement = st.one_of(
    st.just(Replicate()),
    st.integers(0, 2).map(Shard),
    st.tuples(st.integers(0, 2), st.integers(2, 3)).map(
        lambda t: _StridedShard(t[0], split_factor=t[1])
    ),
)


@st.composite
def layouts(draw):
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    pls = []
    for _ in mesh:
        p = draw(placement)
        if isinstance(p, (Shard, _StridedShard)) and p.dim >= len(shape):
            p = Replicate()
        pls.append(p)
    return shape, mesh, tuple(pls)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_shard_indices_tile_the_global_tensor(layout):
    shape, mesh, pls = layout
    seen: dict[Box, tuple[int, ...]] = {}
    writers: list[Box] = []
    for coord in itertools.product(*(range(m) for m in mesh)):
        ix = shard_indices(shape, mesh, coord, pls)
        local_shape, first = _compute_local_shape_and_global_offset(shape, mesh, list(coord), pls)
        assert tuple(len(i) for i in ix) == tuple(local_shape)
        for d, i in enumerate(ix):
            if i:
                assert i[0] == first[d]  # DCP's offset is our first index
        boxes = [b for _, b in local_boxes(ix) if b.numel]
        if writes_replica(pls, coord):
            writers += boxes
        for b in boxes:
            seen.setdefault(b, coord)
    if math.prod(shape):
        check_tiling(shape, writers)  # the written pieces tile the tensor exactly once
        assert set(writers) == set(seen)  # and every held piece is written by someone


def test_chunk_semantics_uneven_and_empty():
    # 5 rows over 4 ranks: torch.chunk gives 2, 2, 1, 0
    sizes = [len(shard_indices((5,), (4,), (r,), (Shard(0),))[0]) for r in range(4)]
    assert sizes == [2, 2, 1, 0]
    assert [list(ix) for ix in shard_indices((1, 3), (4,), (3,), (Shard(0),))] == [[], [0, 1, 2]]


def test_strided_shard_is_several_pieces():
    ix = shard_indices((8, 4), (2, 2), (0, 0), (Shard(0), _StridedShard(0, split_factor=2)))
    assert ix[0] == [0, 2]
    assert [b for _, b in local_boxes(ix)] == [Box((0, 0), (1, 4)), Box((2, 0), (1, 4))]
    # FSDP2 + TP on the same dim: contiguous, one piece
    ix = shard_indices((8, 4), (2, 2), (1, 0), (_StridedShard(0, split_factor=2), Shard(0)))
    assert list(ix[0]) == [2, 3]


def test_partial_is_refused():
    with pytest.raises(ValueError, match="Partial"):
        shard_indices((4,), (2,), (0,), (Partial(),))


def test_zero_dim_is_one_piece():
    assert local_boxes(shard_indices((), (2,), (1,), (Replicate(),))) == [((), Box((), ()))]


# --- ground truth: DTensor itself, 4 simulated ranks in this process (LocalTensorMode) -------


@pytest.fixture(scope="module")
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


@st.composite
def four_rank_layouts(draw):
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = draw(st.sampled_from([(2, 2), (4,), (1, 4)]))
    pls = []
    for _ in mesh:
        p = draw(placement)
        if isinstance(p, (Shard, _StridedShard)) and p.dim >= len(shape):
            p = Replicate()
        pls.append(p)
    return shape, mesh, tuple(pls)


@settings(max_examples=60, deadline=None)
@given(four_rank_layouts())
def test_local_shards_match_dtensor(fake_world, layout):
    """Each simulated rank's local tensor, from DTensor's own redistribute, is exactly the global
    tensor at our indices; and our pieces rebuild it."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    shape, mesh_shape, pls = layout
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", mesh_shape)
        dt = distribute_tensor(full, mesh, [Replicate()] * len(mesh_shape)).redistribute(mesh, pls)
        lt = dt._local_tensor
        locals_ = {
            r: lt._local_tensors[r] if hasattr(lt, "_local_tensors") else lt for r in range(4)
        }
    for r in range(4):
        coord = list(np.unravel_index(r, mesh_shape))
        ix = shard_indices(shape, mesh_shape, coord, pls)
        expect = full
        for d, i in enumerate(ix):
            expect = expect.index_select(d, torch.tensor(i, dtype=torch.long))
        assert torch.equal(locals_[r], expect), (r, ix)
        for sl, box in local_boxes(ix):
            if box.numel:
                assert torch.equal(locals_[r][sl], full[_slices(box)])
