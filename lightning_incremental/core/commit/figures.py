"""The figures a committed save returns (:class:`~lightning_incremental.core.results.SaveResult`)
from its parts' encodings and its manifest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.results import SaveResult

if TYPE_CHECKING:
    from lightning_incremental.core.chunks.encode import Encoded
    from lightning_incremental.core.commit.committer import Committed, Part


def save_result(
    parts: Sequence[Part],
    committed: Committed,
    *,
    previous: Manifest | None,
    snapshot_s: float,
    wait_s: float,
    total_s: float,
) -> SaveResult:
    """The figures of a committed save (``previous``: the parent's manifest, whose objects
    were not written again)."""
    figures = [p.encoded for p in parts]
    before = previous.packs if previous is not None else {}
    stats = committed.manifest.stats
    return SaveResult(
        step=committed.manifest.step,
        bytes_logical=stats["bytes_logical"],
        bytes_written=stats["bytes_data"] + committed.nbytes,
        snapshot_s=snapshot_s,
        wait_s=wait_s,
        encode_s=sum(f.encode_s for f in figures),
        write_s=sum(f.write_s for f in figures) + committed.write_s,
        total_s=total_s,
        full_base=stats["full_base"],
        chunks_total=stats["chunks_total"],
        chunks_reused=stats["chunks_reused"],
        chunks_delta=stats["chunks_delta"],
        chunks_full=stats["chunks_full"],
        objects_written=sum(1 for p in committed.manifest.packs if p not in before),
        warnings=committed.warnings,
        effort=effort_of(figures),
        chunks_as_is=sum(f.chunks_as_is for f in figures),
    )


def effort_of(figures: Sequence[Encoded]) -> str:
    """``SaveResult.effort`` of a save whose parts were encoded as ``figures``."""
    if any(f.fast for f in figures):
        return "fast"
    return "paced" if any(f.chunks_as_is for f in figures) else "full"
