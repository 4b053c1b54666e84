"""Packs: the objects chunks are stored in, named by the hash of their content. Writing them in the
background during a save, and checking stored ones (missing, truncated, or not matching their
name)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.codecs.bytes import chunk_hasher
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.layout import pack_path
from lightning_incremental.core.format.records import ChunkRecipe
from lightning_incremental.core.storage import Storage

if TYPE_CHECKING:
    from lightning_incremental.core.chunks.encode import Encoded
    from lightning_incremental.core.chunks.pace import Pacer


TAIL_PACK = 2 << 20  # the smallest pack written near the end of a save (see PackWriter.limit)
# In a shared pool: chunks of tensors of at least this many bytes go to packs of their own kind,
# ended at a tensor's end once this full (see PackWriter), so that equal tensors make equal packs.
ALIGNED_FROM = 64 << 10
ALIGNED_MIN = TAIL_PACK


class _Open:
    """A pack being filled: its parts, their recipes' fields, and whether it holds a payload
    the encoder made."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.filled = 0
        self.owned = False

    def append(
        self, digest: str, blob: bytes | memoryview, fields: dict[str, Any], borrowed: bool
    ) -> None:
        fields["offset"], fields["length"] = self.filled, len(blob)
        self.pending.append((digest, fields))
        self.parts.append(blob)
        self.filled += len(blob)
        self.owned = self.owned or not borrowed


