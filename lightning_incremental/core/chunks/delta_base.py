"""The delta base: what the next save is encoded against.

The save side owns it. After a commit the snapshot just written becomes the next save's XOR base
(within ``StoreConfig.xor_base_memory``); after a restore the store *tells* it which checkpoint
was restored (:meth:`DeltaBase.adopt`), and the next save reads its bases from storage. Buffers
of a replaced base go back to the snapshot pool.

**Held chunks.** A chunk whose chain (a standalone root, then deltas) has room for one delta only
— dense fp32 training: a root is ~0.83x the raw bytes, a delta ~0.65-0.75x, the bound 2x — would
alternate: delta, standalone, delta, standalone. Instead, once it is a delta on its root with no
room for another after it, its base stays the *root* (:func:`hold`): the next save codes it
against the root again (a delta over a longer distance, usually still much smaller than a
standalone copy), and so on while that delta stays under ``HOLD_MAX`` of the root's size. The
chain stays root + one delta, so a restore reads less than under alternation. Content addressing
keeps this safe: a held chunk's bytes are, by hash, the base its new delta was coded against, and
that base is in the new checkpoint's chunk table (adopted with the delta) and its packs pinned.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_incremental.core.buffers import BufferPool, collection_paused
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, TensorEntry
from lightning_incremental.core.format.tree import Leaf


@dataclass
class Parent:
    """The newest committed checkpoint, as the next save builds on it."""

    step: int
    manifest: Manifest
    # XOR base: tensor path -> (its raw bytes, its chunk hashes); only what fits the budget.
    base: dict[str, tuple[np.ndarray, tuple[str, ...]]] = field(default_factory=dict)
    # The host buffer behind each ``base`` entry, recycled once a newer parent replaces this one.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # ... or the snapshot slab it lies in (small tensors): a slab is recycled whole once no
    # parent's entry lies in it.
    slabs: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest | None) -> Parent | None:
        """The next save built on committed ``manifest`` (its bases read from storage), or on
        nothing."""
        return cls(manifest.step, manifest) if manifest is not None else None


class DeltaBase:
    """The parent of the next save, and the pool its snapshot buffers are recycled through."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.pool = BufferPool()
        self._lock = threading.Lock()
        self._parent: Parent | None = None
        # compactions and deletes at the location that the parent takes into account (see
        # commit.rewrites; the store sets it to the count when it opens)
        self.rewrites_seen = 0

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
        """Make ``parent`` the base of the next save; recycle the buffers no longer needed
        (``spare``, and those of the replaced parent that ``parent`` does not keep)."""
        with self._lock:
            self._replace(parent, spare)

    def _replace(
        self,
        parent: Parent | None,
        spare: Sequence[torch.Tensor],
        spare_slabs: Sequence[torch.Tensor] = (),
    ) -> None:
        old, self._parent = self._parent, parent
        kept = {id(b) for b in parent.buffers.values()} if parent is not None else set()
        olds = old.buffers.values() if old is not None else ()
        dropped = [b for b in olds if id(b) not in kept]
        self.pool.give(list(spare) + dropped)
        kept_slabs = _unique(parent.slabs.values()) if parent is not None else {}
        old_slabs = _unique(old.slabs.values()) if old is not None else {}
        self.pool.give_slabs(
            [s for k, s in old_slabs.items() if k not in kept_slabs] + list(spare_slabs)
        )

    def committed(
        self,
        manifest: Manifest,
        leaves: list[Leaf],
        tensors: Sequence[TensorEntry] | None = None,
    ) -> None:
        """``manifest`` (written from ``leaves``) committed: it is the next save's base, its
        bytes kept in memory within ``config.xor_base_memory``. ``tensors``: the entries the
        leaves were encoded as, when not the manifest's own (this rank's part of a sharded
        checkpoint)."""
        entries = manifest.tensors if tensors is None else tensors
        with self._lock, collection_paused():  # held buffers: the current parent's
            self._replace(*next_parent(manifest, leaves, entries, self.config, self._parent))

    def adopt(self, step: int, manifest: Manifest) -> None:
        """A restore returned checkpoint ``step``, the newest committed one: build the next save
        on it (bases read from storage), unless it already is the base."""
        if self.step != step:
            self.set(Parent(step, manifest))

    def release(self, leaves: list[Leaf], step: int) -> None:
        """A save of ``step`` failed: its snapshot buffers are free again, unless they became
        the base."""
        if self.step != step:
            self.pool.give([x.data for x in leaves if not x.is_numpy and x.slab is None])
            slabs = _unique(x.slab for x in leaves if x.slab is not None)
            self.pool.give_slabs(list(slabs.values()))

    def clear(self) -> None:
        self._parent = None
        self.pool.clear()


