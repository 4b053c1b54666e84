"""Pieces of sharded tensors: what each rank holds of a global tensor, and what a reader with
another layout must read to fill its own shard.

A *piece* is a dense, row-major box of a global tensor: ``offsets`` (where it starts, per dim)
and ``sizes`` (its extent, per dim). A rank's local shard is one piece (``Shard``/``Replicate``
placements, FSDP1 ``ShardedTensor`` shards) or several (a ``_StridedShard`` whose rows are not
contiguous in the global tensor). Everything here except :func:`describe` is pure arithmetic on
boxes and needs no process group.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from lightning_incremental.core.format.boxindex import BoxIndex


class Box(NamedTuple):
    """A dense box of a tensor's index space: its first index and its extent, per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def stops(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def whole(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return Box(tuple(0 for _ in shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    if len(a.offsets) != len(b.offsets):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x, y) for x, y in zip(a.stops(), b.stops()))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi)))


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """The slices of ``outer``'s own tensor that hold ``inner`` (a box inside it)."""
    return tuple(
        slice(i - o, i - o + s) for i, o, s in zip(inner.offsets, outer.offsets, inner.sizes)
    )


class Read(NamedTuple):
    """Copy ``stored[piece][src]`` into ``wanted[dst]``; ``box`` is the global box copied."""

    piece: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    box: Box


# Exact-cover check (shared by plan_reads and check_tiling). Counting corners is linear in the
# pieces and exponential in the dims they split: always used up to _CORNER_DIMS split dims
# (2**6 = 64 corners a piece), beyond that while pieces * 2**dims <= _CORNER_BUDGET. Otherwise
# a sweep meeting each piece with the ones a BoxIndex finds overlapping it (near-linear for
# disjoint pieces), for at most _SWEEP_LIMIT pieces; more pieces split along that many dims are
# refused (real sharding splits 1-3 dims).
_CORNER_DIMS = 6
_CORNER_BUDGET = 1 << 22
_SWEEP_LIMIT = 1024


class _Fault(NamedTuple):
    """Why boxes do not cover a region exactly once: an element held by no box or by several
    (None when the sweep found the boxes disjoint but too few), and the boxes holding it."""

    element: tuple[int, ...] | None
    holders: tuple[int, ...]


