"""Small CPU tensors snapshotted together: one copy per dtype into one slab.

Copying tensors one by one costs a few microseconds of Python and dispatch each, whatever their
size: at tens of thousands of small tensors (an MoE model, optimizer state) that dominated the
time ``save`` blocks. During the walk of the state a small tensor is only noted (with what may
change once ``save`` returns: its shape and ``requires_grad``); after the walk each dtype's
tensors are copied into one buffer by a single ``torch.cat``. Building the leaves (their key
paths, views of the slab, metadata) is left to the save's background work
(:func:`complete`), which runs before anything reads them.

A slab comes from the snapshot pool when there is one (:meth:`.BufferPool.lend_slab`) and goes
back to it once every leaf in it was given back, so a steady-state save reuses its memory as a
save of large tensors does. The bytes of each leaf are exactly those a copy of its own would
hold (row-major order of the tensor as seen), so nothing downstream tells the two apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_incremental.core.buffers import BufferPool, collection_paused, fresh_slab
from lightning_incremental.core.codecs.bytes import group_width
from lightning_incremental.core.format.tree import Leaf, dtype_name, key_path

#: Tensors up to this many bytes go into a slab; larger ones are copied on their own (their
#: per-call cost is noise beside the copy, and their buffers are recycled one by one).
SLAB_MAX = 256 << 10


#: A small tensor seen by the walk, what it looked like then (a plain tuple: the walk makes one
#: per tensor): (the key path of its parent, its key in it, slot, index in the snapshot's leaves,
#: shape, requires_grad, is a parameter, bytes); a tensor outside any dict has its own key path
#: and the key :data:`NO_KEY` (the walk does not build a tensor's key path: see
#: ``_Flattener.items``). The tensor itself is kept apart, flat (a 1-D view of it, as
#: ``torch.cat`` takes it), in its dtype's list of sources, so that nothing is left to build to
#: let go of it once copied.
Noted = tuple[tuple[Any, ...], Any, int, int, torch.Size, bool, bool, int]

#: The key of a :data:`Noted` whose path is the whole key path (a tensor not in a dict).
NO_KEY: Any = object()


def full_path(path: tuple[Any, ...], key: Any) -> tuple[Any, ...]:
    """The key path of a tensor noted at ``path`` with ``key`` (see :data:`Noted`)."""
    return path if key is NO_KEY else (*path, key)


@dataclass
class Slab:
    """One dtype's small tensors, copied: ``data`` holds them end to end."""

    dtype: torch.dtype
    data: torch.Tensor
    noted: list[Noted]


@dataclass
class Slabs:
    """The small tensors of one snapshot: noted during the walk, copied after it."""

    #: dtype -> (the tensors, each flat, and what was noted of each), in the order seen
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[Noted]]] = field(
        default_factory=dict
    )
    copied: list[Slab] = field(default_factory=list)

    def copy(self, pool: BufferPool | None) -> None:
        """Copy every noted tensor into its dtype's slab (the part of the snapshot that must
        happen before ``save`` returns)."""
        for dtype, (tensors, noted) in self.by_dtype.items():
            sizes = [n[7] for n in noted]
            total = sum(sizes)
            if pool is not None:
                data = pool.lend_slab(total, sizes).view(dtype)
            else:
                data = fresh_slab(total).view(dtype)
            with torch.no_grad():  # out= refuses inputs that require grad otherwise
                torch.cat(tensors, out=data)
            self.copied.append(Slab(dtype, data, noted))
        self.by_dtype.clear()  # the copies are taken: let go of the tensors


class SlabLeaf(Leaf):
    """A small tensor's leaf: its bytes a slice of its slab (``flat_bytes``, what the save
    reads), its ``data`` a tensor view of the slab made on first use. Making 20,000 tensor views
    up front cost a tenth of a second of the save's background work; the encoder, the delta
    base and the pool deal in slices and whole slabs, so most saves never make one."""

    def __init__(
        self,
        path: str,
        dtype: str,
        shape: list[int],
        width: int,
        parameter: bool,
        requires_grad: bool,
        slot: int,
        flat_bytes: Any,
        slab: torch.Tensor,
        start: int,
    ) -> None:
        self.path, self.dtype, self.shape, self.device = path, dtype, shape, "cpu"
        self.width, self.is_numpy, self.parameter = width, False, parameter
        self.requires_grad, self.slot, self.offsets = requires_grad, slot, None
        self.flat_bytes, self.slab, self._start = flat_bytes, slab, start
        self._data: torch.Tensor | None = None

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        view = self._data
        if view is None:
            shape = self.shape
            numel = self.flat_bytes.size // self.slab.element_size()  # type: ignore[union-attr]
            view = self.slab[self._start : self._start + numel]  # type: ignore[index]
            view = self._data = view if len(shape) == 1 else view.view(shape)
        return view


def complete(slabs: Slabs, leaves: list[Leaf | None]) -> None:
    """Build the leaves of the copied slabs into their places in ``leaves``."""
    with collection_paused():
        _complete(slabs, leaves)


def _complete(slabs: Slabs, leaves: list[Leaf | None]) -> None:
    for slab in slabs.copied:
        name = dtype_name(slab.dtype)
        width = group_width(slab.dtype.itemsize, slab.dtype.is_complex)
        raw = slab.data.view(torch.uint8).numpy()  # numpy slices cost a tenth of torch views
        itemsize = slab.dtype.itemsize
        start = 0  # bytes
        data = slab.data
        for path, key, slot, index, shape, requires_grad, parameter, size in slab.noted:
            end = start + size
            where = key_path(full_path(path, key))
            leaves[index] = SlabLeaf(
                where, name, list(shape), width, parameter, requires_grad, slot,
                raw[start:end], data, start // itemsize,
            )  # fmt: skip
            start = end
    slabs.copied = []