#: A chunk is held on its root (see the module's doc) while its delta is smaller than this
#: fraction of the root's payload; past it the chunk moves on and its next save is a new root.
#: Deltas against an older root grow slowly with the distance (fp32 AdamW training, 10-step
#: interval: ~0.645x raw at 10 steps, 0.69x at 50, against a 0.83x root); exp_avg's deltas are as
#: large as a standalone copy and never held.
HOLD_MAX = 0.9


def hold(recipe: ChunkRecipe, base: ChunkRecipe | None, max_chain_ratio: float) -> bool:
    """Whether the next save should code this chunk (``recipe``: as just committed; ``base``:
    the recipe of its base) against that base again, rather than against the chunk as just
    committed: it is a lossless delta on a standalone root, no second delta of its size would
    fit the chain bound after it, and it is still under ``HOLD_MAX`` of the root's size."""
    if base is None or recipe.base is None or not (recipe.lossless and base.lossless):
        return False
    if base.base is not None:  # not a root: a delta itself
        return False
    payload = recipe.chain - base.chain
    if payload <= 0 or payload >= HOLD_MAX * base.chain:
        return False
    return recipe.chain + payload > max_chain_ratio * recipe.size


def next_parent(
    manifest: Manifest,
    leaves: list[Leaf],
    tensors: Sequence[TensorEntry],
    config: StoreConfig,
    previous: Parent | None = None,
) -> tuple[Parent, list[torch.Tensor], list[torch.Tensor]]:
    """The parent of the next save after ``manifest`` committed: its XOR base is this snapshot's
    bytes, tensor by tensor, within ``config.xor_base_memory`` — except chunks held on their root
    (:func:`hold`), whose bytes stay those of ``previous`` (the parent this save was coded on):
    a tensor with held chunks keeps the previous buffer, this snapshot's other chunks copied into
    it. Also returns the snapshot buffers the base does not keep (free to recycle), and the
    snapshot slabs none of whose tensors it keeps."""
    parent = Parent(manifest.step, manifest)
    spare: list[torch.Tensor] = []
    seen: dict[int, torch.Tensor] = {}
    used, budget = 0, config.xor_base_memory
    for leaf, entry in zip(leaves, tensors):
        raw, slab, key = leaf.raw(), leaf.slab, leaf.key
        if slab is not None:
            seen[id(slab)] = slab
        if not config.uses_xor or (budget is not None and used + raw.size > budget):
            if slab is None:
                spare.append(leaf.data)
            continue
        used += raw.size
        before = previous.base.get(key) if previous is not None else None
        if before is None or before[1] == entry.chunks:  # unchanged: nothing coded to hold
            held = []
        else:
            held = _held(entry, before, raw, manifest, config)
        if not any(held):
            parent.base[key] = (raw, entry.chunks)
            if slab is None:
                parent.buffers[key] = leaf.data
            else:
                parent.slabs[key] = slab
            continue
        assert before is not None and previous is not None
        old, digests = before[0], list(before[1])
        step = config.chunk_size
        for index, keep in enumerate(held):
            if not keep and digests[index] != entry.chunks[index]:
                old[index * step : (index + 1) * step] = raw[index * step : (index + 1) * step]
                digests[index] = entry.chunks[index]
        parent.base[key] = (old, tuple(digests))
        if key in previous.slabs:
            parent.slabs[key] = previous.slabs[key]
        else:
            parent.buffers[key] = previous.buffers[key]
        if slab is None:
            spare.append(leaf.data)
    kept = _unique(parent.slabs.values())
    return parent, spare, [s for k, s in seen.items() if k not in kept]


def _unique(slabs: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The distinct tensor objects of ``slabs`` (the leaves of one slab share one), by id."""
    return {id(s): s for s in slabs}


def _held(
    entry: TensorEntry,
    before: tuple[np.ndarray, tuple[str, ...]],
    raw: np.ndarray,
    manifest: Manifest,
    config: StoreConfig,
) -> list[bool]:
    """Per chunk of ``entry``: whether it is held on the bytes ``before`` holds (its base)."""
    old, digests = before
    if old.size != raw.size or len(digests) != len(entry.chunks):
        return []
    chunks = manifest.chunks
    out = []
    for index, digest in enumerate(entry.chunks):
        recipe = chunks.get(digest)
        if recipe is None or recipe.base is None or recipe.base != digests[index]:
            out.append(False)  # not coded against these bytes (or unchanged: nothing to hold)
            continue
        out.append(hold(recipe, chunks.get(recipe.base), config.max_chain_ratio))
    return out