def _holding(boxes: Sequence[Box], element: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(
        i
        for i, b in enumerate(boxes)
        if all(o <= x < o + s for o, s, x in zip(b.offsets, b.sizes, element))
    )


def _cover_fault(region: Box, boxes: Sequence[Box]) -> _Fault | None:
    """None when ``boxes`` (each non-empty and inside ``region``) hold every element of
    ``region`` exactly once; else an element held by no box or by several.

    Signed corners: in each dim ``1[a <= x < b] = 1[x >= a] - 1[x >= b]``, so the indicator of
    a box ``[a, b)`` is the sum over its ``2**d`` corners ``c`` (each coordinate taken from
    ``a`` or ``b``) of ``(-1)**(coordinates taken from b) * 1[x >= c]``, an orthant indicator.
    Summing the signs per corner point over the boxes, minus the region's own, gives weights
    ``w`` with ``count(x) - 1[x in region] = sum of w(c) over the points c <= x``. Take the
    lexicographically smallest point ``p`` with ``w(p) != 0``: no other point with a weight is
    ``<= p`` (it would be lexicographically smaller), so the sum at ``p`` is ``w(p) != 0``.
    ``p`` lies inside the region (a point outside it is outside every box too, where the sum is
    0), so it is an element held ``1 + w(p) != 1`` times. Hence the boxes cover the region
    exactly once iff every weight is 0, and when they do not, ``p`` names where: O(n * 2**d).
    Dims every box spans whole carry no information and are dropped first (so are dims of
    size 1); past the corner budget a bounded pairwise sweep is used instead.

    Raises:
        ValueError: more than ``_SWEEP_LIMIT`` boxes split the region along so many dims that
            neither check is affordable.
    """
    if region.numel == 0:
        return None if not boxes else _Fault(boxes[0].offsets, (0,))
    ndim = len(region.offsets)
    split = [
        d
        for d in range(ndim)
        if any(b.offsets[d] != region.offsets[d] or b.sizes[d] != region.sizes[d] for b in boxes)
    ]
    k = len(split)
    n = len(boxes)
    if k <= _CORNER_DIMS or n << k <= _CORNER_BUDGET:
        found = _corner_fault(region, boxes, split)
        return None if found is None else _Fault(found, _holding(boxes, found))
    if n > _SWEEP_LIMIT:
        raise ValueError(
            f"{n} pieces split the tensor along {k} dims: checking that they tile it would take "
            f"{n} x 2**{k} corner counts or up to {n * (n - 1) // 2} pairwise comparisons; at "
            f"most {_SWEEP_LIMIT} pieces are accepted when more than {_CORNER_DIMS} dims are "
            "split (real sharding splits 1-3 dims)"
        )
    return _sweep_fault(region, boxes)


def _corner_fault(
    region: Box, boxes: Sequence[Box], split: Sequence[int]
) -> tuple[int, ...] | None:
    signs = [math.prod(s) for s in itertools.product((1, -1), repeat=len(split))]
    weights: dict[tuple[int, ...], int] = {}
    get = weights.get
    for box, scale in itertools.chain(((b, 1) for b in boxes), ((region, -1),)):
        pairs = [(box.offsets[d], box.offsets[d] + box.sizes[d]) for d in split]
        for corner, sign in zip(itertools.product(*pairs), signs):
            weights[corner] = get(corner, 0) + scale * sign
    wrong = [point for point, w in weights.items() if w]
    if not wrong:
        return None
    first = min(wrong)
    element = list(region.offsets)
    for d, x in zip(split, first):
        element[d] = x
    return tuple(element)


def _sweep_fault(region: Box, boxes: Sequence[Box]) -> _Fault | None:
    ndim = len(region.offsets)
    dim = max(range(ndim), key=lambda d: len({b.offsets[d] for b in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[dim])
    place = {i: at for at, i in enumerate(order)}
    index = BoxIndex(boxes)
    for at, i in enumerate(order):
        # the first box in the sweep before this one that meets it (one still active)
        earlier = [a for a in index.meeting(boxes[i]) if place[a] < at]
        if earlier:
            common = intersect(boxes[i], boxes[min(earlier, key=place.__getitem__)])
            assert common is not None
            return _Fault(common.offsets, _holding(boxes, common.offsets))
    # disjoint boxes inside the region holding as many elements as it has: they cover it
    return None if sum(b.numel for b in boxes) == region.numel else _Fault(None, ())


def plan_reads(stored: Sequence[Box], wanted: Box) -> list[Read]:
    """Which parts of which stored pieces fill ``wanted``, each element exactly once.

    ``stored`` may hold the same box more than once (a replica reported twice): the first one is
    used. Partially overlapping distinct pieces are an error, as is a ``wanted`` element that no
    piece holds. Linear in the pieces (see :func:`_cover_fault`).

    Raises:
        ValueError: overlapping pieces, or ``wanted`` not covered.
    """
    reads: list[Read] = []
    seen: set[Box] = set()
    for index, box in enumerate(stored):
        if len(box.offsets) != len(wanted.offsets):
            raise ValueError(f"piece {index} {box} has another rank than {wanted}")
        if box in seen:
            continue
        seen.add(box)
        common = intersect(box, wanted) if wanted.numel else None
        if common is None:
            continue
        reads.append(Read(index, relative(common, box), relative(common, wanted), common))
    return checked_reads(stored, wanted, reads)


def checked_reads(stored: Sequence[Box], wanted: Box, reads: list[Read]) -> list[Read]:
    """``reads`` (of the pieces of ``stored`` that meet ``wanted``, the first of equal ones, in
    their order in ``stored``) when they fill ``wanted`` exactly once.

    Raises:
        ValueError: overlapping pieces, or ``wanted`` not covered.
    """
    fault = _cover_fault(wanted, [r.box for r in reads])
    if fault is None:
        return reads
    if len(fault.holders) > 1:
        first, second = (reads[i].piece for i in fault.holders[:2])
        raise ValueError(
            f"piece {second} {stored[second]} overlaps piece {first} {stored[first]}: both hold "
            f"element {list(fault.element or ())}"
        )
    covered = sum(r.box.numel for r in reads)
    where = "" if fault.element is None else f"; none holds element {list(fault.element)}"
    raise ValueError(
        f"the stored pieces cover {covered} of the {wanted.numel} elements of {wanted}"
        f"{', some more than once' if covered >= wanted.numel else ''}{where}"
    )


def check_tiling(global_shape: Sequence[int], stored: Sequence[Box]) -> None:
    """Non-empty pieces inside ``global_shape``, pairwise disjoint, covering it exactly: what a
    manifest's piece table must satisfy.

    Linear in the pieces for the layouts sharding makes (signed corner counts, see
    :func:`_cover_fault`); pieces split along many dims get a bounded pairwise sweep, or are
    refused when there are too many of them.

    Raises:
        ValueError: naming the first problem.
    """
    shape = tuple(global_shape)
    for box in stored:
        if len(box.sizes) != len(shape) or len(box.offsets) != len(shape):
            raise ValueError(f"piece {box} does not fit a tensor of shape {list(shape)}")
        if any(s <= 0 for s in box.sizes):
            raise ValueError(f"piece {box} is empty (a piece holds at least one element)")
        if any(o < 0 or e > g for o, e, g in zip(box.offsets, box.stops(), shape)):
            raise ValueError(f"piece {box} lies outside shape {list(shape)}")
    total = math.prod(shape)
    held = sum(box.numel for box in stored)
    if not shape:
        if len(stored) != 1:
            raise ValueError(f"a 0-dim tensor is one piece, not {len(stored)}")
        return
    if held != total:
        raise ValueError(f"the pieces hold {held} elements, the tensor {total}")
    fault = _cover_fault(whole(shape), stored)
    if fault is None:
        return
    element = list(fault.element or ())
    if len(fault.holders) > 1:
        first, second = (stored[i] for i in fault.holders[:2])
        raise ValueError(f"piece {second} overlaps piece {first}: both hold element {element}")
    # as many elements held as the tensor has, one of them by none: others by several
    raise ValueError(
        f"no piece holds element {element}, yet the pieces hold {held} elements: some overlap"
    )


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """The elements ``[start, stop)`` of a row-major array of ``shape`` as at most ``2*ndim - 1``
    boxes, each a contiguous run of those elements: ``(flat index of its first element, box)``,
    ascending. What a chunk of a stored piece holds, as boxes to copy from."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [(0, Box((), ()))]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    if inner == 0:
        return []
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    out: list[tuple[int, Box]] = []

    def under(row: int, boxes: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
        return [(row * inner + flat, Box((row, *b.offsets), (1, *b.sizes))) for flat, b in boxes]

    if r0:
        if i0 == i1:
            return under(i0, range_boxes(rest, r0, r1))
        out += under(i0, range_boxes(rest, r0, inner))
        i0 += 1
    if i1 > i0:
        out.append((i0 * inner, Box((i0, *(0 for _ in rest)), (i1 - i0, *rest))))
    if r1:
        out += under(i1, range_boxes(rest, 0, r1))
    return out


def flat_runs(shape: Sequence[int], region: Sequence[slice]) -> list[tuple[int, int]]:
    """The element ranges ``[start, stop)`` of a row-major array of ``shape`` that ``region``
    covers, ascending and merged."""
    if not shape:
        return [(0, 1)]
    if any(s.stop <= s.start for s in region):
        return []
    ndim = len(shape)
    inner = ndim
    while inner > 0 and region[inner - 1].start == 0 and region[inner - 1].stop == shape[inner - 1]:
        inner -= 1
    if inner == 0:
        return [(0, math.prod(shape))]
    tail = math.prod(shape[inner:])
    run_dim = inner - 1
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    runs: list[tuple[int, int]] = []
    lead = [range(region[d].start, region[d].stop) for d in range(run_dim)]
    for index in itertools.product(*lead):
        base = sum(i * strides[d] for d, i in enumerate(index))
        start = base + region[run_dim].start * tail
        stop = base + region[run_dim].stop * tail
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    return runs


# ------------------------------------------------------------------ placements -> indices


def shard_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> list[Sequence[int]]:
    """For each dim of the global tensor, the global indices a mesh coordinate holds, in the
    order of its local tensor (a ``range`` when they are consecutive, the usual case).
    DTensor's own rules (``torch.chunk`` splits: uneven splits give the last ranks less,
    possibly nothing; ``_StridedShard`` interleaves). Exact where DTensor's
    ``compute_local_shape_and_global_offset`` (first index only) is not: ``(Shard(d),
    _StridedShard(d))`` layouts, whose rows are interleaved.

    Raises:
        ValueError: a ``Partial`` placement (unreduced values cannot be saved).
    """
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

    indices: list[Sequence[int]] = [range(n) for n in global_shape]
    local = list(global_shape)
    previous: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"a Partial placement holds unreduced values; redistribute to Replicate before "
                f"saving ({list(placements)})"
            )
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        dim = placement.dim
        size, offsets = _get_shard_size_and_offsets(
            local[dim],
            int(mesh_shape[mesh_dim]),
            int(coordinate[mesh_dim]),
            placement,
            previous.get(dim),
            global_shape[dim],
            False,
        )
        local[dim] = size
        previous[dim] = (
            offsets if size and offsets is not None else torch.empty(0, dtype=torch.long)
        )
    for dim, offsets in previous.items():
        held = offsets[: local[dim]]
        first = int(held[0]) if local[dim] else 0
        consecutive = range(first, first + local[dim])
        if local[dim] and torch.equal(held, torch.arange(first, consecutive.stop)):
            indices[dim] = consecutive
        else:
            indices[dim] = [int(i) for i in held.tolist()]
    return indices


def runs_of(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: (local start, global start, length)."""
    if isinstance(indices, range) and indices.step == 1:
        return [(0, indices.start, len(indices))] if len(indices) else []
    runs: list[tuple[int, int, int]] = []
    for pos, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, g, 1))
    return runs


