"""The restore pipeline: read the objects a manifest names, decode chains, verify every chunk.

Reads are grouped per pack and coalesced (few large reads instead of one per chunk, which is
what object stores need), issued in the order the tensors need them within a memory window, and
each chunk's chain — its standalone base, then each XOR delta in order — is decoded into the
destination on the worker pool as soon as the chain is in; what no pending chunk needs is
released at once. Every link of every chain is
checked against its XXH3-128 hash (a lossy codec's chunk: the hash of its decoded bytes): a
corrupt object is named, never returned. Every payload is decoded by its codec from the registry
(:mod:`~lightning_incremental.core.codecs`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.codecs.bytes import chunk_hasher
from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.format import ChunkRecipe, Manifest, closure
from lightning_incremental.core.pieces import Box, whole
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.tree import torch_dtype

COALESCE_GAP = 1 << 20
MAX_READ = 4 << 20
READ_AHEAD = 32 << 20  # bytes of objects a restore holds at a time (see restore_arrays)


Read = tuple[str, int, int, list[tuple[int, int, str]]]  # path, start, end, members


class ObjectReader:
    """Fetches the byte ranges of pack objects a set of chunks needs, coalescing reads."""

    def __init__(self, storage: Storage, manifest: Manifest, where: str) -> None:
        self.storage, self.manifest, self.where = storage, manifest, where
        self.blobs: dict[str, memoryview] = {}

    def plan(self, digests: set[str]) -> list[Read]:
        """Coalesced reads covering the encoded bytes of ``digests``."""
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


@dataclass(frozen=True)
class Regions:
    """Destinations of a tensor that hold boxes of its global index space: each ``(view, box)``
    is a tensor of ``box.sizes`` (any device, any strides) to fill with that box of the stored
    tensor. A sharded tensor's local pieces, or one whole tensor when the checkpoint stored it
    as pieces. Only the stored pieces that overlap a box are read, and of those only the chunks
    holding overlapping elements; each chunk is decoded into scratch memory and its overlapping
    part copied into place (:func:`~lightning_incremental.core.scatter.piece_targets`)."""

    parts: tuple[tuple[torch.Tensor, Box], ...]


@dataclass(frozen=True)
class Staged:
    """A destination that is not one flat piece of host memory (a GPU tensor, a non-contiguous
    view): each chunk is decoded into scratch host memory and handed to ``put(offset, data)``
    (``offset``: the chunk's byte offset in the tensor)."""

    nbytes: int
    put: Callable[[int, np.ndarray], None]


Target = Union[np.ndarray, Staged, Regions, None]


@dataclass(frozen=True)
class ChunkTarget:
    """The chunks of one stored array and where they go; ``wanted``: the indices of the chunks
    to hand to ``target`` (None: all); ``direct``: chunks (also) decoded straight into the
    given bytes (a chunk that lands whole in one contiguous run of a destination)."""

    chunks: tuple[str, ...]
    target: np.ndarray | Staged
    wanted: frozenset[int] | None = None
    direct: Mapping[int, np.ndarray] | None = None


def restore_arrays(
    storage: Storage,
    manifest: Manifest,
    pool: Executor,
    where: str,
    targets: list[Target],
    *,
    read_ahead: int = READ_AHEAD,
) -> list[Target]:
    """Decode every tensor of ``manifest`` into its target (``targets[i]`` for tensor ``i``): a
    flat uint8 array of ``nbytes`` (decoded into directly), a :class:`Staged` destination, or
    None (not restored: a partial load reads none of its objects).

    Memory stays bounded whatever the checkpoint's size: objects are read in the order the
    tensors need them, at most ``read_ahead`` bytes of them held at a time (more only while
    nothing else can progress), each released once every chunk that needs it is decoded. Reads
    and decoding overlap on ``pool``: a chunk is decoded as soon as its whole chain is in.

    Raises:
        CorruptCheckpointError: naming the first bad object.
    """
    from lightning_incremental.core.scatter import piece_targets  # it builds on this module

    items: list[ChunkTarget] = []
    for tensor, target in zip(manifest.tensors, targets):
        if target is None:
            continue
        if isinstance(target, np.ndarray) and tensor.pieces is not None:
            view = torch.from_numpy(target).view(torch_dtype(tensor.dtype)).reshape(tensor.shape)
            target = Regions(((view, whole(tensor.shape)),))
        if isinstance(target, Regions):
            items += piece_targets(tensor, target, manifest.chunks)
        else:
            items.append(ChunkTarget(tensor.chunks, target))
    restore_chunks(storage, manifest, pool, where, items, read_ahead=read_ahead)
    return targets


def restore_chunks(
    storage: Storage,
    manifest: Manifest,
    pool: Executor,
    where: str,
    items: list[ChunkTarget],
    *,
    read_ahead: int = READ_AHEAD,
) -> None:
    """Decode the chunks of ``items`` into their targets, within the memory window of
    :func:`restore_arrays`. A chunk that several destinations want (the same bytes in two
    tensors, or in two places of one) is read and decoded once, then copied.

    Raises:
        CorruptCheckpointError: naming the first bad object.
    """
    chunks = manifest.chunks
    jobs: dict[str, _Job] = {}
    for item in items:
        target, offset = item.target, 0
        direct = item.direct or {}
        for index, digest in enumerate(item.chunks):
            size = chunks[digest].size
            dests: list[_Dest] = [(direct[index], None, 0)] if index in direct else []
            if item.wanted is None or index in item.wanted:
                if isinstance(target, np.ndarray):
                    dests.append((target[offset : offset + size], None, 0))
                else:
                    dests.append((None, target, offset))
            offset += size
            if not dests:
                continue
            job = jobs.get(digest)
            if job is None:
                links = tuple(dict.fromkeys(closure(digest, chunks)))
                job = jobs[digest] = _Job(digest, links, size, [])
            job.dests += dests
    if jobs:
        reader = ObjectReader(storage, manifest, where)
        _Schedule(reader, pool, list(jobs.values()), read_ahead, chunks, where).run()


_Dest = tuple[Union[np.ndarray, None], Union[Staged, None], int]  # flat bytes, or staged at offset


@dataclass
class _Job:
    """One chunk to decode, and every destination that wants its bytes."""

    digest: str
    links: tuple[str, ...]
    size: int
    dests: list[_Dest]

    def run(self, blobs: Mapping[str, memoryview], chunks: Chunks, where: str) -> None:
        first = self.dests[0][0]
        out = first if first is not None else _scratch.get(_STAGED, self.size)
        decode_chunk(self.digest, chunks, blobs, out, where)
        for flat, staged, offset in self.dests:
            if flat is not None:
                if flat is not out:
                    np.copyto(flat, out)
            else:
                assert staged is not None
                staged.put(offset, out)


class _Schedule:
    """Runs the reads and decodes of one restore within a memory window (see restore_arrays)."""

    def __init__(
        self,
        reader: ObjectReader,
        pool: Executor,
        jobs: list[_Job],
        read_ahead: int,
        chunks: Chunks,
        where: str,
    ) -> None:
        self.reader, self.pool, self.jobs = reader, pool, jobs
        self.read_ahead, self.chunks, self.where = read_ahead, chunks, where
        self.users: dict[str, int] = defaultdict(int)  # link -> jobs not yet decoded needing it
        for job in jobs:
            for link in job.links:
                self.users[link] += 1
        plans = reader.plan(set(self.users))
        read_of = {digest: i for i, plan in enumerate(plans) for _, _, digest in plan[3]}
        order: list[int] = []  # reads in the order the jobs first need them
        seen: set[int] = set()
        for job in jobs:
            for link in job.links:
                i = read_of[link]
                if i not in seen:
                    seen.add(i)
                    order.append(i)
        self.plans, self.order, self.read_of = plans, order, read_of
        self.members_left = [len(plan[3]) for plan in plans]  # blobs of a read still held
        self.waiting: dict[str, list[int]] = defaultdict(list)  # link -> jobs waiting for it
        for index, job in enumerate(jobs):
            for link in job.links:
                self.waiting[link].append(index)
        self.held = 0  # bytes of reads issued and not yet released

    def run(self) -> None:
        running: dict[Future[Any], tuple[str, int]] = {}
        next_read = 0
        started: set[int] = set()
        decoded = 0
        try:
            while decoded < len(self.jobs):
                decoding = sum(1 for kind, _ in running.values() if kind == "decode")
                while next_read < len(self.order) and (
                    self.held < self.read_ahead or (not decoding and not running)
                ):
                    i = self.order[next_read]
                    next_read += 1
                    _, start, end, _ = self.plans[i]
                    self.held += end - start
                    running[self.pool.submit(self.reader.read, self.plans[i])] = ("read", i)
                if not running:
                    raise AssertionError("restore stalled: no read or decode can run")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, index = running.pop(fut)
                    fut.result()  # re-raises the read's or decode's error
                    if kind == "read":
                        for link in [d for _, _, d in self.plans[index][3]]:
                            if not self.users.get(link):
                                self._release(link)  # an unused member of a coalesced read
                                continue
                            for j in self.waiting.pop(link, []):
                                job = self.jobs[j]
                                if j not in started and all(
                                    x in self.reader.blobs for x in job.links
                                ):
                                    started.add(j)
                                    running[self.pool.submit(self._decode, job)] = ("decode", j)
                    else:
                        decoded += 1
                        for link in self.jobs[index].links:
                            self.users[link] -= 1
                            if not self.users[link]:
                                self._release(link)
        except BaseException:
            for fut in running:
                fut.cancel()
            for fut in running:
                if not fut.cancelled():
                    fut.exception()  # wait: no worker may still write into the targets
            raise

    def _decode(self, job: _Job) -> None:
        job.run(self.reader.blobs, self.chunks, self.where)

    def _release(self, link: str) -> None:
        if self.reader.blobs.pop(link, None) is None:
            return
        i = self.read_of[link]
        self.members_left[i] -= 1
        if not self.members_left[i]:
            _, start, end, _ = self.plans[i]
            self.held -= end - start
