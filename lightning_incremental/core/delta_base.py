"""The delta base: what the next save is encoded against.

The save side owns it. After a commit the snapshot just written becomes the next save's XOR base
(within ``StoreConfig.xor_base_memory``); after a restore the store *tells* it which checkpoint
was restored (:meth:`DeltaBase.adopt`), and the next save reads its bases from storage. Buffers
of a replaced base go back to the snapshot pool.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.format import Manifest, TensorEntry
from lightning_incremental.core.tree import Leaf


@dataclass
class Parent:
    """The newest committed checkpoint, as the next save builds on it."""

    step: int
    manifest: Manifest
    # XOR base: tensor path -> (its raw bytes, its chunk hashes); only what fits the budget.
    base: dict[str, tuple[np.ndarray, tuple[str, ...]]] = field(default_factory=dict)
    # The host buffers behind ``base``, recycled once a newer parent replaces this one.
    buffers: list[torch.Tensor] = field(default_factory=list)


class DeltaBase:
    """The parent of the next save, and the pool its snapshot buffers are recycled through."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.pool = BufferPool()
        self._lock = threading.Lock()
        self._parent: Parent | None = None

    @property
    def parent(self) -> Parent | None:
        return self._parent

    @property
    def step(self) -> int | None:
        parent = self._parent
        return parent.step if parent is not None else None

    def pinned(self) -> set[str]:
        """The objects the next save may reference: retention keeps them."""
        parent = self._parent
        return set(parent.manifest.packs) if parent is not None else set()

    def set(self, parent: Parent | None, spare: Sequence[torch.Tensor] = ()) -> None:
        """Make ``parent`` the base of the next save; recycle the buffers no longer needed."""
        with self._lock:
            old, self._parent = self._parent, parent
        self.pool.give(list(spare) + (old.buffers if old is not None else []))

    def committed(self, manifest: Manifest, leaves: list[Leaf]) -> None:
        """``manifest`` (written from ``leaves``) committed: it is the next save's base, its
        bytes kept in memory within ``config.xor_base_memory``."""
        self.set(*next_parent(manifest, leaves, manifest.tensors, self.config))

    def adopt(self, step: int, manifest: Manifest) -> None:
        """A restore returned checkpoint ``step``, the newest committed one: build the next save
        on it (bases read from storage), unless it already is the base."""
        if self.step != step:
            self.set(Parent(step, manifest))

    def release(self, leaves: list[Leaf], step: int) -> None:
        """A save of ``step`` failed: its snapshot buffers are free again, unless they became
        the base."""
        if self.step != step:
            self.pool.give([leaf.data for leaf in leaves if not leaf.is_numpy])

    def clear(self) -> None:
        self._parent = None
        self.pool.clear()


def next_parent(
    manifest: Manifest,
    leaves: list[Leaf],
    tensors: tuple[TensorEntry, ...] | list[TensorEntry],
    config: StoreConfig,
) -> tuple[Parent, list[torch.Tensor]]:
    """The parent of the next save after ``manifest`` committed: its XOR base is this snapshot's
    bytes, tensor by tensor, within ``config.xor_base_memory``. Also returns the snapshot buffers
    the base does not keep (free to recycle)."""
    parent = Parent(manifest.step, manifest)
    spare: list[torch.Tensor] = []
    used, budget = 0, config.xor_base_memory
    for leaf, entry in zip(leaves, tensors):
        raw = leaf.raw()
        if not config.uses_xor or (budget is not None and used + raw.size > budget):
            spare.append(leaf.data)
            continue
        parent.base[leaf.path] = (raw, entry.chunks)
        parent.buffers.append(leaf.data)
        used += raw.size
    return parent, spare
