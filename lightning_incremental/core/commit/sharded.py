"""The save of a sharded state: every rank writes its own part, the coordinator commits one
manifest, every rank learns the outcome.

1. Each rank encodes the arrays it snapshotted (its pieces of sharded tensors; on rank 0 also
   the plain tensors) against its own delta base and writes their objects
   (:meth:`~lightning_incremental.core.commit.committer.Committer.write_part`).
2. Every rank sends a :class:`PartRecord` (its part's tables, or the error that stopped it) to
   the coordinator over the store's own group (:mod:`.commit.group`); the objects stay where the
   rank wrote them: nothing but these records is gathered.
3. The coordinator merges the records into one tensor table (:func:`merge`: each sharded
   tensor's global shape and dtype, and every stored piece's box and chunks), and commits the
   manifest (validated: the pieces must tile every tensor; fenced), or fails.
4. The outcome is broadcast: every rank's save returns, or raises the same error type.

A checkpoint that lacks a part is never visible: the manifest is only written once every record
arrived whole and every object it names is present.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core.buffers import collection_paused
from lightning_incremental.core.chunks.encode import Encoded
from lightning_incremental.core.commit.committer import Committed, Committer, Part
from lightning_incremental.core.commit.figures import effort_of
from lightning_incremental.core.commit.group import Group, describe_error, rebuild
from lightning_incremental.core.errors import DistributedSaveError, ManifestError
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format.records import Manifest, PieceEntry, TensorEntry
from lightning_incremental.core.format.tree import Flat, ShardedInfo, torch_dtype
from lightning_incremental.core.results import SaveResult

log = logging.getLogger("lightning_incremental")


@dataclass(frozen=True)
class PartRecord:
    """What one rank reports to the coordinator.

    Attributes:
        rank, step: who, for which checkpoint.
        slots: how many tensors the rank's skeleton has (every rank walks the same state).
        part: its durable part, None when writing it failed (``error``).
        arrays: for each tensor of ``part``, its slot and, for a piece, the piece's offsets.
        sharded: the slots of sharded tensors and their global description.
        error: ``(type name, message)`` of the error that stopped the rank.
    """

    rank: int
    step: int
    slots: int
    part: Part | None
    arrays: tuple[tuple[int, tuple[int, ...] | None], ...]
    sharded: Mapping[int, ShardedInfo]
    error: tuple[str, str] | None = None


def make_record(
    rank: int, step: int, flat: Flat, part: Part | None, error: BaseException | None
) -> PartRecord:
    """This rank's record; the part's encoder figures are kept, its duplicate tables dropped."""
    if part is not None:
        enc = part.encoded
        light = Encoded(
            tensors=[],
            chunks={},
            packs={},
            bytes_written=enc.bytes_written,
            encode_s=enc.encode_s,
            write_s=enc.write_s,
            chunks_total=enc.chunks_total,
            chunks_reused=enc.chunks_reused,
            chunks_delta=enc.chunks_delta,
            chunks_full=enc.chunks_full,
        )
        part = dataclasses.replace(part, encoded=light)
    return PartRecord(
        rank=rank,
        step=step,
        slots=flat.slots,
        part=part,
        arrays=tuple((leaf.slot, leaf.offsets) for leaf in flat.leaves),
        sharded=dict(flat.sharded),
        error=describe_error(error) if error is not None else None,
    )


def merge(records: Sequence[PartRecord]) -> list[TensorEntry]:
    """The manifest's tensor table, slot by slot: a plain tensor's entry as its writer encoded
    it; a sharded tensor as its global description and every piece the ranks wrote (a piece
    reported twice, as an HSDP replica is, once).

    Raises:
        ManifestError: records that do not describe one state (other slots, another sharded
            layout), or a tensor no rank wrote.
    """
    # A few objects per piece, all of them live (the manifest's table): the collections they
    # triggered rescanned the records and the table again and again, and a full one now and
    # then took a merge of 4,096 ranks' records from about 55 ms to over 200 ms.
    with collection_paused():
        return _merge(records)


def _merge(records: Sequence[PartRecord]) -> list[TensorEntry]:
    first = records[0]
    plain: dict[int, TensorEntry] = {}
    pieces: dict[int, dict[tuple[tuple[int, ...], tuple[int, ...]], PieceEntry]] = {}
    for record in records:
        if record.slots != first.slots or set(record.sharded) != set(first.sharded):
            raise ManifestError(
                f"step {record.step}: rank {record.rank} saved a state of another structure "
                f"than rank {first.rank} ({record.slots} tensors, {len(record.sharded)} "
                f"sharded; rank {first.rank}: {first.slots}, {len(first.sharded)}): every rank "
                "must save the same state dict"
            )
        assert record.part is not None
        for entry, (slot, offsets) in zip(record.part.tensors, record.arrays):
            if offsets is None:
                plain.setdefault(slot, entry)
                continue
            info = first.sharded.get(slot)
            if info is None or record.sharded[slot] != info:
                raise ManifestError(
                    f"step {record.step}: rank {record.rank} describes sharded tensor "
                    f"{entry.path} otherwise than rank {first.rank}"
                )
            piece = PieceEntry(offsets, entry.shape, entry.chunks)
            pieces.setdefault(slot, {}).setdefault((offsets, entry.shape), piece)
    tensors = []
    for slot in range(first.slots):
        info = first.sharded.get(slot)
        if info is not None:
            stored = tuple(sorted(pieces.get(slot, {}).values(), key=lambda p: p.offsets))
            tensors.append(
                TensorEntry(
                    path=info.path,
                    dtype=info.dtype,
                    shape=info.shape,
                    nbytes=math.prod(info.shape) * torch_dtype(info.dtype).itemsize,
                    width=info.width,
                    device=info.device,
                    numpy=False,
                    param=info.parameter,
                    requires_grad=info.requires_grad,
                    chunks=tuple(d for p in stored for d in p.chunks),
                    pieces=stored,
                )
            )
        elif slot in plain:
            tensors.append(plain[slot])
        else:
            raise ManifestError(
                f"step {first.step}: tensor {slot} of the state was written by no rank"
            )
    return tensors


@dataclass(frozen=True)
class Outcome:
    """What the coordinator broadcasts: the committed manifest's bytes, or the error."""

    manifest: bytes | None
    error: tuple[str, str] | None = None


