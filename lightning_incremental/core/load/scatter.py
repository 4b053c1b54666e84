"""Restoring boxes of a tensor from its stored pieces: which pieces, which of their chunks, and
where each decoded chunk's elements go.

A tensor is stored as pieces (dense boxes of the global tensor, one per rank that held it) or as
one whole array. A reader wants other boxes: its own local shards under another layout, or the
whole tensor. For every wanted box, :class:`PieceReads` picks the overlapping stored pieces (what
:func:`~lightning_incremental.core.format.pieces.plan_reads` picks, found through a
:class:`~lightning_incremental.core.format.boxindex.BoxIndex` rather than by testing every
piece); of each, only the chunks holding overlapping elements are read.
A chunk is a contiguous run of its piece's row-major elements, i.e. at most ``2*ndim - 1`` boxes
(:func:`~lightning_incremental.core.format.pieces.range_boxes`); each box's overlap with a wanted
box is one tensor copy. Memory: one chunk of scratch per decode in flight, never a whole piece.
Work: about ``(pieces + boxes + chunks) * log`` box tests plus the copies, never pieces times
boxes or chunks times boxes.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightning_incremental.core.buffers import collection_paused
from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.format.boxindex import BoxIndex
from lightning_incremental.core.format.pieces import (
    Box,
    Read,
    checked_reads,
    intersect,
    range_boxes,
    relative,
)
from lightning_incremental.core.format.records import ChunkRecipe, TensorEntry
from lightning_incremental.core.format.tree import torch_dtype
from lightning_incremental.core.load.targets import ChunkTarget, Regions, Staged


class PieceReads:
    """:func:`~lightning_incremental.core.format.pieces.plan_reads` of ``stored`` for many
    wanted boxes: the same reads and the same errors, but each wanted box is only tested
    against the stored pieces an index finds overlapping it."""

    def __init__(self, stored: Sequence[Box]) -> None:
        self.stored = stored
        first: dict[Box, int] = {}
        for index, box in enumerate(stored):
            first.setdefault(box, index)  # a repeated box: the first one is read
        self.pieces = list(first.values())
        self.index = BoxIndex([stored[i] for i in self.pieces])
        self.ranks = {len(box.offsets) for box in stored}

    def __call__(self, wanted: Box) -> list[Read]:
        """Which parts of which stored pieces fill ``wanted``, each element exactly once.

        Raises:
            ValueError: a piece of another rank, overlapping pieces, or ``wanted`` not covered.
        """
        if self.ranks - {len(wanted.offsets)}:
            index = next(
                i for i, b in enumerate(self.stored) if len(b.offsets) != len(wanted.offsets)
            )
            raise ValueError(f"piece {index} {self.stored[index]} has another rank than {wanted}")
        reads = []
        for at in self.index.meeting(wanted) if wanted.numel else ():
            index = self.pieces[at]
            box = self.stored[index]
            common = intersect(box, wanted)
            if common is not None:
                reads.append(Read(index, relative(common, box), relative(common, wanted), common))
        return checked_reads(self.stored, wanted, reads)


def _local(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a piece starting at ``origin``."""
    return Box(tuple(o - p for o, p in zip(box.offsets, origin.offsets)), box.sizes)


def _starts(chunk_bytes: Sequence[int]) -> list[int]:
    """The byte offset of each chunk, then the end of the last."""
    return list(itertools.accumulate(chunk_bytes, initial=0))


def _staged(
    sizes: tuple[int, ...],
    starts: Sequence[int],
    itemsize: int,
    boxes: BoxIndex,
    owner: Mapping[int, int],
) -> set[int]:
    """Indices of the chunks of a piece of ``sizes`` (chunk ``i``: bytes ``starts[i]`` to
    ``starts[i + 1]``) holding an element of a box of ``boxes`` (piece coordinates) other than
    the one at ``owner[i]``, if any. A few box queries per chunk, whatever the boxes."""
    needed = set()
    for index in range(len(starts) - 1):
        e0, e1 = starts[index] // itemsize, starts[index + 1] // itemsize
        skip = owner.get(index)
        if any(boxes.meets_any(b, skip) for _, b in range_boxes(sizes, e0, e1)):
            needed.add(index)
    return needed


def wanted_chunks(
    sizes: tuple[int, ...], chunk_bytes: Sequence[int], itemsize: int, boxes: Sequence[Box]
) -> frozenset[int]:
    """Indices of the chunks of a piece of ``sizes`` (chunks of ``chunk_bytes`` bytes, in
    order) that hold an element of one of ``boxes`` (piece coordinates)."""
    return frozenset(_staged(sizes, _starts(chunk_bytes), itemsize, BoxIndex(boxes), {}))


