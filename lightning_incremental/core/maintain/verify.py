"""Verification of stored checkpoints: every chunk of a manifest read back, decoded and checked
against its hash; which objects of a store are damaged.

Functions of a storage and manifests (and, for :func:`verify_step`, the store's history), so
the store's methods stay short and the logic can be read (and tested) in one place.
"""

from __future__ import annotations

import logging

import numpy as np

from lightning_incremental.core.chunks.decode import decode_chunk
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.commit.history import History
from lightning_incremental.core.errors import CheckpointError, CorruptCheckpointError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.results import ObjectCheck, VerifyReport
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")


def verify_manifest(
    storage: Storage, doc: Manifest, report: VerifyReport, where: str
) -> VerifyReport:
    """Read every object ``doc`` names, check its size and content hash, then decode every chunk
    and check its hash; record each finding in ``report``."""
    blobs: dict[str, memoryview] = {}
    read: dict[str, memoryview] = {}
    for path, size in sorted(doc.packs.items()):
        check = ObjectCheck(path=path, ok=False, size=size)
        try:
            data = storage.get(path)
        except FileNotFoundError:
            check.error = "missing"
        else:
            digest = chunk_hash(data)
            if len(data) != size:
                check.error = f"size {len(data)}, expected {size}"
            elif mf.pack_path(digest) != path:
                check.error = "content hash does not match its name"
            else:
                check.ok = True
            read[path] = memoryview(data)  # decoded below even when bad: names the chunks hit
            report.bytes_checked += len(data)
        report.objects.append(check)
    for digest, recipe in doc.chunks.items():
        view = read.get(recipe.pack)
        if view is not None:
            blobs[digest] = view[recipe.offset : recipe.offset + recipe.length]
    for digest, recipe in doc.chunks.items():
        out = np.empty(recipe.size, dtype=np.uint8)
        try:
            decode_chunk(digest, doc.chunks, blobs, out, where)
        except KeyError:
            report.errors.append(f"chunk {digest}: its object {recipe.pack} is unreadable")
        except CorruptCheckpointError as exc:
            report.errors.append(str(exc))
        report.chunks_checked += 1
    return report


def verify_step(storage: Storage, history: History, step: int | None) -> VerifyReport:
    """Verify one committed checkpoint (default: the newest) with :func:`verify_manifest`; a
    damaged one is recorded in ``history`` (quarantine, fallback).

    Raises:
        CheckpointNotFoundError: empty store or missing step.
    """
    step = history.resolve(step)
    report = VerifyReport(step=step)
    try:
        doc = history.read(step)
    except CheckpointError as exc:
        report.errors.append(str(exc))
    else:
        report.lossy = doc.lossy_tensors
        verify_manifest(storage, doc, report, f"step {step} of {storage.url}")
    if not report.ok:
        history.saw_damage(step)
    return report
