"""Reading and decoding one chunk: the objects it needs, read in coalesced ranges per pack, and
its chain — its standalone base, then each XOR delta in order — decoded (fused where it can be)
into flat memory. Every link of every chain is
checked against its XXH3-128 hash (a lossy codec's chunk: the hash of its decoded bytes): a
corrupt object is named, never returned. Every payload is decoded by its codec from the registry
(:mod:`~lightning_incremental.core.codecs`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.codecs.bytes import chunk_hasher
from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, closure
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.storage.linked import where_read

COALESCE_GAP = 1 << 20
MAX_READ = 4 << 20


Read = tuple[str, int, int, list[tuple[int, int, str]]]  # path, start, end, members


class ObjectReader:
    """Fetches the byte ranges of pack objects a set of chunks needs, coalescing reads."""

    def __init__(self, storage: Storage, manifest: Manifest, where: str) -> None:
        self.storage, self.manifest, self.where = storage, manifest, where
        self.blobs: dict[str, memoryview] = {}

    def plan(self, digests: set[str], max_read: int = MAX_READ) -> list[Read]:
        """Coalesced reads covering the encoded bytes of ``digests``, each at most
        ``max_read`` bytes long unless one chunk's bytes are longer."""
        chunks = self.manifest.chunks
        by_pack: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
        for digest in digests:
            recipe = chunks[digest]
            by_pack[recipe.pack].append((recipe.offset, recipe.length, digest))
        reads: list[Read] = []
        for path, ranges in sorted(by_pack.items()):
            ranges.sort()
            start, end, members = ranges[0][0], ranges[0][0] + ranges[0][1], [ranges[0]]
            for item in ranges[1:]:
                offset, length, _ = item
                if offset - end <= COALESCE_GAP and offset + length - start <= max_read:
                    end = max(end, offset + length)
                    members.append(item)
                else:
                    reads.append((path, start, end, members))
                    start, end, members = offset, offset + length, [item]
            reads.append((path, start, end, members))
        return reads

    def read(self, plan: Read) -> list[str]:
        """Perform one planned read; returns the digests it made available."""
        path, start, end, members = plan
        try:
            data = self.storage.get_view(path, start, end)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"checkpoint {self.where}: object {path} is missing from {where_read(self.storage)}"
            ) from exc
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"checkpoint {self.where}: object {path} is truncated (read {len(data)} of "
                f"{end - start} bytes at offset {start})"
            )
        for offset, length, digest in members:
            self.blobs[digest] = data[offset - start : offset - start + length]
        return [digest for _, _, digest in members]


Chunks = Mapping[str, ChunkRecipe]


class _Scratch(threading.local):
    """Buffers a worker thread reuses from chunk to chunk: fresh multi-megabyte buffers cost a
    page fault per 4 KiB on first touch, about a third of a chunk's decoding time. At most
    ``SLOTS`` buffers of the largest chunk this thread decoded (chunks past ``KEEP_MAX`` get
    buffers of their own, not kept), freed when the thread ends (the worker pool's threads end
    when idle)."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray | None] = [None] * SLOTS

    def get(self, slot: int, size: int) -> np.ndarray:
        if size > KEEP_MAX:
            return np.empty(size, dtype=np.uint8)
        buffer = self.buffers[slot]
        if buffer is None or buffer.size < size:
            buffer = self.buffers[slot] = np.empty(size, dtype=np.uint8)
        return buffer[:size]


SLOTS = 3  # a chain's accumulator or second buffer, and a staged chunk's decoded bytes
KEEP_MAX = 64 << 20  # larger scratch buffers are not kept between chunks
_ACC, _STAGED = 0, 2
_scratch = _Scratch()


def staging_buffer(size: int) -> np.ndarray:
    """This thread's scratch buffer for a decoded chunk on its way to a staged target (the
    chain's own buffers are the other slots)."""
    return _scratch.get(_STAGED, size)


# A fused chain holds every link's decoded planes until it is done: at most FUSE_MAX links and
# FUSE_BYTES of chunk bytes (links times chunk size) per thread; longer chains, or chains of
# larger chunks, are decoded link by link (two chunks' worth).
FUSE_MAX = 4
FUSE_BYTES = 32 << 20
FUSE_BLOCK = 1 << 19  # bytes of a chunk taken through a fused chain at a time (stays in cache)


def decode_chunk(
    digest: str, chunks: Chunks, blobs: Mapping[str, memoryview], out: np.ndarray, where: str
) -> None:
    """Decode chunk ``digest`` (its whole chain) into ``out`` and verify it.

    A chain is decoded the cheapest way its links allow:

    - *folded*: every link has a byte-grouped form in which links combine by XOR
      (``Codec.foldable``) and one grouping width: the chain is accumulated in that domain and
      ungrouped once; the final hash then proves every link right (when it does not match, the
      chain is decoded again by links, to name the bad one);
    - *fused*: every link decodes range by range (``Codec.blocks``; at most ``FUSE_MAX``
      links and ``FUSE_BYTES``): each range goes from the root through every link while it is
      in cache, every link's hash computed as it goes;
    - otherwise *link by link*.

    Every way checks every link's hash and names the first bad link. Intermediate results live
    in this thread's scratch buffers: nothing of the chunk's size is allocated.
    """
    chain = closure(digest, chunks)
    if len(chain) > 1:
        widths = {chunks[link].width for link in chain}
        if len(widths) == 1 and all(_foldable(link, chunks, blobs, where) for link in chain):
            try:
                if _decode_planes(chain, chunks, blobs, out, widths.pop(), where):
                    return
            except CorruptCheckpointError:
                pass  # diagnose below, link by link
        elif (
            len(chain) <= FUSE_MAX
            and len(chain) * out.size <= FUSE_BYTES
            and _decode_fused(chain, chunks, blobs, out, where)
        ):
            return
    _decode_links(chain, chunks, blobs, out, where)