def local_boxes(indices: Sequence[Sequence[int]]) -> list[tuple[tuple[slice, ...], Box]]:
    """A local shard as dense global boxes: (slices of the local tensor, its global box)."""
    if not indices:
        return [((), Box((), ()))]
    per_dim = [runs_of(ix) for ix in indices]
    return [
        (
            tuple(slice(at, at + n) for at, _, n in combo),
            Box(tuple(g for _, g, _ in combo), tuple(n for _, _, n in combo)),
        )
        for combo in itertools.product(*per_dim)
    ]


def writes_replica(placements: Sequence[Any], coordinate: Sequence[int]) -> bool:
    """Whether this coordinate writes its pieces: of the ranks holding the same pieces (those
    differing only along ``Replicate`` mesh dims) exactly one, the one at index 0 along them."""
    from torch.distributed.tensor.placement_types import Replicate

    return all(c == 0 for p, c in zip(placements, coordinate) if isinstance(p, Replicate))


# ------------------------------------------------------------------ live tensors


class LocalPiece(NamedTuple):
    """A piece of a global tensor this process holds."""

    tensor: torch.Tensor  # a view of the live local data (no copy)
    box: Box
    write: bool  # False: another rank holds the same piece and writes it


def sharded_kind(value: Any) -> str | None:
    """``"dtensor"``, ``"sharded_tensor"`` (FSDP1's ``ShardedTensor``) or None."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if isinstance(value, DTensor):
        return "dtensor"
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return None
    return "sharded_tensor" if isinstance(value, ShardedTensor) else None


def global_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The global shape of a DTensor or ShardedTensor (a plain tensor's own)."""
    if sharded_kind(value) == "sharded_tensor":
        return tuple(value.size())
    return tuple(value.shape)


