"""A memory part's three files and their checks, what the tier writes and reads.

A part is a directory ``s<step>-g<generation>-r<rank>`` holding ``data.bin`` (every tensor's raw
bytes, 64-byte aligned), ``index.json`` (the skeleton and each tensor's dtype, shape and offset)
and ``header.json`` (job, generation, world size, layout, rank, step, and the size and xxh3-128
hash of the two other files). Here: the names, the records an inventory and a transfer are made
of (:class:`Held`, :class:`Part`, :class:`Snapshot`), and the parsing and checks of a header and
an index read back (every malformed field a :class:`MemoryPartError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.buffers import BufferPool, collection_paused
from lightning_incremental.core.codecs.bytes import chunk_hash
from lightning_incremental.core.format.layout import loads_record
from lightning_incremental.core.format.tree import Leaf
from lightning_incremental.core.save.snapshot import flatten
from lightning_incremental.runtime.memory.read import MemoryPartError
from lightning_incremental.runtime.memory.slots import Slot

FORMAT = 1
HEADER, INDEX, DATA = "header.json", "index.json", "data.bin"
ALIGN = 64
NAME = re.compile(r"^s(\d+)-g(\d+)-r(\d+)$")




@dataclass(frozen=True)
class Held:
    """One complete part a node holds, as its header says (what inventories are made of)."""

    rank: int  # whose part
    step: int
    generation: int
    job: str
    world_size: int
    layout: int = 0  # k > 0: only every k-th rank's part holds the replicated state (see steps)


@dataclass
class Snapshot:
    """A state copied to host memory, ready to be written by another thread: into ``slot``'s
    mapped file where it fit (``used`` bytes of it), else into buffers of its own."""

    skeleton: Any
    leaves: list[Leaf]
    slot: Slot | None = None
    used: int = 0

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers outside the slot (for the snapshot pool to reuse)."""
        slot = self.slot
        return [leaf.data for leaf in self.leaves if slot is None or not slot.holds(leaf.data)]


@dataclass
class Part:
    """A part's three files in memory: what a replica transfer moves."""

    header: bytes
    index: bytes
    data: torch.Tensor  # uint8, 1-D (a private view of the file when read from disk)


def snapshot(state: Any, *, allow_pickle: bool = False, pool: BufferPool | None = None) -> Snapshot:
    """Copy ``state`` to host memory with the engine's snapshot (on the caller's thread), into
    buffers recycled from ``pool`` when given (pinned for CUDA tensors)."""
    skeleton, leaves, _ = flatten(state, allow_pickle=allow_pickle, pool=pool)
    return Snapshot(skeleton, leaves)


def entry(leaf: Leaf, offset: int) -> dict[str, Any]:
    return {
        "slot": leaf.slot,
        "dtype": leaf.dtype,
        "numpy": leaf.is_numpy,
        "shape": leaf.shape,
        "offset": offset,
        "nbytes": leaf.nbytes,
        "param": leaf.parameter,
        "grad": leaf.requires_grad,
    }


def raw(data: torch.Tensor) -> np.ndarray:
    return data.numpy() if data.numel() else np.empty(0, dtype=np.uint8)


def parse_header(raw: bytes) -> dict[str, Any]:
    try:
        head = loads_record(raw)
    except ValueError as exc:
        raise MemoryPartError(f"unreadable header: {exc}") from exc
    ints = ("generation", "world_size", "rank", "step", "layout")
    if isinstance(head, dict):
        head.setdefault("layout", 0)  # parts written before layouts: every part whole
    if (
        not isinstance(head, dict)
        or head.get("format") != FORMAT
        or not isinstance(head.get("job"), str)
        or not all(type(head.get(k)) is int and head[k] >= 0 for k in ints)
        or not isinstance(head.get("files"), dict)
        or not all(file_entry(head["files"].get(name)) for name in (INDEX, DATA))
    ):
        raise MemoryPartError(f"not a memory part header of format {FORMAT}")
    return head


def file_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and type(entry.get("size")) is int
        and entry["size"] >= 0
        and isinstance(entry.get("hash"), str)
    )


def read_index(raw: bytes, where: Any) -> dict[str, Any]:
    """A part's index (its hash checked already): the skeleton and the list of its tensors.

    Raises:
        MemoryPartError: not such an object.
    """
    try:
        with collection_paused():
            body = loads_record(raw)
    except ValueError as exc:
        raise MemoryPartError(f"{where} is unreadable: {exc}") from exc
    if not isinstance(body, dict) or "skeleton" not in body or "leaves" not in body:
        raise MemoryPartError(f"{where} is not the index of a memory part")
    return body


def check(name: str, data: bytes | np.ndarray, head: dict[str, Any]) -> None:
    expected = head["files"].get(name) or {}
    size = len(data) if isinstance(data, bytes) else int(data.nbytes)
    if size != expected.get("size") or chunk_hash(data) != expected.get("hash"):
        raise changed(name, head)


def changed(name: str, head: dict[str, Any]) -> MemoryPartError:
    return MemoryPartError(
        f"{name} of rank {head['rank']}'s part of step {head['step']} does not match its "
        "hash: the memory copy changed after it was written"
    )
