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

from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import chunk_hash
from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.format import ChunkRecipe, Manifest, closure
from lightning_incremental.core.storage import Storage

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


def decode_chunk(
    digest: str, chunks: Chunks, blobs: Mapping[str, memoryview], out: np.ndarray, where: str
) -> None:
    """Decode chunk ``digest`` (its whole chain) into ``out`` and verify it.

    When every link has a byte-grouped form in which links combine by XOR (``Codec.planes``)
    and one grouping width, the chain is accumulated in that domain and ungrouped once; the
    final hash then proves every link right. Otherwise, or when it does not match, the chain is
    decoded link by link (naming the bad one).
    """
    chain = closure(digest, chunks)
    widths = {chunks[link].width for link in chain}
    if len(chain) > 1 and len(widths) == 1:
        try:
            acc: np.ndarray | None = None
            for link in chain:
                planes = _call(codecs.get(chunks[link].kind).planes, link, chunks, blobs, where)
                if planes is None:
                    break
                if acc is None:
                    acc = planes.copy()
                else:
                    np.bitwise_xor(acc, planes, out=acc)
            else:
                assert acc is not None
                codecs.ungroup_bytes(acc, widths.pop(), out)
                if chunk_hash(out) == chunks[digest].expected(digest):
                    return
        except CorruptCheckpointError:
            pass  # diagnose below, link by link
    _decode_links(chain, chunks, blobs, out, where)


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
    """Decode a chain link by link, checking each link's hash: names the first bad object."""
    scratch: np.ndarray | None = None
    for position, link in enumerate(chain):
        recipe = chunks[link]
        base = None
        if position:  # the chain so far is this link's base
            if scratch is None:
                scratch = np.empty_like(out)
            np.copyto(scratch, out)
            base = scratch
        try:
            codecs.decode(blobs[link], recipe.kind, recipe.width, recipe.size, base=base, out=out)
        except ValueError as exc:
            raise _undecodable(link, recipe, exc, where) from exc
        if chunk_hash(out) != recipe.expected(link):
            raise CorruptCheckpointError(
                f"checkpoint {where}: chunk {link} in {recipe.pack} fails its checksum "
                "(corrupted object)"
            )


@dataclass(frozen=True)
class Staged:
    """A destination that is not one flat piece of host memory (a GPU tensor, a non-contiguous
    view): each chunk is decoded into scratch host memory and handed to ``put(offset, data)``
    (``offset``: the chunk's byte offset in the tensor)."""

    nbytes: int
    put: Callable[[int, np.ndarray], None]


Target = Union[np.ndarray, Staged, None]


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
    chunks = manifest.chunks
    reader = ObjectReader(storage, manifest, where)
    jobs: list[_Job] = []
    users: dict[str, int] = defaultdict(int)  # link -> jobs not yet decoded that need it
    for tensor, target in zip(manifest.tensors, targets):
        if target is None:
            continue
        offset = 0
        for digest in tensor.chunks:
            size = chunks[digest].size
            links = tuple(dict.fromkeys(closure(digest, chunks)))
            for link in links:
                users[link] += 1
            out = target[offset : offset + size] if isinstance(target, np.ndarray) else None
            jobs.append(_Job(digest, links, out, target, offset, size))
            offset += size
    _Schedule(reader, pool, jobs, users, read_ahead, chunks, where).run()
    return targets


@dataclass
class _Job:
    digest: str
    links: tuple[str, ...]
    out: np.ndarray | None  # decode straight into this, or ...
    target: Target  # ... into scratch handed to a Staged target
    offset: int
    size: int


class _Schedule:
    """Runs the reads and decodes of one restore within a memory window (see restore_arrays)."""

    def __init__(
        self,
        reader: ObjectReader,
        pool: Executor,
        jobs: list[_Job],
        users: dict[str, int],
        read_ahead: int,
        chunks: Chunks,
        where: str,
    ) -> None:
        self.reader, self.pool, self.jobs, self.users = reader, pool, jobs, users
        self.read_ahead, self.chunks, self.where = read_ahead, chunks, where
        plans = reader.plan(set(users))
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
        out = job.out if job.out is not None else np.empty(job.size, dtype=np.uint8)
        decode_chunk(job.digest, self.chunks, self.reader.blobs, out, self.where)
        if isinstance(job.target, Staged):
            job.target.put(job.offset, out)

    def _release(self, link: str) -> None:
        if self.reader.blobs.pop(link, None) is None:
            return
        i = self.read_of[link]
        self.members_left[i] -= 1
        if not self.members_left[i]:
            _, start, end, _ = self.plans[i]
            self.held -= end - start
