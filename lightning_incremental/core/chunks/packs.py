"""Packs: the objects chunks are stored in, named by the hash of their content. Writing them in the
background during a save, and checking stored ones (missing, truncated, or not matching their
name)."""

from __future__ import annotations

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


TAIL_PACK = 2 << 20  # the smallest pack written near the end of a save (see PackWriter.limit)


class PackWriter:
    """Appends encoded chunks to pack objects and writes full packs in the background.

    A pack is assembled, hashed (its name) and written on a writer thread, off the thread that
    schedules the encoding; its chunks join the tables when its write has completed."""

    def __init__(
        self,
        storage: Storage,
        pool: Executor,
        pack_size: int,
        out: Encoded,
        remaining: int,
    ) -> None:
        self.storage, self.pool, self.pack_size, self.out = (
            storage,
            pool,
            pack_size,
            out,
        )
        self.remaining = remaining  # raw bytes of the chunks not scheduled yet
        self.parts: list[bytes | memoryview] = []
        self.filled = 0
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.writes: deque[tuple[Future[tuple[str, int, float]], list[tuple[str, dict[str, Any]]]]]
        self.writes = deque()

    def add(self, digest: str, blob: bytes | memoryview, fields: dict[str, Any]) -> None:
        """Append ``blob``; its recipe (``fields`` of a ``ChunkRecipe``, and where it lies) joins
        the tables once its pack is written."""
        fields["offset"], fields["length"] = self.filled, len(blob)
        self.pending.append((digest, fields))
        self.parts.append(blob)
        self.filled += len(blob)
        if self.filled >= self.limit():
            self.flush()

    def limit(self) -> int:
        """The size at which the current pack is written: ``pack_size``, smaller near the end
        of the save (a quarter of the raw bytes not scheduled yet, at least ``TAIL_PACK``). The
        writes still running when the last chunk is encoded are what the save then waits for:
        with 16 MiB packs that was a quarter of a 100 MB save's time to durable."""
        return min(self.pack_size, max(TAIL_PACK, self.remaining // 4))

    def flush(self) -> None:
        if not self.parts:
            return
        self.writes.append((self.pool.submit(self._write, self.parts), self.pending))
        self.parts, self.filled, self.pending = [], 0, []
        while len(self.writes) > 2:
            self._collect()

    def _collect(self) -> None:
        future, pending = self.writes.popleft()
        path, size, seconds = future.result()
        for digest, fields in pending:
            # A chunk adopted meanwhile as another's delta base keeps its adopted recipe.
            if digest not in self.out.chunks:
                self.out.chunks[digest] = ChunkRecipe(pack=path, **fields)
        self.out.packs[path] = size
        self.out.written.add(path)
        self.out.bytes_written += size
        self.out.write_s += seconds

    def _write(self, parts: list[bytes | memoryview]) -> tuple[str, int, float]:
        start = time.perf_counter()
        hasher = chunk_hasher()  # the pack's name: the hash of its parts, in order, unjoined
        for part in parts:
            hasher.update(part)
        path = pack_path(hasher.hexdigest())
        if not self.storage.put_parts(path, parts):
            # Same content, same name: an earlier checkpoint's object, or one left behind by a
            # deleted checkpoint or a crashed save. It is written again all the same: it may
            # have rotted or been truncated, and an old object that no manifest names yet may
            # be collected by a concurrent gc at any moment — a fresh one is protected by its
            # grace period, like every other object this save writes.
            self.storage.put_parts(path, parts, overwrite=True)
        return path, sum(len(part) for part in parts), time.perf_counter() - start

    def finish(self) -> None:
        """Flush the last pack and wait until every pack is durable (re-raising write errors)."""
        self.flush()
        while self.writes:
            self._collect()

    def abandon(self) -> None:
        for fut, _ in self.writes:
            fut.cancel()
        for fut, _ in self.writes:
            if not fut.cancelled():
                fut.exception()  # wait; the first error is already being raised


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