def commit_sharded(
    group: Group,
    committer: Committer,
    step: int,
    flat: Flat,
    write: Callable[[], Part],
    *,
    generation: Callable[[], int],
    audit: Mapping[str, Any],
) -> tuple[Part, Manifest, Committed | None]:
    """Run steps 1-4 of the module docstring on this rank. Returns its part, the committed
    manifest and, on the coordinator, the commit. ``generation``: the coordinator's
    generation, read when it commits (taking the lease in ``write`` may claim a new one).

    Raises:
        DistributedSaveError: a rank died or did not report within the group's timeout.
        Exception: this rank's own error, or on every rank the same type as the error that
            stopped the commit.
    """
    part: Part | None = None
    mine: BaseException | None = None
    try:
        part = write()
    except Exception as exc:  # reported to the coordinator, raised below
        mine = exc
    record = make_record(group.rank, step, flat, part, mine)
    try:
        records = group.gather(record)
    except Exception as exc:
        raise DistributedSaveError(
            f"step {step} not committed: a rank did not report its part ({type(exc).__name__}: "
            f"{exc}); it died, hangs, or saved another step"
        ) from (mine or exc)
    committed: Committed | None = None
    outcome = Outcome(None, ("CheckpointError", "no outcome"))
    if records is not None:
        try:
            committed = _coordinate(committer, step, records, flat, generation(), audit)
            outcome = Outcome(canonical.dumps(committed.manifest))
        except Exception as exc:
            outcome = Outcome(None, describe_error(exc))
    try:
        outcome = group.broadcast(outcome)
    except Exception as exc:
        raise DistributedSaveError(
            f"step {step}: the coordinator did not report whether the checkpoint committed "
            f"({type(exc).__name__}: {exc}); list the store's steps to find out"
        ) from exc
    if mine is not None:
        raise mine
    if outcome.error is not None:
        kind, message = outcome.error
        raise rebuild(kind, message)
    assert part is not None and outcome.manifest is not None
    if committed is not None:
        return part, committed.manifest, committed
    return part, canonical.loads(outcome.manifest, f"step {step}"), None


def _coordinate(
    committer: Committer,
    step: int,
    records: Sequence[PartRecord],
    flat: Flat,
    generation: int,
    audit: Mapping[str, Any],
) -> Committed:
    failed = [r for r in records if r.error is not None]
    if failed:
        kind, message = failed[0].error  # type: ignore[misc]
        others = f" (and ranks {[r.rank for r in failed[1:]]})" if len(failed) > 1 else ""
        raise rebuild(kind, f"step {step} not committed: rank {failed[0].rank}{others}: {message}")
    steps = {r.step for r in records}
    if steps != {step}:
        raise ManifestError(
            f"step {step} not committed: the ranks saved different steps {sorted(steps)}; every "
            "rank must call save with the same step"
        )
    tensors = merge(records)
    parts = [r.part for r in records if r.part is not None]
    return committer.commit(
        step,
        parts,
        generation=generation,
        audit=audit,
        tree=flat.skeleton,
        pickled=flat.pickled,
        tensors=tensors,
    )


def rank_result(
    part: Part,
    committed: Committed | None,
    *,
    snapshot_s: float,
    wait_s: float,
    total_s: float,
) -> SaveResult:
    """This rank's figures of a committed sharded save: what it snapshotted and wrote (the
    manifest counted on the coordinator)."""
    enc = part.encoded
    manifest_bytes = committed.nbytes if committed is not None else 0
    return SaveResult(
        step=part.step,
        bytes_logical=sum(t.nbytes for t in part.tensors),
        bytes_written=enc.bytes_written + manifest_bytes,
        snapshot_s=snapshot_s,
        wait_s=wait_s,
        encode_s=enc.encode_s,
        write_s=enc.write_s + (committed.write_s if committed is not None else 0.0),
        total_s=total_s,
        full_base=part.full_base,
        chunks_total=enc.chunks_total,
        chunks_reused=enc.chunks_reused,
        chunks_delta=enc.chunks_delta,
        chunks_full=enc.chunks_full,
        objects_written=len(part.written),
        warnings=committed.warnings if committed is not None else (),
        effort=effort_of([enc]),
        chunks_as_is=enc.chunks_as_is,
    )