class PackWriter:
    """Appends encoded chunks to pack objects and writes full packs in the background.

    A pack is named (the hash of its parts) when it is full, on the thread that schedules the
    encoding, and its chunks join the tables then; it is written on a writer thread. The
    tables are thus complete once the last pack is handed to a writer, and the manifest can be
    prepared while the writes finish. The packs are written without waiting for each to be
    durable (``durable=False``: a local disk starts writing each back at once) and made
    durable together by :meth:`wait`, the writers syncing a share each, before the manifest
    that names them is written (see :mod:`~lightning_incremental.core.storage.local`).

    At most two packs of *owned* payloads (bytes the encoder made) are in flight: they are
    memory the save holds. Parts *borrowed* from the snapshot (a small tensor stored as it is,
    a view of its slab) cost nothing to hold, and their packs are not waited for before the
    next is assembled.

    **Aligned packs** (``aligned_from``, set for the members of a shared object pool): the
    chunks of tensors of at least ``aligned_from`` bytes go to a second stream of packs, ended
    at the end of a tensor once it holds :data:`ALIGNED_MIN` bytes (or mid-tensor at
    ``pack_size``), never by what else the save holds. Two runs that store the same tensors in
    the same order — a sweep's frozen base, each run with adapters of its own in between —
    then write byte-identical packs under one name, which the pool holds once; a run whose
    tensors differ somewhere falls back into step at the next pack boundary after the
    difference. The cost: more, smaller packs near the end of a save (no tail sizing), and a
    pack boundary at most every ``aligned_from`` bytes in the worst case.
    """

    def __init__(
        self,
        storage: Storage,
        pool: Executor,
        pack_size: int,
        out: Encoded,
        remaining: int,
        aligned_from: int | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.storage, self.pool, self.pack_size, self.out = (
            storage,
            pool,
            pack_size,
            out,
        )
        self.remaining = remaining  # raw bytes of the chunks not scheduled yet
        self.open = _Open()
        self.aligned_from = aligned_from
        self.aligned = _Open()
        self.writes: deque[tuple[Future[float], bool]] = deque()
        # A paced save (see .pace): the writers' measured rate, the bytes handed to them and
        # not written yet, the writes not ended; its first pack is handed over once it holds
        # TAIL_PACK (2 MiB: with the default 4 MiB chunks, its first chunk).
        self.pacer = pacer
        self.handed = False  # a pack of this save was handed to a writer
        self.unwritten = 0
        self._running: set[Future[float]] = set()
        self._lock = threading.Lock()
        # Packs written and not synced yet: (path, bytes, seconds its write took). Written
        # durable=False only to a storage that can sync them: a backend of its own whose
        # put_parts predates the argument keeps working, one that forwards it to another
        # without forwarding sync does not leave packs unsynced.
        self._unsynced: list[tuple[str, int, float]] = []
        self._deferred: dict[str, bool] = (
            {"durable": False} if type(storage).sync is not Storage.sync else {}
        )

    def waiting(self) -> bool:
        """Whether the writers are waiting for the encoder: a pack of this save was handed to
        them, and every one handed over is written."""
        return self.handed and self.unwritten == 0

    def writing(self) -> Future[float] | None:
        """A write handed over that has not ended, or None (O(1): asked for every chunk)."""
        with self._lock:
            return next(iter(self._running), None)

    def _ended(self, future: Future[float]) -> None:
        with self._lock:
            self._running.discard(future)

    def add(
        self,
        digest: str,
        blob: bytes | memoryview,
        fields: dict[str, Any],
        borrowed: bool = False,
        *,
        tensor_bytes: int = 0,
        last: bool = True,
    ) -> None:
        """Append ``blob``; its recipe (``fields`` of a ``ChunkRecipe``, and where it lies) joins
        the tables once its pack is full. ``borrowed``: ``blob`` is the snapshot's memory, not a
        payload made for the pack (see the class's documentation). ``tensor_bytes``: the size of
        the tensor the chunk belongs to; ``last``: it is that tensor's last chunk."""
        if self.aligned_from is not None and tensor_bytes >= self.aligned_from:
            aligned = self.aligned
            aligned.append(digest, blob, fields, borrowed)
            if aligned.filled >= self.pack_size or (last and aligned.filled >= ALIGNED_MIN):
                self.aligned = _Open()
                self._emit(aligned)
            return
        self.open.append(digest, blob, fields, borrowed)
        if self.open.filled >= self.limit():
            self.flush()

    def limit(self) -> int:
        """The size at which the current pack is written: ``pack_size``, smaller near the end
        of the save (a quarter of the raw bytes not scheduled yet, at least ``TAIL_PACK``). The
        writes still running when the last chunk is encoded are what the save then waits for:
        with 16 MiB packs that was a quarter of a 100 MB save's time to durable."""
        if self.pacer is not None and not self.handed:
            return min(self.pack_size, TAIL_PACK)  # paced: the writers start sooner
        return min(self.pack_size, max(TAIL_PACK, self.remaining // 4))

    def flush(self) -> None:
        """Hand the pack being filled to a writer (the aligned one too: at the end of a save)."""
        current, self.open = self.open, _Open()
        self._emit(current)

    def _emit(self, pack: _Open) -> None:
        if not pack.parts:
            return
        parts = pack.parts
        hasher = chunk_hasher()  # the pack's name: the hash of its parts, in order, unjoined
        for part in parts:
            hasher.update(part)
        path = pack_path(hasher.hexdigest())
        size = sum(len(part) for part in parts)
        out = self.out
        for digest, fields in pack.pending:
            # A chunk adopted meanwhile as another's delta base keeps its adopted recipe.
            if digest not in out.chunks:
                out.chunks[digest] = ChunkRecipe(pack=path, **fields)
        if path not in out.written:  # the same content twice in one save: written once
            out.packs[path] = size
            out.written.add(path)
            out.bytes_written += size
            with self._lock:
                self.unwritten += size
            self.handed = True
            future = self.pool.submit(self._write, path, parts, size)
            with self._lock:
                self._running.add(future)
            future.add_done_callback(self._ended)  # at once if it has ended already
            self.writes.append((future, pack.owned))
        while sum(owned for _, owned in self.writes) > 2:
            self._collect()

    def _collect(self) -> None:
        future, _ = self.writes.popleft()
        self.out.write_s += future.result()

    def _write(self, path: str, parts: list[bytes | memoryview], size: int) -> float:
        start = time.perf_counter()
        try:
            if not self.storage.put_parts(path, parts, **self._deferred):
                # Same content, same name: an earlier checkpoint's object, or one left behind by
                # a deleted checkpoint or a crashed save. It is written again all the same: it
                # may have rotted or been truncated, and an old object that no manifest names yet
                # may be collected by a concurrent gc at any moment — a fresh one is protected by
                # its grace period, like every other object this save writes.
                self.storage.put_parts(path, parts, overwrite=True, **self._deferred)
        finally:
            with self._lock:
                self.unwritten -= size
        seconds = time.perf_counter() - start
        with self._lock:
            self._unsynced.append((path, size, seconds))
        if self.pacer is not None:
            self.pacer.wrote_unsynced(size, seconds)
        return seconds

    def _sync(self) -> None:
        """Make every pack written so far durable: the writers sync a share each (the files'
        data is mostly on the disk by now). Each pack's write and its share of the sync are
        then what the pacer learns of the writers' rate."""
        with self._lock:
            written, self._unsynced = self._unsynced, []
        if not written:
            return
        shares = max(1, min(len(written), getattr(self.pool, "max_workers", 1)))
        # The first share on this thread (the writers may be this thread's own pool of one).
        others = [self.pool.submit(self._sync_share, written[i::shares]) for i in range(1, shares)]
        try:
            self.out.write_s += self._sync_share(written[::shares])
        finally:
            errors = [fut.exception() for fut in others]  # every sync ends before one is raised
        for error in errors:
            if error is not None:
                raise error
        self.out.write_s += sum(fut.result() for fut in others)

    def _sync_share(self, written: list[tuple[str, int, float]]) -> float:
        start = time.perf_counter()
        self.storage.sync([path for path, _, _ in written])
        seconds = time.perf_counter() - start
        if self.pacer is not None:
            total = sum(size for _, size, _ in written) or 1
            for _, size, wrote_s in written:
                self.pacer.wrote(size, wrote_s + seconds * size / total)
        return seconds

    def finish(self, *, wait: bool = True) -> None:
        """Flush the last packs; with ``wait``, wait until every pack is durable (re-raising
        write errors), else leave that to :meth:`wait`."""
        self.flush()
        aligned, self.aligned = self.aligned, _Open()
        self._emit(aligned)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Wait until every pack handed to a writer is durable (re-raising the first write or
        sync error, once every write has ended)."""
        try:
            while self.writes:
                self._collect()
            self._sync()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        for fut, _ in self.writes:
            fut.cancel()
        for fut, _ in self.writes:
            if not fut.cancelled():
                fut.exception()  # wait; the first error is already being raised
        self.writes.clear()
        with self._lock:
            self._unsynced.clear()  # named by no manifest: left to gc


def aligned_from(storage: Storage) -> int | None:
    """:data:`ALIGNED_FROM` for a member of a shared object pool (its data objects live in the
    pool, shared with other stores), else None (see :class:`PackWriter`)."""
    objects = getattr(storage, "objects", None)
    own = getattr(storage, "own", None)
    return ALIGNED_FROM if objects is not None and objects is not own else None


def damaged_objects(storage: Storage, packs: Mapping[str, int]) -> set[str]:
    """Of ``packs`` (path -> size), those missing, of the wrong size, or whose content
    hash does not match their name: each is read whole."""
    bad = set()
    for path, size in packs.items():
        try:
            data = storage.get(path)
        except FileNotFoundError:
            bad.add(path)
            continue
        if len(data) != size or mf.pack_path(chunk_hash(data)) != path:
            bad.add(path)
    return bad
