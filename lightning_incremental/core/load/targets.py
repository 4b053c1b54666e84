"""Where a restore puts decoded chunks: a whole array, regions of the caller's tensor, or a
staging buffer copied into place afterwards (the targets of
:func:`~lightning_incremental.core.load.pipeline.restore_arrays`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from lightning_incremental.core.format.pieces import Box


@dataclass(frozen=True)
class Regions:
    """Destinations of a tensor that hold boxes of its global index space: each ``(view, box)``
    is a tensor of ``box.sizes`` (any device, any strides) to fill with that box of the stored
    tensor. A sharded tensor's local pieces, or one whole tensor when the checkpoint stored it
    as pieces. Only the stored pieces that overlap a box are read, and of those only the chunks
    holding overlapping elements; each chunk is decoded into scratch memory and its overlapping
    part copied into place (:func:`~lightning_incremental.core.load.scatter.piece_targets`)."""

    parts: tuple[tuple[torch.Tensor, Box], ...]


@dataclass(frozen=True)
class Staged:
    """A destination that is not one flat piece of host memory (a GPU tensor, a non-contiguous
    view): each chunk is decoded into scratch host memory and handed to ``put(offset, data)``
    (``offset``: the chunk's byte offset in the tensor)."""

    nbytes: int
    put: Callable[[int, np.ndarray], None]


@dataclass(frozen=True)
class ChunkTarget:
    """The chunks of one stored array and where they go; ``wanted``: the indices of the chunks
    to hand to ``target`` (None: all); ``direct``: chunks (also) decoded straight into the
    given bytes (a chunk that lands whole in one contiguous run of a destination)."""

    chunks: tuple[str, ...]
    target: np.ndarray | Staged
    wanted: frozenset[int] | None = None
    direct: Mapping[int, np.ndarray] | None = None


Target = Union[np.ndarray, Staged, Regions, None]
