"""Small CPU tensors snapshotted together: copied per dtype into slabs, a few large copies in
place of one per tensor.

Copying tensors one by one costs a few microseconds of Python and dispatch each, whatever their
size: at tens of thousands of small tensors (an MoE model, optimizer state) that dominated the
time ``save`` blocks. During the walk of the state a small tensor is only noted (with what may
change once ``save`` returns: its shape and ``requires_grad``); after the walk each dtype's
tensors are copied into one buffer by a single ``torch.cat``. Building the leaves (their key
paths, views of the slab, metadata) is left to the save's background work
(:func:`complete`), which runs before anything reads them.

The copies overlap the walk. A dtype's tensors are copied in batches: once
:attr:`Slabs.limit` of them were noted, the walk lends a slab for them and hands both to a
copying thread (:class:`_Copier`), then walks on. ``torch.cat`` releases the GIL, so the copy
(and the page faults of a fresh slab) runs on another core while the walk reads the next
tensors' attributes in Python. The walk waits at each hand-off until the thread has taken the
batch: otherwise the thread would wait a whole switch interval (5 ms) for the GIL the walk holds
before it could start the copy. The walk copies the last batch of each dtype itself, then waits
for the thread. At 20,000 tensors of 4 KiB on the benchmark machine the walk took about 28 ms
and the copy 14 ms into a recycled slab, 30 ms into a fresh one, one after the other; overlapped,
``save`` blocked for 43 to 48 ms in place of 46 to 65 (the walk slows to about 35 ms beside the
copy).

Below :data:`THREAD_FROM` small tensors, a batch goes to the thread only if its slab is fresh
memory (and at least :data:`FRESH_THREAD_MIN` bytes): a store's first two saves, before any
slab came back to the pool, when faulting the pages in costs about as much as the copy. Into a
recycled slab the walk copies the batch itself: at 2,000 tensors of 4 KiB a thread and its
hand-offs cost more than the 1 ms of copy they would hide (5.0-6.4 ms against 4.4-6.0 ms
without, alternating runs). Fresh, they hide part of it: the first two saves of those 2,000
tensors blocked for 3.4-3.8 ms in place of 4.0-4.5 with the walk copying every batch (the least
of 15 stores each, alternating runs).
Batches are cut by count, in walk order, the same whoever copies them, so an unchanged layout
cuts the same batches each save and the slabs come back to the pool at the same sizes.

A slab comes from the snapshot pool when there is one (:meth:`.BufferPool.lend_slab`) and goes
back to it once every leaf in it was given back, so a steady-state save reuses its memory as a
save of large tensors does. The bytes of each leaf are exactly those a copy of its own would
hold (row-major order of the tensor as seen), so nothing downstream tells the two apart.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_incremental.core.buffers import BufferPool, collection_paused, fresh_slab, host_empty
from lightning_incremental.core.codecs.bytes import group_width
from lightning_incremental.core.format.tree import Leaf, dtype_name, key_path

#: Tensors up to this many bytes go into a slab; larger ones are copied on their own (their
#: per-call cost is noise beside the copy, and their buffers are recycled one by one).
SLAB_MAX = 256 << 10

#: The number of small tensors of one dtype noted before they are cut off as a batch; each cut
#: doubles it (one limit for every dtype), up to :data:`BATCH_MAX` (see above): each hand-off
#: to the copying thread costs switches of the GIL.
BATCH_FIRST = 512
BATCH_MAX = 4096
#: A batch that brings the small tensors cut into batches to this many goes to the copying
#: thread, as every later one does; before, only a batch of at least :data:`FRESH_THREAD_MIN`
#: bytes whose slab is fresh memory (see above).
THREAD_FROM = 2048
FRESH_THREAD_MIN = 1 << 20
#: The limit once no copying thread could be started: every batch is then copied by the walk.
BATCH_NEVER = 1 << 62


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
    """The small tensors of one snapshot: noted during the walk, copied in batches while it
    goes on (see the module's documentation), the last batches after it."""

    #: where slabs come from (None: fresh memory each time)
    pool: BufferPool | None = None
    #: dtype -> (the tensors, each flat, and what was noted of each) of its batch being noted,
    #: in the order seen
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[Noted]]] = field(
        default_factory=dict
    )
    copied: list[Slab] = field(default_factory=list)
    #: a batch of this many tensors is cut off (see :meth:`hand_off`)
    limit: int = BATCH_FIRST
    #: small tensors in the batches cut off so far
    cut: int = 0
    copier: _Copier | None = None

    def hand_off(self, dtype: torch.dtype) -> None:
        """The walk noted :attr:`limit` tensors of ``dtype``: a slab is lent for them here (on
        the walk's thread: a pool is not shared between threads) and the copying thread copies
        them into it while the walk goes on — or, while fewer than :data:`THREAD_FROM` were
        cut into batches (this one included) and the slab is recycled memory (or small), the
        walk copies them itself."""
        tensors, noted = self.by_dtype.pop(dtype)
        self.cut += len(noted)
        sizes = [n[7] for n in noted]
        nbytes = sum(sizes)
        recycled = self.pool is not None and self.pool.recycles(nbytes)
        data = self._lend(dtype, sizes, nbytes, fault=False)  # its faults: the copy's
        self.copied.append(Slab(dtype, data, noted))
        self.limit = min(2 * self.limit, BATCH_MAX)
        inline = recycled or nbytes < FRESH_THREAD_MIN
        if self.copier is None and self.cut < THREAD_FROM and inline:
            with torch.no_grad():
                torch.cat(tensors, out=data)
            return
        if self.copier is None:
            try:
                self.copier = _Copier()
            except RuntimeError:  # no thread to be had (a process at its limit): copy here
                self.limit = BATCH_NEVER
                with torch.no_grad():
                    torch.cat(tensors, out=data)
                return
        self.copier.put(tensors, data)

    def copy(self) -> None:
        """Copy each dtype's last batch and wait for the copying thread: once this returns
        every noted tensor is in a slab (the part of the snapshot that must happen before
        ``save`` returns). On an error the slabs lent go back (:meth:`abandon`)."""
        try:
            # a fresh slab is faulted in on every intra-op thread before its copy, unless the
            # copying thread runs: one of those threads would then wait for a core
            fault = self.copier is None
            for dtype, (tensors, noted) in self.by_dtype.items():
                sizes = [n[7] for n in noted]
                data = self._lend(dtype, sizes, sum(sizes), fault=fault)
                self.copied.append(Slab(dtype, data, noted))
                with torch.no_grad():  # out= refuses inputs that require grad otherwise
                    torch.cat(tensors, out=data)
            self.by_dtype.clear()  # the copies are taken: let go of the tensors
            self._join()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """The snapshot failed: wait until the copying thread has ended, then give every slab
        lent back (never while the thread may still write into one). A copy's own error is
        dropped: the snapshot failed already, with the error to see; an interrupt is raised."""
        self.by_dtype.clear()
        try:
            self._join()
        except Exception:
            pass
        finally:
            slabs, self.copied = self.copied, []
            if self.pool is not None and slabs:
                self.pool.give_slabs([slab.data for slab in slabs])

    def _lend(
        self, dtype: torch.dtype, sizes: list[int], total: int, *, fault: bool
    ) -> torch.Tensor:
        if self.pool is not None:
            return self.pool.lend_slab(total, sizes, fault=fault).view(dtype)
        return (fresh_slab(total) if fault else host_empty(total)).view(dtype)

    def _join(self) -> None:
        copier = self.copier
        if copier is not None:
            try:
                copier.finish()
            finally:
                self.copier = None  # finish() returns or raises once the thread has ended


