"""Verification of stored checkpoints: every chunk of a manifest read back, decoded and checked
against its hash; which objects of a store are damaged.

Functions of a storage and manifests (and, for :func:`verify_step`, the store's history), so
the store's methods stay short and the logic can be read (and tested) in one place.

Memory stays bounded whatever the checkpoint's size, as in a restore: an object is hashed as it
streams in, and chunks are decoded from a cache of at most one read-ahead window of the objects'
bytes (``READ_AHEAD``, the restore's), in an order that keeps chunks sharing objects together.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from lightning_incremental.core.buffers import heap_frozen
from lightning_incremental.core.chunks.decode import MAX_READ, ObjectReader, Read, decode_chunk
from lightning_incremental.core.codecs.bytes import chunk_hasher
from lightning_incremental.core.commit.history import History
from lightning_incremental.core.errors import CheckpointError, ConfigError, CorruptCheckpointError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import Manifest, closure
from lightning_incremental.core.load import pipeline
from lightning_incremental.core.results import ObjectCheck, VerifyReport
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.storage.linked import LinkedStorage

log = logging.getLogger("lightning_incremental")

#: Bytes of objects a verification holds at a time (the restore's read-ahead window).
READ_AHEAD = pipeline.READ_AHEAD


def verify_manifest(
    storage: Storage,
    doc: Manifest,
    report: VerifyReport,
    where: str,
    *,
    read_ahead: int | None = None,
) -> VerifyReport:
    """Read every object ``doc`` names, check its size and content hash, then decode every chunk
    and check its hash; record each finding in ``report`` (every one, not only the first; the
    chunks a damaged object holds are named).

    At most about ``read_ahead`` bytes (default :data:`READ_AHEAD`) of the objects are held at a
    time: each object is hashed in ranges of half of it, and the chunks are decoded from a cache
    of coalesced ranges of at most ``read_ahead`` bytes (more only when one chunk's chain needs
    more), evicting the least recently used; a range evicted and needed again is read again.

    Raises:
        StorageError: reading failed (not damage: the objects could not be checked).
    """
    window = READ_AHEAD if read_ahead is None else read_ahead
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"read_ahead must be a positive number of bytes, got {read_ahead!r}")
    # A check per object and chunk, each live until the end (the report's): the collections
    # they trigger would rescan the whole heap, the manifest's records included, again and
    # again (two fifths of a gc plan's verification at 4,096 packs).
    with heap_frozen():
        missing = _check_objects(storage, doc, report, max(1, window // 2))
        _check_chunks(storage, doc, report, where, window, missing)
    if isinstance(storage, LinkedStorage):
        intact = {check.path for check in report.objects if check.ok}
        for path in sorted(intact & set(doc.packs) & set(storage.in_trash)):
            log.warning(
                "%s: object %s is intact in the trash of %s (the pool's collection moved it "
                "while a save wrote it again); the pool's next collection puts it back",
                where,
                path,
                storage.in_trash[path],
            )
    return report


def _check_objects(storage: Storage, doc: Manifest, report: VerifyReport, piece: int) -> set[str]:
    """Check the size and content hash of every object, streamed ``piece`` bytes at a time;
    returns the objects found missing."""
    missing: set[str] = set()
    for path, size in sorted(doc.packs.items()):
        check = ObjectCheck(path=path, ok=False, size=size)
        try:
            length, digest = _hash_object(storage, path, size, piece)
        except FileNotFoundError:
            check.error = "missing"
            missing.add(path)
        else:
            if length != size:
                check.error = f"size {length}, expected {size}"
            elif mf.pack_path(digest) != path:
                check.error = "content hash does not match its name"
            else:
                check.ok = True
            report.bytes_checked += length
        report.objects.append(check)
    return missing


def _hash_object(storage: Storage, path: str, size: int, piece: int) -> tuple[int, str]:
    """The length and content hash of object ``path`` (expected ``size`` bytes), read in ranges
    of at most ``piece`` bytes. The last range asks for one byte past ``size``, so that an object
    of the expected size is read without a request past its end, and a longer one is seen."""
    hasher = chunk_hasher()
    offset = 0
    while True:
        want = size + 1 - offset if 0 <= size - offset <= piece else piece
        data = storage.get_view(path, offset, offset + want)
        got = len(data)
        hasher.update(data)
        del data
        offset += got
        if got < want:
            return offset, hasher.hexdigest()


def _check_chunks(
    storage: Storage,
    doc: Manifest,
    report: VerifyReport,
    where: str,
    window: int,
    missing: set[str],
) -> None:
    """Decode every chunk of ``doc`` (its whole chain) and check its hash, within ``window``
    bytes of cached object ranges; errors are recorded in the manifest's order of chunks."""
    chunks = doc.chunks
    if not chunks:
        return
    chains = {digest: _chain(digest, doc) for digest in chunks}
    longest = max(len(chain) for chain in chains.values())
    # Ranges small enough that a whole chain's fit in half the window.
    plans = ObjectReader(storage, doc, where).plan(
        set(chunks), max_read=max(1, min(MAX_READ, window // (2 * longest)))
    )
    read_of = {digest: i for i, plan in enumerate(plans) for _, _, digest in plan[3]}
    needs = {
        digest: tuple(dict.fromkeys(read_of[link] for link in chain))
        for digest, chain in chains.items()
    }
    # Chunks whose chains read the same ranges, next to each other: a range is read once and
    # dropped after its last use, unless the window made it go earlier.
    order = sorted(chunks, key=needs.__getitem__)
    last_use = {read: position for position, digest in enumerate(order) for read in needs[digest]}
    cache = _Cache(storage, plans, missing)
    found: dict[str, str] = {}
    out = np.empty(max(recipe.size for recipe in chunks.values()), dtype=np.uint8)
    for position, digest in enumerate(order):
        need = needs[digest]
        cache.fetch(need, window)
        recipe = chunks[digest]
        try:
            decode_chunk(digest, chunks, cache.blobs, out[: recipe.size], where)
        except KeyError:
            found[digest] = f"chunk {digest}: its object {recipe.pack} is unreadable"
        except CorruptCheckpointError as exc:
            found[digest] = str(exc)
        report.chunks_checked += 1
        for read in need:
            if last_use[read] == position:
                cache.drop(read)
    report.errors.extend(found[digest] for digest in chunks if digest in found)


def _chain(digest: str, doc: Manifest) -> list[str]:
    """The links of ``digest``'s chain that are stored (a dangling base is the decoder's error
    to report)."""
    try:
        return closure(digest, doc.chunks)
    except KeyError:
        return [digest]


class _Cache:
    """Coalesced ranges of objects, read on demand, at most a window of bytes held (least
    recently used evicted first); ``blobs`` maps each held chunk to its bytes."""

    def __init__(self, storage: Storage, plans: list[Read], missing: set[str]) -> None:
        self.storage, self.plans, self.missing = storage, plans, missing
        self.held: OrderedDict[int, int] = OrderedDict()  # read -> bytes, oldest use first
        self.bytes = 0
        self.blobs: dict[str, memoryview] = {}

    def fetch(self, need: tuple[int, ...], window: int) -> None:
        fresh = [read for read in need if read not in self.held]
        incoming = sum(self.plans[read][2] - self.plans[read][1] for read in fresh)
        for read in list(self.held):
            if self.bytes + incoming <= window:
                break
            if read not in need:
                self.drop(read)
        for read in fresh:
            self._load(read)
        for read in need:
            self.held.move_to_end(read)

    def _load(self, read: int) -> None:
        path, start, end, members = self.plans[read]
        self.held[read] = 0
        if path in self.missing:
            return  # its chunks are reported unreadable
        try:
            data = self.storage.get_view(path, start, end)
        except FileNotFoundError:
            self.missing.add(path)
            return
        for offset, length, digest in members:  # short when the object is truncated
            self.blobs[digest] = data[offset - start : offset - start + length]
        self.held[read] = len(data)
        self.bytes += len(data)

    def drop(self, read: int) -> None:
        size = self.held.pop(read, None)
        if size is None:
            return
        self.bytes -= size
        for _, _, digest in self.plans[read][3]:
            self.blobs.pop(digest, None)


def verify_step(storage: Storage, history: History, step: int | None) -> VerifyReport:
    """Verify one committed checkpoint (default: the newest) with :func:`verify_manifest`; a
    damaged one is recorded in ``history`` (quarantine, fallback). A checkpoint the storage
    failed to read is not damaged: the report says it could not be read (``unreadable``).

    Raises:
        CheckpointNotFoundError: empty store or missing step.
    """
    step = history.resolve(step)
    report = VerifyReport(step=step)
    try:
        doc = history.read(step)
        report.lossy = doc.lossy_tensors
        verify_manifest(storage, doc, report, f"step {step} of {storage.url}")
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):  # the manifest is gone
            report.errors.append(str(exc))
        else:
            report.unreadable = str(exc)
            log.warning("verify could not read step %d of %s: %s", step, storage.url, exc)
    except CheckpointError as exc:
        report.errors.append(str(exc))
    if report.damaged:
        history.saw_damage(step)
    return report
