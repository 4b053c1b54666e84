"""The restore pipeline: read the objects a manifest names, decode chains, verify every chunk.

Reads are grouped per pack and coalesced (few large reads instead of one per chunk, which is
what object stores need), then each chunk's chain — its standalone base, then each XOR delta in
order — is decoded into the destination buffer on the worker pool. Every link of every chain is
checked against its XXH3-128 hash: a corrupt object is named, never returned.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Executor, Future, as_completed
from typing import Any

import numpy as np

from lightning_incremental.core import codec
from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.manifest import closure
from lightning_incremental.core.storage import Storage

COALESCE_GAP = 1 << 20
MAX_READ = 64 << 20


Read = tuple[str, int, int, list[tuple[int, int, str]]]  # path, start, end, members


class ObjectReader:
    """Fetches the byte ranges of pack objects a set of chunks needs, coalescing reads."""

    def __init__(self, storage: Storage, manifest: dict[str, Any], where: str) -> None:
        self.storage, self.manifest, self.where = storage, manifest, where
        self.blobs: dict[str, memoryview] = {}

    def plan(self, digests: set[str]) -> list[Read]:
        """Coalesced reads covering the encoded bytes of ``digests``."""
        chunks = self.manifest["chunks"]
        by_pack: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
        for digest in digests:
            recipe = chunks[digest]
            by_pack[recipe["pack"]].append((recipe["offset"], recipe["length"], digest))
        reads: list[Read] = []
        for path, ranges in sorted(by_pack.items()):
            ranges.sort()
            start, end, members = ranges[0][0], ranges[0][0] + ranges[0][1], [ranges[0]]
            for item in ranges[1:]:
                offset, length, _ = item
                if offset - end <= COALESCE_GAP and offset + length - start <= MAX_READ:
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
                f"checkpoint {self.where}: object {path} is missing from the store"
            ) from exc
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"checkpoint {self.where}: object {path} is truncated (read {len(data)} of "
                f"{end - start} bytes at offset {start})"
            )
        for offset, length, digest in members:
            self.blobs[digest] = data[offset - start : offset - start + length]
        return [digest for _, _, digest in members]


def decode_chunk(
    digest: str, chunks: dict[str, Any], blobs: dict[str, memoryview], out: np.ndarray, where: str
) -> None:
    """Decode chunk ``digest`` (its whole chain) into ``out`` and verify it.

    XOR commutes with byte grouping, so a chain whose links share one grouping width is
    accumulated in the grouped domain and ungrouped once; the final hash then proves every link
    right. Only when it does not match is the chain re-decoded link by link to name the bad one.
    """
    chain = closure(digest, chunks)
    widths = {chunks[link]["width"] for link in chain}
    if len(chain) > 1 and len(widths) == 1:
        try:
            acc: np.ndarray | None = None
            for link in chain:
                planes = np.frombuffer(_decompress(link, chunks, blobs, where), dtype=np.uint8)
                if acc is None:
                    acc = planes.copy()
                else:
                    np.bitwise_xor(acc, planes, out=acc)
            assert acc is not None
            codec.ungroup_bytes(acc, widths.pop(), out)
            if codec.chunk_hash(out) == digest:
                return
        except CorruptCheckpointError:
            pass  # diagnose below, link by link
    _decode_links(chain, chunks, blobs, out, where)


def _decompress(
    link: str, chunks: dict[str, Any], blobs: dict[str, memoryview], where: str
) -> bytes:
    recipe = chunks[link]
    try:
        return codec.decompress(blobs[link], recipe["size"])
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"checkpoint {where}: chunk {link} in {recipe['pack']} cannot be decoded ({exc})"
        ) from exc


def _decode_links(
    chain: list[str],
    chunks: dict[str, Any],
    blobs: dict[str, memoryview],
    out: np.ndarray,
    where: str,
) -> None:
    """Decode a chain link by link, checking each link's hash: names the first bad object."""
    scratch: np.ndarray | None = None
    for position, link in enumerate(chain):
        recipe = chunks[link]
        planes = np.frombuffer(_decompress(link, chunks, blobs, where), dtype=np.uint8)
        if position == 0:
            codec.ungroup_bytes(planes, recipe["width"], out)
        else:
            if scratch is None:
                scratch = np.empty(recipe["size"], dtype=np.uint8)
            codec.ungroup_bytes(planes, recipe["width"], scratch)
            np.bitwise_xor(out, scratch, out=out)
        if codec.chunk_hash(out) != link:
            raise CorruptCheckpointError(
                f"checkpoint {where}: chunk {link} in {recipe['pack']} fails its checksum "
                "(corrupted object)"
            )


def restore_arrays(
    storage: Storage,
    manifest: dict[str, Any],
    pool: Executor,
    where: str,
    alloc: Callable[[dict[str, Any]], np.ndarray],
    mirrors: list[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Decode every tensor of ``manifest`` into buffers from ``alloc(tensor_entry)`` (flat
    uint8 of ``nbytes``), and into ``mirrors[i]`` too for the first ``len(mirrors)`` tensors (a
    second copy, made chunk by chunk on the workers while the chunk is hot in cache). Reads and
    decoding overlap: a chunk is decoded as soon as every link of its chain has been read.

    Raises:
        CorruptCheckpointError: naming the first bad object.
    """
    chunks = manifest["chunks"]
    reader = ObjectReader(storage, manifest, where)
    buffers = [alloc(t) for t in manifest["tensors"]]
    mirrors = mirrors or []
    waiting: dict[str, list[int]] = defaultdict(list)  # link -> jobs that need it
    jobs: list[tuple[str, np.ndarray, np.ndarray | None, set[str]]] = []
    needed: set[str] = set()
    for index, (tensor, buf) in enumerate(zip(manifest["tensors"], buffers)):
        mirror = mirrors[index] if index < len(mirrors) else None
        offset = 0
        for digest in tensor["chunks"]:
            size = chunks[digest]["size"]
            links = set(closure(digest, chunks))
            for link in links:
                waiting[link].append(len(jobs))
            copy = mirror[offset : offset + size] if mirror is not None else None
            jobs.append((digest, buf[offset : offset + size], copy, links))
            needed |= links
            offset += size

    def decode(index: int) -> None:
        digest, out, copy, _ = jobs[index]
        decode_chunk(digest, chunks, reader.blobs, out, where)
        if copy is not None:
            copy[:] = out

    reads = [pool.submit(reader.read, plan) for plan in reader.plan(needed)]
    decodes: list[Future[None]] = []
    try:
        started: set[int] = set()
        for done in as_completed(reads):
            for link in done.result():
                for index in waiting.pop(link, []):
                    if index not in started and jobs[index][3].issubset(reader.blobs):
                        started.add(index)
                        decodes.append(pool.submit(decode, index))
        for fut in decodes:
            fut.result()
    except BaseException:
        pending: list[Future[Any]] = [*reads, *decodes]
        for fut in pending:
            fut.cancel()
        raise
    return buffers
