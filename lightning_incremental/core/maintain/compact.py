"""Compaction: rewriting a committed checkpoint as a full base (no deltas), through the same part
and assembly code as a save, so that older checkpoints can be removed without breaking a chain.

The full base is written as a new version of the step's manifest, fenced like a commit (checked
before and after the write; a version written by a fenced-off writer is never visible), and the
versions it supersedes are removed only after that (:mod:`~..commit.versions`)."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from lightning_incremental.core.chunks.delta_base import Parent
from lightning_incremental.core.commit.committer import Committed, Committer, Part, assemble
from lightning_incremental.core.commit.versions import Versions
from lightning_incremental.core.errors import (
    CorruptCheckpointError,
    StepError,
    WriterLeaseError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import Manifest, PieceEntry, TensorEntry
from lightning_incremental.core.format.tree import Leaf
from lightning_incremental.core.load.pipeline import restore_chunks
from lightning_incremental.core.load.restore import allocating
from lightning_incremental.core.load.targets import ChunkTarget


def rewrite_as_base(
    committer: Committer,
    pool: Executor,
    step: int,
    generation: int,
    may_delete: Callable[[], None],
) -> tuple[Committed, Part, list[Leaf], Manifest] | None:
    """Rewrite committed checkpoint ``step`` as a full base, through the same part and assembly
    code as a save, written by a writer of ``generation`` as a new version of the step's
    manifest; returns the new manifest's commit, its part, the decoded leaves and the old
    manifest — or None when it is a full base already. Once the new version is known to be
    visible, the versions it supersedes are removed (``may_delete`` raises when this process
    may no longer delete). The caller holds the write lock.

    A sharded tensor keeps its layout: each stored piece is decoded and rewritten as a piece
    with the same offsets and sizes (never gathered into a whole tensor), so every rank of the
    next distributed save finds its own piece, under the same key, as its delta base.

    Raises:
        CorruptCheckpointError: the checkpoint does not restore (it is then quarantined).
        FencedError: a newer generation took over (the step stays as it was committed).
        WriterLeaseError: this process lost the writer lease.
    """
    storage, history = committer.storage, committer.history
    doc = history.read(step)
    if all(r.depth == 0 for r in doc.chunks.values()):
        return None
    where = f"step {step} of {storage.url}"
    arrays = [(slot, t, a) for slot, t in enumerate(doc.tensors) for a in t.arrays()]
    try:
        buffers = [allocating(a, where, _flat_buffer)[1] for _, _, a in arrays]
        restore_chunks(
            storage,
            doc,
            pool,
            where,
            [ChunkTarget(a.chunks, raw) for (_, _, a), raw in zip(arrays, buffers)],
        )
    except CorruptCheckpointError:
        history.saw_damage(step)
        raise
    leaves = [
        Leaf(
            path=t.path,
            data=torch.from_numpy(raw),
            dtype=t.dtype,
            shape=list(a.shape),
            device=t.device,
            width=t.width,
            is_numpy=t.numpy,
            parameter=t.param,
            requires_grad=t.requires_grad,
            slot=slot,
            offsets=None if piece is None else piece.offsets,
        )
        for (slot, t, a), raw, piece in zip(arrays, buffers, _pieces_of(doc))
    ]
    part = committer.write_part(step, leaves, parent=Parent(step, doc), full=True)
    manifest = assemble(
        step,
        [part],
        generation=generation,
        chunk_size=committer.config.chunk_size,  # what the chunks were cut with now
        audit={**doc.audit, "compacted": datetime.datetime.now(datetime.timezone.utc).isoformat()},
        tree=doc.tree,
        pickled=doc.pickled,
        created=doc.created,
        extra=doc.extra,
        tensors=_same_layout(doc.tensors, part.tensors),
    )
    manifest = dataclasses.replace(manifest, parent=doc.parent)
    data, manifest = canonical.seal(manifest, where)
    start = time.perf_counter()
    fencing, lease = committer.fencing, committer.lease
    fencing.check_compaction(step, generation, "not written")
    lease.check()
    path = mf.manifest_path(step, generation)
    if not storage.put(path, data) and storage.get(path) != data:
        raise StepError(
            f"{path} of {storage.url} exists already with other content: another compaction "
            f"of step {step} by generation {generation}; the step is left as it is"
        )
    fencing.check_compaction(step, generation, "written after a newer generation took over")
    try:
        lease.check()
    except WriterLeaseError as exc:
        raise WriterLeaseError(
            f"{exc}. The compacted manifest {path} was written: the writer that took over "
            "decides whether it is visible, and the step restores either way"
        ) from exc
    history.trust(manifest.packs)
    # Known visible now: a later claim lists it (it lists after taking the lease, which we
    # still held after writing it), so the versions it supersedes can go.
    may_delete()
    for old in history.written().get(step, Versions()).superseded(step, generation):
        storage.delete(old)
    history.visible()
    return Committed(manifest, len(data), time.perf_counter() - start), part, leaves, doc


def _pieces_of(doc: Manifest) -> list[PieceEntry | None]:
    """For each array of ``doc`` (in :meth:`TensorEntry.arrays` order), its piece or None."""
    return [p for t in doc.tensors for p in (t.pieces if t.pieces is not None else [None])]


def _same_layout(
    tensors: Sequence[TensorEntry], encoded: Sequence[TensorEntry]
) -> list[TensorEntry]:
    """The tensor table of ``tensors`` with the chunks of ``encoded`` (one entry per array, in
    :meth:`TensorEntry.arrays` order): whole tensors as encoded, pieces in place."""
    arrays = iter(encoded)
    out = []
    for entry in tensors:
        if entry.pieces is None:
            out.append(next(arrays))
            continue
        pieces = tuple(dataclasses.replace(p, chunks=next(arrays).chunks) for p in entry.pieces)
        out.append(
            dataclasses.replace(
                entry, pieces=pieces, chunks=tuple(d for p in pieces for d in p.chunks)
            )
        )
    return out


def _flat_buffer(entry: TensorEntry) -> tuple[None, np.ndarray]:
    return None, np.empty(entry.nbytes, np.uint8)