@dataclass(frozen=True)
class _Scatter:
    """Copies the elements of a decoded chunk of one piece into the destinations that want
    them: ``copies`` are (box in piece coordinates, destination view of that box's sizes),
    ``index`` indexes their boxes."""

    sizes: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    copies: tuple[tuple[Box, torch.Tensor], ...]
    index: BoxIndex

    def __call__(self, offset: int, data: np.ndarray) -> None:
        first = offset // self.itemsize
        values = torch.from_numpy(data).view(self.dtype)
        for flat, box in range_boxes(self.sizes, first, first + values.numel()):
            block = values[flat - first : flat - first + box.numel].view(box.sizes)
            for at in self.index.meeting(box):
                want, dst = self.copies[at]
                common = intersect(box, want)
                if common is not None:
                    dst[relative(common, want)].copy_(block[relative(common, box)])


def _direct(view: torch.Tensor) -> np.ndarray | None:
    """The flat bytes of ``view`` to decode into directly, when it is plain host memory."""
    if view.device.type != "cpu" or not view.is_contiguous() or view.is_conj() or view.is_neg():
        return None
    return view.reshape(-1).view(torch.uint8).numpy()


def _direct_in(
    sizes: tuple[int, ...], starts: Sequence[int], itemsize: int, want: Box, flat: np.ndarray
) -> dict[int, np.ndarray]:
    """:func:`direct_chunks`, the chunks given by their ``starts`` (see :func:`_staged`):
    found by bisection, so a box costs its own chunks and a log, not every chunk."""
    if tuple(want.offsets[1:]) != tuple(0 for _ in sizes[1:]) or want.sizes[1:] != sizes[1:]:
        return {}
    row = math.prod(sizes[1:]) * itemsize
    lo = (want.offsets[0] if sizes else 0) * row
    hi = lo + flat.size
    out = {}
    index = bisect.bisect_left(starts, lo)
    while index < len(starts) - 1 and starts[index + 1] <= hi:
        start, stop = starts[index], starts[index + 1]
        out[index] = flat[start - lo : stop - lo]
        index += 1
    return out


def direct_chunks(
    sizes: tuple[int, ...],
    chunk_bytes: Sequence[int],
    itemsize: int,
    want: Box,
    flat: np.ndarray,
) -> dict[int, np.ndarray]:
    """The chunks of a piece of ``sizes`` whose elements all fall in ``want`` (piece
    coordinates) where ``want`` is whole rows of the piece (full extent in every dim but the
    first), each with the part of ``flat`` (the destination's bytes of ``want``, row-major) it
    decodes straight into: those chunks need no scratch and no scatter."""
    return _direct_in(sizes, _starts(chunk_bytes), itemsize, want, flat)


def piece_targets(
    entry: TensorEntry, regions: Regions, chunks: Mapping[str, ChunkRecipe]
) -> list[ChunkTarget]:
    """What to decode, and where, to fill ``regions`` with the tensor ``entry`` stores. A chunk
    that lands whole in one contiguous run of a destination in host memory (a piece read whole,
    or rows of it) is decoded straight into it; the others are decoded into scratch and their
    overlapping parts copied into place.

    Collection is paused meanwhile: a plan makes a few objects per stored piece and wanted
    box, every one live until the restore ends, and the collections they would trigger scan
    them again and again (at 4,096 pieces, two fifths of a resharded plan's time, growing
    faster than the pieces).

    Raises:
        CorruptCheckpointError: the stored pieces do not cover a wanted box.
    """
    with collection_paused():
        return _piece_targets(entry, regions, chunks)


def _piece_targets(
    entry: TensorEntry, regions: Regions, chunks: Mapping[str, ChunkRecipe]
) -> list[ChunkTarget]:
    stored = entry.stored_pieces()
    plan = PieceReads([box for box, _ in stored])
    copies: dict[int, list[tuple[Box, torch.Tensor]]] = defaultdict(list)
    for view, box in regions.parts:
        if box.numel == 0:
            continue
        try:
            reads = plan(box)
        except ValueError as exc:
            raise CorruptCheckpointError(f"tensor {entry.path}: {exc}") from exc
        for read in reads:
            copies[read.piece].append((read.box, view[read.dst]))
    dtype = torch_dtype(entry.dtype)
    itemsize = dtype.itemsize
    items = []
    for index, wanted in sorted(copies.items()):
        piece, hashes = stored[index]
        local = tuple((_local(box, piece), view) for box, view in wanted)
        boxes = BoxIndex([box for box, _ in local])
        sizes = [chunks[d].size for d in hashes]
        starts = _starts(sizes)
        direct: dict[int, np.ndarray] = {}
        owner: dict[int, int] = {}  # a chunk decoded straight into a box: which one
        for at, (box, view) in enumerate(local):
            flat = _direct(view)
            if flat is None:
                continue
            for i, part in _direct_in(piece.sizes, starts, itemsize, box, flat).items():
                if i not in direct:
                    direct[i] = part
                    owner[i] = at
        # a chunk is staged when a box other than the one it is decoded straight into wants it
        staged = _staged(piece.sizes, starts, itemsize, boxes, owner)
        target = (
            Staged(sum(sizes), _Scatter(piece.sizes, dtype, itemsize, local, boxes))
            if staged
            else np.empty(0, dtype=np.uint8)
        )
        items.append(ChunkTarget(hashes, target, frozenset(staged), direct))
    return items
