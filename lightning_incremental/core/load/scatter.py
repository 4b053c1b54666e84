"""Restoring boxes of a tensor from its stored pieces: which pieces, which of their chunks, and
where each decoded chunk's elements go.

A tensor is stored as pieces (dense boxes of the global tensor, one per rank that held it) or as
one whole array. A reader wants other boxes: its own local shards under another layout, or the
whole tensor. For every wanted box, :func:`~lightning_incremental.core.format.pieces.plan_reads`
picks the overlapping stored pieces; of each, only the chunks holding overlapping elements are read.
A chunk is a contiguous run of its piece's row-major elements, i.e. at most ``2*ndim - 1`` boxes
(:func:`~lightning_incremental.core.format.pieces.range_boxes`); each box's overlap with a wanted
box is one tensor copy. Memory: one chunk of scratch per decode in flight, never a whole piece.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.format.pieces import (
    Box,
    intersect,
    plan_reads,
    range_boxes,
    relative,
)
from lightning_incremental.core.format.records import ChunkRecipe, TensorEntry
from lightning_incremental.core.format.tree import torch_dtype
from lightning_incremental.core.load.targets import ChunkTarget, Regions, Staged


def _local(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a piece starting at ``origin``."""
    return Box(tuple(o - p for o, p in zip(box.offsets, origin.offsets)), box.sizes)


def wanted_chunks(
    sizes: tuple[int, ...], chunk_bytes: Sequence[int], itemsize: int, boxes: Sequence[Box]
) -> frozenset[int]:
    """Indices of the chunks of a piece of ``sizes`` (chunks of ``chunk_bytes`` bytes, in
    order) that hold an element of one of ``boxes`` (piece coordinates)."""
    needed = set()
    start = 0
    for index, nbytes in enumerate(chunk_bytes):
        e0, e1 = start // itemsize, (start + nbytes) // itemsize
        start += nbytes
        if any(intersect(b, w) is not None for _, b in range_boxes(sizes, e0, e1) for w in boxes):
            needed.add(index)
    return frozenset(needed)


@dataclass(frozen=True)
class _Scatter:
    """Copies the elements of a decoded chunk of one piece into the destinations that want
    them: ``copies`` are (box in piece coordinates, destination view of that box's sizes)."""

    sizes: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    copies: tuple[tuple[Box, torch.Tensor], ...]

    def __call__(self, offset: int, data: np.ndarray) -> None:
        first = offset // self.itemsize
        values = torch.from_numpy(data).view(self.dtype)
        for flat, box in range_boxes(self.sizes, first, first + values.numel()):
            block = values[flat - first : flat - first + box.numel].view(box.sizes)
            for want, dst in self.copies:
                common = intersect(box, want)
                if common is not None:
                    dst[relative(common, want)].copy_(block[relative(common, box)])


def _direct(view: torch.Tensor) -> np.ndarray | None:
    """The flat bytes of ``view`` to decode into directly, when it is plain host memory."""
    if view.device.type != "cpu" or not view.is_contiguous() or view.is_conj() or view.is_neg():
        return None
    return view.reshape(-1).view(torch.uint8).numpy()


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
    if tuple(want.offsets[1:]) != tuple(0 for _ in sizes[1:]) or want.sizes[1:] != sizes[1:]:
        return {}
    row = math.prod(sizes[1:]) * itemsize
    lo = (want.offsets[0] if sizes else 0) * row
    hi = lo + flat.size
    out = {}
    start = 0
    for index, nbytes in enumerate(chunk_bytes):
        if lo <= start and start + nbytes <= hi:
            out[index] = flat[start - lo : start - lo + nbytes]
        start += nbytes
    return out


def piece_targets(
    entry: TensorEntry, regions: Regions, chunks: Mapping[str, ChunkRecipe]
) -> list[ChunkTarget]:
    """What to decode, and where, to fill ``regions`` with the tensor ``entry`` stores. A chunk
    that lands whole in one contiguous run of a destination in host memory (a piece read whole,
    or rows of it) is decoded straight into it; the others are decoded into scratch and their
    overlapping parts copied into place.

    Raises:
        CorruptCheckpointError: the stored pieces do not cover a wanted box.
    """
    stored = entry.stored_pieces()
    boxes = [box for box, _ in stored]
    copies: dict[int, list[tuple[Box, torch.Tensor]]] = defaultdict(list)
    for view, box in regions.parts:
        if box.numel == 0:
            continue
        try:
            reads = plan_reads(boxes, box)
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
        sizes = [chunks[d].size for d in hashes]
        direct: dict[int, np.ndarray] = {}
        staged: set[int] = set()
        for box, view in local:
            flat = _direct(view)
            mine = (
                direct_chunks(piece.sizes, sizes, itemsize, box, flat) if flat is not None else {}
            )
            mine = {i: part for i, part in mine.items() if i not in direct}
            direct.update(mine)
            staged |= wanted_chunks(piece.sizes, sizes, itemsize, [box]) - set(mine)
        target = (
            Staged(sum(sizes), _Scatter(piece.sizes, dtype, itemsize, local))
            if staged
            else np.empty(0, dtype=np.uint8)
        )
        items.append(ChunkTarget(hashes, target, frozenset(staged), direct))
    return items
