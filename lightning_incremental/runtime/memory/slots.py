"""Reusable data files of the memory tier, mapped into the process: a step's snapshot is copied
straight into the ``data.bin`` of the part it becomes (one copy of the state a step, no
intermediate host buffers), and a part that is no longer kept becomes the file the next step
is copied into (its pages stay allocated and mapped: no page faults, no zeroing).

- :class:`Slot`: one part directory being written or reused, its ``data.bin`` sized with
  ``posix_fallocate`` before it is mapped, so that a full tmpfs is an ``OSError`` there and
  never a ``SIGBUS`` on a write through the mapping;
- :class:`SlotPool`: the snapshot's buffer pool (:class:`~lightning_incremental.core.buffers.
  BufferPool`) carving the snapshot's buffers out of a slot, one after another, 64-byte
  aligned; what does not fit (or must be pinned for a CUDA copy) comes from the ordinary pool
  and is written into the file by the background work.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.codecs.bytes import chunk_hasher
from lightning_incremental.core.commit.owner import process_exists
from lightning_incremental.core.format.tree import Leaf

log = logging.getLogger(__name__)

ALIGN = 64
DATA = "data.bin"
_COUNTER = itertools.count()


def align(offset: int) -> int:
    return offset + (-offset % ALIGN)


class Slot:
    """A part directory whose ``data.bin`` of ``capacity`` bytes is mapped (shared) into this
    process as ``buffer``.

    Raises:
        OSError: the directory or the file cannot be made, or the file system has no room
            for ``capacity`` bytes.
    """

    def __init__(self, path: Path, capacity: int) -> None:
        path.mkdir(parents=True)
        self.path = path
        self.capacity = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.size = 0  # the data file's length once written (>= capacity)
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Make the file (and its mapping) ``capacity`` bytes long, its pages allocated.

        Raises:
            OSError: no room for them (the slot is then unusable: delete it).
        """
        file = self.path / DATA
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, capacity)
            if capacity and hasattr(os, "posix_fallocate"):  # not on macOS
                os.posix_fallocate(fd, 0, capacity)  # ENOSPC here, not SIGBUS in a copy
        finally:
            os.close(fd)
        self.buffer = (
            torch.from_file(str(file), shared=True, size=capacity, dtype=torch.uint8)
            if capacity
            else torch.empty(0, dtype=torch.uint8)
        )
        self.capacity = self.size = capacity

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in this slot's mapping."""
        if not self.capacity or not tensor.numel():
            return False
        base, ptr = self.buffer.data_ptr(), tensor.data_ptr()
        return base <= ptr and ptr + tensor.numel() * tensor.element_size() <= base + self.capacity

    def offset(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr() - self.buffer.data_ptr()


def slot_name(rank: int, pid: int | None = None) -> str:
    """A new slot directory's name: hidden, this process's, never a part's name."""
    return f".slot-r{rank:06d}-{next(_COUNTER)}-{os.getpid() if pid is None else pid}"


class SlotPool(BufferPool):
    """Snapshot buffers carved out of ``slot`` in the order they are asked for; the rest
    (pinned buffers, what does not fit) from ``fallback``."""

    def __init__(self, slot: Slot, fallback: BufferPool | None) -> None:
        super().__init__()
        self.slot = slot
        self.fallback = fallback if fallback is not None else BufferPool()
        self.used = 0  # bytes of the slot carved so far

    def _carve(self, nbytes: int) -> torch.Tensor | None:
        start = align(self.used)
        if start + nbytes > self.slot.capacity:
            return None
        self.used = start + nbytes
        return self.slot.buffer[start : start + nbytes]

    def take(self, shape: torch.Size, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if nbytes and not pin:
            raw = self._carve(nbytes)
            if raw is not None:
                return raw.view(dtype).view(shape)
        return self.fallback.take(shape, dtype, pin=pin)

    def recycles(self, nbytes: int) -> bool:
        # The slot's memory counts as recycled: only a new or resized slot's first save takes
        # its page faults on the walk's thread (as every batch did before the rule).
        fits = align(self.used) + nbytes <= self.slot.capacity
        return fits or self.fallback.recycles(nbytes)

    def lend_slab(self, nbytes: int, sizes: list[int], *, fault: bool = True) -> torch.Tensor:
        raw = self._carve(nbytes) if nbytes else None
        return raw if raw is not None else self.fallback.lend_slab(nbytes, sizes, fault=fault)

    def give(self, tensors: list[torch.Tensor]) -> None:
        self.fallback.give([t for t in tensors if not self.slot.holds(t)])

    def give_slabs(self, slabs: Sequence[torch.Tensor]) -> None:
        """Slabs the fallback lent go back to it; those carved from the slot are the slot's."""
        self.fallback.give_slabs([s for s in slabs if not self.slot.holds(s)])


class Slots:
    """This process's slots under ``parts``: at most one spare per rank (its next step's
    file), those now holding parts (by part name), those handed out to receive a replica."""

    def __init__(self, parts: Path) -> None:
        self.root = parts
        self.sizes: dict[int, int] = {}  # rank -> its last part's data size
        self.spares: dict[int, Slot] = {}
        self.parts: dict[str, Slot] = {}
        self.receiving: dict[int, Slot] = {}

    def take(self, rank: int, exact: int | None = None) -> Slot | None:
        """A slot for ``rank``'s next part: at least its last part's size (``exact``: that
        size), its spare when it has one; None when the size is not known yet or there is no
        room (logged: the write that follows, into buffers, says it)."""
        size = self.sizes.get(rank) if exact is None else exact
        if size is None:
            return None
        slot = self.spares.pop(rank, None)
        try:
            if slot is None:
                slot = Slot(self.root / slot_name(rank), size)
            elif (
                slot.capacity < size
                or slot.size != slot.capacity
                or exact not in (None, slot.capacity)
            ):
                slot.resize(size)  # grown; or a replica's file: exactly its size
        except OSError as exc:
            log.warning("memory tier: no room to map rank %s's next part: %s", rank, exc)
            if slot is not None:
                shutil.rmtree(slot.path, ignore_errors=True)
            return None
        return slot

    def spare(self, rank: int, slot: Slot) -> None:
        if rank in self.spares:
            shutil.rmtree(slot.path, ignore_errors=True)
        else:
            self.spares[rank] = slot

    def is_spare(self, path: Path) -> bool:
        return any(slot.path == path for slot in self.spares.values())

    def recycle(self, path: Path, rank: int) -> bool:
        """Make the part at ``path`` (``rank``'s) its rank's spare when it was written in a
        slot and the rank has none: renamed out of sight before anything in it changes."""
        slot = self.parts.pop(path.name, None)
        if slot is None or rank in self.spares:
            return False
        hidden = self.root / slot_name(rank)
        os.rename(path, hidden)
        for name in ("header.json", "index.json"):
            (hidden / name).unlink(missing_ok=True)
        slot.path = hidden
        self.spares[rank] = slot
        return True

    def receiver(self, rank: int, nbytes: int) -> torch.Tensor | None:
        slot = self.take(rank, nbytes)
        if slot is None:
            return None
        self.receiving[rank] = slot
        return slot.buffer[:nbytes]

    def received(self, rank: int, data: torch.Tensor) -> Slot | None:
        """The slot ``data`` (``rank``'s replica) was received into, else None."""
        slot = self.receiving.pop(rank, None)
        if slot is not None and slot.buffer.data_ptr() != data.data_ptr():
            self.spare(rank, slot)
            return None
        return slot

    def unused_receivers(self) -> None:
        for rank, slot in self.receiving.items():
            self.spare(rank, slot)
        self.receiving.clear()

    def release(self) -> None:
        for slot in self.spares.values():
            shutil.rmtree(slot.path, ignore_errors=True)
        self.spares.clear()
        self.parts.clear()


def fill(slot: Slot, leaves: Sequence[Leaf], used: int) -> tuple[list[int], int, int]:
    """Where each leaf lies in ``slot``'s data file, the file's size and the copies made: the
    leaves in the slot's mapping stay where they are; the others (pinned, or past its
    capacity; ``used``: the bytes carved) are written after them.

    Raises:
        OSError: the file system refused a write (a full tmpfs).
    """
    offsets, extra, end = [], [], used
    for leaf in leaves:
        if slot.holds(leaf.data):
            offsets.append(slot.offset(leaf.data))
            continue
        offset = align(end)
        end = offset + leaf.nbytes
        offsets.append(offset)
        extra.append((leaf, offset))
    size = max(end, slot.capacity)
    if extra:
        with open(slot.path / DATA, "r+b") as f:
            for leaf, offset in extra:
                f.seek(offset)
                f.write(leaf.raw().data)
            f.truncate(size)
    slot.size = size
    return offsets, size, len(extra)


def hash_file(slot: Slot, size: int) -> str:
    """The hash of ``slot``'s data file of ``size`` bytes, read through its mapping (the tail
    past it, where leaves that did not fit were written, read from the file)."""
    hasher = chunk_hasher()
    if slot.capacity:
        hasher.update(slot.buffer.numpy().data)
    if size > slot.capacity:
        with open(slot.path / DATA, "rb") as f:
            f.seek(slot.capacity)
            while block := f.read(min(size - f.tell(), 16 << 20)):
                hasher.update(block)
    return str(hasher.hexdigest())


def sweep(parts: Path) -> None:
    """Delete the hidden slots and torn writes left in ``parts`` by processes that are gone
    (on this node; their pages would stay in memory until the node reboots)."""
    try:
        entries = list(parts.iterdir())
    except OSError:
        return
    for path in entries:
        if not path.name.startswith((".slot-", ".tmp-")):
            continue
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