def _foldable(link: str, chunks: Chunks, blobs: Mapping[str, memoryview], where: str) -> bool:
    recipe = chunks[link]
    try:
        return codecs.get(recipe.kind).foldable(blobs[link])
    except ValueError as exc:
        raise _undecodable(link, recipe, exc, where) from exc


def _decode_fused(
    chain: list[str],
    chunks: Chunks,
    blobs: Mapping[str, memoryview],
    out: np.ndarray,
    where: str,
) -> bool:
    """Decode ``chain`` into ``out`` range by range through all its links, checking each
    link's hash (streamed); False, with nothing written, when a link's codec cannot."""
    links = []
    for link in chain:
        recipe = chunks[link]
        try:
            blocks = codecs.get(recipe.kind).blocks(blobs[link], recipe.size)
        except ValueError as exc:
            raise _undecodable(link, recipe, exc, where) from exc
        if blocks is None:
            return False
        links.append((link, recipe, blocks, chunk_hasher()))
    for start in range(0, out.size, FUSE_BLOCK):
        stop = min(out.size, start + FUSE_BLOCK)
        for link, recipe, blocks, hasher in links:
            try:
                blocks.decode(out, start, stop)
            except ValueError as exc:
                raise _undecodable(link, recipe, exc, where) from exc
            hasher.update(out[start:stop].data)
    for link, recipe, _, hasher in links:
        if hasher.hexdigest() != recipe.expected(link):
            raise _checksum(link, recipe, where)
    return True


def _decode_planes(
    chain: list[str],
    chunks: Chunks,
    blobs: Mapping[str, memoryview],
    out: np.ndarray,
    width: int,
    where: str,
) -> bool:
    """The XOR-of-planes decoding of ``chain`` into ``out``; False when a link has no planes or
    the result fails the chunk's hash."""
    first: np.ndarray | None = None
    acc: np.ndarray | None = None
    for link in chain:
        planes = _call(codecs.get(chunks[link].kind).planes, link, chunks, blobs, where)
        if planes is None:
            return False
        if first is None:
            first = planes
        elif acc is None:  # XOR the first two links into scratch: no copy of the first
            acc = _scratch.get(_ACC, out.size)
            np.bitwise_xor(first, planes, out=acc)
        else:
            np.bitwise_xor(acc, planes, out=acc)
    assert acc is not None
    codecs.ungroup_bytes(acc, width, out)
    return chunk_hash(out) == chunks[chain[-1]].expected(chain[-1])


def _call(
    planes: Callable[[Any, int], np.ndarray | None],
    link: str,
    chunks: Chunks,
    blobs: Mapping[str, memoryview],
    where: str,
) -> np.ndarray | None:
    recipe = chunks[link]
    try:
        return planes(blobs[link], recipe.size)
    except ValueError as exc:
        raise _undecodable(link, recipe, exc, where) from exc


def _undecodable(link: str, recipe: ChunkRecipe, exc: Exception, where: str) -> Exception:
    return CorruptCheckpointError(
        f"checkpoint {where}: chunk {link} in {recipe.pack} cannot be decoded ({exc})"
    )


def _decode_links(
    chain: list[str],
    chunks: Chunks,
    blobs: Mapping[str, memoryview],
    out: np.ndarray,
    where: str,
) -> None:
    """Decode a chain link by link, checking each link's hash: names the first bad object.

    Each link decodes against the previous one's result into the other of two buffers (``out``
    and one scratch buffer), chosen so that the last link lands in ``out``: no copies."""
    other = _scratch.get(_ACC, out.size) if len(chain) > 1 else out
    base: np.ndarray | None = None
    for position, link in enumerate(chain):
        recipe = chunks[link]
        into = out if (len(chain) - 1 - position) % 2 == 0 else other
        try:
            codecs.decode(blobs[link], recipe.kind, recipe.width, recipe.size, base=base, out=into)
        except ValueError as exc:
            raise _undecodable(link, recipe, exc, where) from exc
        if chunk_hash(into) != recipe.expected(link):
            raise _checksum(link, recipe, where)
        base = into


def _checksum(link: str, recipe: ChunkRecipe, where: str) -> Exception:
    return CorruptCheckpointError(
        f"checkpoint {where}: chunk {link} in {recipe.pack} fails its checksum (corrupted object)"
    )


class BaseReader:
    """A parent checkpoint's chunks, decoded from storage on demand (as delta bases when the
    parent's bytes are not in memory; a lossy chunk as it decodes). A chunk that cannot be read
    or fails its hash is no base: the chunk it would have been the base of is stored standalone
    instead."""

    def __init__(
        self, storage: Storage, manifest: Manifest, chunks: Mapping[str, ChunkRecipe]
    ) -> None:
        self.storage, self.manifest, self.chunks = storage, manifest, chunks

    def read(self, digest: str) -> np.ndarray | None:
        recipe = self.chunks.get(digest)
        if recipe is None:
            return None
        reader = ObjectReader(self.storage, self.manifest, f"step {self.manifest.step}")
        out = np.empty(recipe.size, dtype=np.uint8)
        try:
            for plan in reader.plan(set(closure(digest, self.chunks))):
                reader.read(plan)
            decode_chunk(digest, self.chunks, reader.blobs, out, reader.where)
        except (CorruptCheckpointError, OSError):
            return None
        return out