class _Copier:
    """A thread that copies the batches handed to it, in order, until :meth:`finish`.

    Slabs it copies into must not be given back (to a pool, or a memory tier's slot) before
    it ended: :meth:`finish` waits for that through an interrupt (a Ctrl-C), which it raises
    once the thread ended. ``Thread.join`` would not do: an interrupted join marks the thread
    stopped while it still runs (CPython 3.11, bpo-45274). A copy runs at memory speed, a few
    milliseconds for a batch, so the wait is short. The thread copies without the walk's
    thread-local state (grad mode is set here; a dispatch mode active on the walk's thread
    does not see these copies); the slabs are normal tensors, made out of inference mode
    (see :func:`.snapshot.flatten_state`), which this thread could not update otherwise."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[tuple[list[torch.Tensor], torch.Tensor] | None] = (
            queue.SimpleQueue()
        )
        self.error: BaseException | None = None
        self.taken = threading.Semaphore(0)  # released as each batch's copy begins
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, name="snapshot-slab-copy", daemon=True)
        self.thread.start()

    def put(self, tensors: list[torch.Tensor], out: torch.Tensor) -> None:
        """Hand a batch over and wait until its copy began (the GIL handed to the thread: see
        the module's documentation)."""
        self.batches.put((tensors, out))
        self.taken.acquire()

    def finish(self) -> None:
        """Wait until every batch handed over was copied and the thread ended; then raise an
        interrupt that came meanwhile, else the first copy's error, if any."""
        interrupted: BaseException | None = None
        closed = False
        while True:
            try:
                if not closed:
                    self.batches.put(None)  # twice after an interrupt here: the first ends it
                    closed = True
                self.ended.wait()
                break
            except BaseException as exc:  # an interrupt: raised once the thread has ended
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                while (batch := self.batches.get()) is not None:
                    self.taken.release()
                    if self.error is None:
                        try:
                            torch.cat(batch[0], out=batch[1])
                        except BaseException as exc:  # raised on the walk's thread by finish
                            self.error = exc
        finally:
            self.ended.set()


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
