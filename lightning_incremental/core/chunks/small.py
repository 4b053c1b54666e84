"""The small tensors of a save, taken together: the tensors snapshotted into slabs
(:mod:`~lightning_incremental.core.save.slabs`), each one chunk, hashed, compared with the
parent and recorded in a tight loop instead of one by one through the encoder's general path.

At tens of thousands of small tensors the general path — a task, a future, a codec race, a
fresh manifest entry per tensor — cost tens of microseconds of Python each, most of a save's
time. Here:

- **Unchanged** (its hash is its chunk in the parent): the parent's chunk is referenced and,
  when nothing else about the tensor changed either, the parent's manifest entry is reused as
  it is (a few dictionary look-ups per tensor, no object made).
- **New, with nothing to code it against** (a full save, a tensor the parent lacks): stored as
  it is (codec ``s``) when under :data:`STORE_SMALL`, and appended to the pack straight from
  the slab. Compressing a chunk of a few KiB costs about a hundred microseconds (per-call
  overhead, not bytes: under 50 MB/s) and saves about a tenth of it on float weights; small
  tensors are a sliver of a real model's bytes, and their changes are still delta-coded
  against these stored chunks.
- **Changed, with a base** (the parent's bytes in memory or in storage): handed back to the
  general path, which delta-codes it (a few hundred of them when 1 % of 20,000 changed).

The manifest is the same as the general path's: one chunk per tensor, keyed by its hash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from lightning_incremental.core.chunks.lossy import lossy_codec
from lightning_incremental.core.codecs import STORED, chunk_hash
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.format.records import ChunkRecipe, TensorEntry
from lightning_incremental.core.format.tree import Leaf

if TYPE_CHECKING:
    from lightning_incremental.core.chunks.delta_base import Parent
    from lightning_incremental.core.chunks.encode import Encoded
    from lightning_incremental.core.chunks.packs import PackWriter

#: A new tensor under this many bytes (one chunk) with nothing to code it against is stored as
#: it is (see the module's documentation); the general path stores one so too. The chunks of a
#: larger tensor are coded whatever their size.
STORE_SMALL = 8 << 10


def small_leaves(leaves: list[Leaf], chunk_size: int) -> list[int]:
    """The indices of the leaves this path takes: slab leaves of one chunk."""
    return [
        i
        for i, leaf in enumerate(leaves)
        if leaf.flat_bytes is not None
        and leaf.offsets is None
        and leaf.flat_bytes.size <= chunk_size
    ]


def encode_small(
    leaves: list[Leaf],
    indices: list[int],
    entries: list[TensorEntry | None],
    *,
    parent: Parent | None,
    parent_chunks: Mapping[str, ChunkRecipe],
    has_base: Callable[[str, int], bool],
    out: Encoded,
    pack: PackWriter,
    scheduled: set[str],
    exact: set[str],
    adopt: Callable[[str], None],
    full_base: bool,
    config: StoreConfig,
) -> list[int]:
    """Record the leaves at ``indices`` (see :func:`small_leaves`) in ``entries``, referencing or
    writing their chunks; returns the indices left to the general path (changed tensors with
    a base to delta-code against, and tensors coded lossily). ``has_base(key, size)``: whether
    the general path would code a new chunk of that tensor against a base."""
    before: dict[str, TensorEntry] = (
        {t.path: t for t in parent.manifest.tensors if t.pieces is None} if parent else {}
    )
    lossy_possible = bool(config.lossy_codecs) or config.optimizer_state != "exact"
    raws = [leaves[i].flat_bytes for i in indices]
    digests = [chunk_hash(raw) for raw in raws]  # type: ignore[arg-type]
    chunks, packs, parent_packs = out.chunks, out.packs, parent.manifest.packs if parent else {}
    general: list[int] = []
    total = reused = written = 0
    for i, raw, digest in zip(indices, raws, digests):
        leaf = leaves[i]
        key = leaf.path
        if lossy_possible and lossy_codec(key, config, leaf.dtype) is not None:
            general.append(i)
            continue
        size = raw.size  # type: ignore[union-attr]
        if digest in chunks or digest in scheduled:
            reused += 1
        else:
            known = parent_chunks.get(digest)
            if known is not None and known.lossless and not (full_base and known.depth):
                if known.base is None:
                    chunks[digest] = known
                    packs[known.pack] = parent_packs[known.pack]
                else:
                    adopt(digest)
                reused += 1
            elif size >= STORE_SMALL or (not full_base and has_base(key, size)):
                general.append(i)
                continue
            else:
                scheduled.add(digest)
                fields = {"kind": STORED.kind, "size": size, "width": leaf.width, "chain": size}
                pack.add(digest, raw.data, fields, borrowed=True)  # type: ignore[union-attr]
                written += 1
        total += 1
        pack.remaining -= size
        exact.add(key)
        shape = tuple(leaf.shape)
        old = before.get(key)
        if (
            old is not None
            and old.chunks == (digest,)
            and old.shape == shape
            and old.dtype == leaf.dtype
            and old.param is leaf.parameter
            and old.requires_grad is leaf.requires_grad
            and old.device == leaf.device
            and old.width == leaf.width
            and not old.numpy
        ):
            entries[i] = old
        else:
            entries[i] = TensorEntry(
                path=key, dtype=leaf.dtype, shape=shape, nbytes=size, width=leaf.width,
                device=leaf.device, numpy=False, param=leaf.parameter,
                requires_grad=leaf.requires_grad, chunks=(digest,),
            )  # fmt: skip
    out.chunks_total += total
    out.chunks_reused += reused
    out.chunks_full += written
    return general
