"""Host buffers: recycled snapshot buffers, and byte buffers joined without holding the GIL.

Copying a state into freshly allocated memory costs a page fault per page on first touch —
about as much as the copy itself. Once a checkpoint is committed, the snapshot it replaced as
XOR base is no longer needed; its buffers are kept here and the next snapshot copies into them,
so a steady-state save blocks only for the memcpy. The pool holds at most the buffers it was
given back (one snapshot's worth): it does not raise peak memory, it keeps it.

Small tensors are snapshotted together into one slab per dtype (:mod:`.save.slabs`): the pool
lends a slab, remembers where each of its tensors starts, and takes it back once every one of
them was given back (the delta base may keep some of them for a while).

A fresh slab (the first save, or a save whose state grew) is faulted in before the copy, by
``zero_()``: torch fills it on every intra-op thread (idle while ``save`` blocks), where the
slab's ``torch.cat`` of thousands of small tensors would take its page faults one at a time on
one thread. 20,000 tensors of 4 KiB (82 MB) into a fresh slab, on the benchmark machine: 41 ms
copied straight in, 27-31 ms faulted first with two intra-op threads, and still 39 ms with one
(``OMP_NUM_THREADS=1``, as ``torchrun`` sets): a fault is cheaper in a tight fill than between
small copies, so the fill pays for its extra pass even then.

Huge pages are opt-in (``LIGHTNING_INCREMENTAL_HUGE_PAGES=1``: fresh buffers of at least
:data:`HUGE_MIN` bytes are asked of the kernel in huge pages, ``madvise``), as torch's own
allocator leaves them. Where the kernel's ``defrag`` setting is ``madvise`` (the usual default)
a fault in such a region compacts memory on the spot when no huge page is free: 80 MB took 75
to 170 ms to fault in on the benchmark machine against 16 to 19 ms in 4 KiB pages, and a first
save's stall at 20,000 tensors ranged from 55 to 233 ms against 80 ms. Where free huge pages
were at hand, the same 80 MB took 5 ms: on such a host (or with ``defrag`` set to ``defer``)
they are worth turning on.
"""

from __future__ import annotations

import gc
import itertools
import mmap
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

#: Fresh host buffers of at least this many bytes are asked for in huge pages, where those are
#: turned on (see above).
HUGE_MIN = 4 << 20
HUGE_PAGES_ENV = "LIGHTNING_INCREMENTAL_HUGE_PAGES"