def spans_processes(value: torch.Tensor) -> int:
    """How many processes a sharded tensor is spread over (1 for a plain tensor)."""
    kind = sharded_kind(value)
    if kind == "dtensor":
        return int(value.device_mesh.size())  # type: ignore[attr-defined]
    if kind == "sharded_tensor":
        return len({p.placement.rank() for p in value.metadata().shards_metadata})  # type: ignore[attr-defined]
    return 1


def describe(value: torch.Tensor) -> list[LocalPiece]:
    """This process's pieces of a DTensor or ``ShardedTensor`` (views of its local data, no
    copy); a plain tensor is one piece, the whole of it. Empty local shards have no piece.

    Raises:
        ValueError: a ``Partial`` placement, or a local shard that does not match its placements.
    """
    kind = sharded_kind(value)
    if kind == "dtensor":
        mesh = value.device_mesh  # type: ignore[attr-defined]
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the mesh
            return []
        shape = tuple(value.shape)
        placements = value.placements  # type: ignore[attr-defined]
        indices = shard_indices(shape, tuple(mesh.shape), coordinate, placements)
        local = value.to_local()  # type: ignore[attr-defined]
        expect = tuple(len(ix) for ix in indices)
        if tuple(local.shape) != expect:
            raise ValueError(
                f"local shard of shape {list(local.shape)}, but its placements give {list(expect)}"
            )
        write = writes_replica(placements, coordinate)
        return [
            LocalPiece(local[sl], box, write) for sl, box in local_boxes(indices) if box.numel > 0
        ]
    if kind == "sharded_tensor":
        return [
            LocalPiece(
                s.tensor,
                Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)),
                True,
            )
            for s in value.local_shards()  # type: ignore[attr-defined]
            if math.prod(s.metadata.shard_sizes) > 0
        ]
    shape = tuple(value.shape)
    return [LocalPiece(value, whole(shape), True)] if math.prod(shape) or not shape else []