def host_empty(nbytes: int) -> torch.Tensor:
    """A fresh uninitialised flat uint8 CPU tensor of ``nbytes`` (not pinned): in huge pages
    where they are turned on (``LIGHTNING_INCREMENTAL_HUGE_PAGES=1``), the kernel grants them
    on request and ``nbytes >= HUGE_MIN``, else from torch's allocator. Its memory is returned
    when the last tensor viewing it is freed."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN or advice is None or os.environ.get(HUGE_PAGES_ENV, "0") != "1":
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapped.madvise(advice)
    except OSError:
        pass  # huge pages refused (disabled, or an old kernel): plain pages, still correct
    return torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping while in use


def host_tensor(shape: torch.Size, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """:func:`host_empty` as an uninitialised contiguous tensor of ``shape`` and ``dtype``
    (``pin``: in pinned memory instead, from torch's allocator)."""
    if pin:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < HUGE_MIN:
        return torch.empty(shape, dtype=dtype)
    return host_empty(nbytes).view(dtype).view(shape)


def fresh_slab(nbytes: int) -> torch.Tensor:
    """:func:`host_empty`, its pages faulted in on every intra-op thread (see above)."""
    return host_empty(nbytes).zero_()


class BufferPool:
    """Flat uint8 host tensors keyed by (size, pinned), handed out as views of any dtype."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        # slabs lent out: storage address -> (the slab, the byte sizes of its tensors as lent;
        # once one of them came back, the byte offsets of those still out)
        self._lent: dict[int, tuple[torch.Tensor, list[int] | set[int]]] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        nbytes = shape.numel() * dtype.itemsize
        if nbytes:
            with self._lock:
                free = self._free.get((nbytes, pin))
                flat = free.pop() if free else None
            if flat is not None:
                return flat.view(dtype).view(shape)
        return host_tensor(shape, dtype, pin=pin)

    def recycles(self, nbytes: int) -> bool:
        """Whether a slab of ``nbytes`` lent now would be memory given back (already faulted
        in), not fresh memory."""
        with self._lock:
            return bool(self._free.get((nbytes, False)))

    def lend_slab(self, nbytes: int, sizes: list[int], *, fault: bool = True) -> torch.Tensor:
        """A flat uint8 CPU buffer of ``nbytes`` holding tensors of ``sizes`` bytes end to end
        from its start: it comes back to the pool once each of them was given back
        (:meth:`give`). Where they start is worked out on the first give back, not here: this
        runs while ``save`` blocks. A fresh one is faulted in (:func:`fresh_slab`) unless
        ``fault`` is false (its copy runs on a thread of its own, beside other work)."""
        with self._lock:
            free = self._free.get((nbytes, False))
            slab = free.pop() if free else None
        if slab is None:
            slab = fresh_slab(nbytes) if fault else host_empty(nbytes)
        with self._lock:
            self._lent[slab.data_ptr()] = (slab, sizes)
        return slab

    def give(self, tensors: list[torch.Tensor]) -> None:
        """Return snapshot buffers nothing references any more."""
        with self._lock:
            for tensor in tensors:
                if tensor.numel() == 0 or not tensor.is_contiguous():
                    continue
                storage = tensor.untyped_storage()
                if storage.nbytes() != tensor.numel() * tensor.element_size():
                    self._give_back_part(storage.data_ptr(), tensor)
                    continue
                flat = tensor.reshape(-1).view(torch.uint8)
                # a slab of one tensor, given back as that tensor: no longer lent
                self._lent.pop(storage.data_ptr(), None)
                self._free[(flat.numel(), tensor.is_pinned())].append(flat)

    def give_slabs(self, slabs: Sequence[torch.Tensor]) -> None:
        """Return whole slabs (any view of each): none of their tensors is used any more. One
        call per slab, not one per tensor in it."""
        with self._lock:
            for slab in slabs:
                lent = self._lent.pop(slab.untyped_storage().data_ptr(), None)
                if lent is not None:  # not lent by this pool: not ours to recycle
                    self._free[(lent[0].numel(), False)].append(lent[0])

    def _give_back_part(self, address: int, tensor: torch.Tensor) -> None:
        """One tensor of a lent slab is free: the slab is, once none of its tensors is out."""
        lent = self._lent.get(address)
        if lent is None:
            return  # a view into a larger buffer the pool did not lend: not ours to recycle
        slab, out = lent
        if type(out) is list:  # the sizes lent: now the byte offsets of the tensors still out
            out = set(itertools.accumulate(out, initial=0))
            out.discard(slab.numel())  # the end of the last, not a tensor
            self._lent[address] = (slab, out)
        out.discard(tensor.storage_offset() * tensor.element_size())
        if not out:
            del self._lent[address]
            self._free[(slab.numel(), False)].append(slab)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._lent.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(size * len(v) for (size, _), v in self._free.items())


GATHER_MIN = 64 << 10  # shorter results are joined holding the GIL: a few microseconds


def gather(parts: Sequence[bytes | memoryview]) -> memoryview:
    """``parts`` concatenated into one new buffer. Unlike ``b"".join`` (which copies holding the
    GIL), the copies release it: other threads encode meanwhile."""
    if sum(len(p) for p in parts) < GATHER_MIN:  # a short join: quicker than any hand-off
        return memoryview(b"".join(parts))
    views = [np.frombuffer(p, dtype=np.uint8) for p in parts]
    out = np.empty(sum(v.size for v in views), dtype=np.uint8)
    at = 0
    for v in views:
        np.copyto(out[at : at + v.size], v)
        at += v.size
    return out.data


def _gil_enabled() -> bool:
    probe = getattr(sys, "_is_gil_enabled", None)  # Python 3.13+
    return True if probe is None else bool(probe())


def _may_freeze() -> bool:
    """Whether ``gc.freeze`` then ``gc.unfreeze`` is ours to do: nothing else in the process
    froze objects (unfreezing would undo its freeze), and the build has a GIL (a free-threaded
    build's freeze visits every object)."""
    return gc.get_freeze_count() == 0 and _gil_enabled()


_freeze_lock = threading.Lock()
_freezes = 0
_froze = False


@contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects alive when the block begins are left out of garbage collection until it
    ends (``gc.freeze``), then put back in the oldest generation (``gc.unfreeze``): two list
    splices, no scan.

    For long steps that make objects by the thousand while they read and decode (verifying a
    checkpoint): the collections those allocations trigger would otherwise scan the process's
    whole heap (the manifest's records, the training's own objects) again and again, a cost
    that grows faster than the work. Unlike :func:`collection_paused` it may span I/O: objects
    made meanwhile are collected as usual, so garbage never piles up; only a cycle among the
    objects frozen that dies meanwhile waits for the block's end. Nested and overlapping blocks
    (any thread) freeze once and unfreeze when the last ends. Skipped when something else in
    the process froze objects (``gc.get_freeze_count()``: unfreezing would undo its freeze),
    and on a free-threaded build."""
    global _freezes, _froze
    with _freeze_lock:
        if _freezes == 0:
            _froze = _may_freeze()
            if _froze:
                gc.freeze()
        _freezes += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freezes -= 1
            if _freezes == 0 and _froze:
                gc.unfreeze()
                _froze = False


_collection_lock = threading.Lock()
_collection_pauses = 0
_collection_was_enabled = False


@contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic garbage collection while the block runs (in any thread), then as before.

    For the steps of a save that make an object or two per tensor, every one of them live —
    the walk of the state, the leaves of the slabs, a manifest's records and tables: at tens of
    thousands of tensors the collections their allocations trigger scan the same live objects
    again and again (a third of sealing a manifest of 20,000 tensors, half of the walk). Such a
    block is bounded by the number of tensors, not by bytes: it never spans coding or I/O.
    Pauses nest and overlap across threads: collection resumes when the last one ends, if it
    was enabled when the first began.

    When it resumes, the objects made meanwhile would all still be young: the first collection
    after the block (on whichever thread allocates next: the training's, right after ``save``
    returned) would scan every one of them, and the next older one again (a fifth of the time
    ``save`` blocks at 20,000 tensors). They are promoted to the oldest generation instead
    (``gc.freeze`` then ``gc.unfreeze``: two list splices, no scan), where only a full collection
    looks at them; most die by reference count before one runs. Young garbage cycles made just
    before the block wait for that full collection too. Skipped when anything else in the
    process froze objects (``gc.get_freeze_count()``): unfreezing would undo its freeze; and on
    a free-threaded build, whose freeze visits every object."""
    global _collection_pauses, _collection_was_enabled
    with _collection_lock:
        if _collection_pauses == 0:
            _collection_was_enabled = gc.isenabled()
            gc.disable()
        _collection_pauses += 1
    try:
        yield
    finally:
        with _collection_lock:
            _collection_pauses -= 1
            if _collection_pauses == 0 and _collection_was_enabled:
                if _may_freeze():
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
