"""The restore pipeline: read the objects a manifest names, decode chains, put every chunk in
its target.

Reads are grouped per pack and coalesced (few large reads instead of one per chunk, which is
what object stores need; :class:`~lightning_incremental.core.chunks.decode.ObjectReader`),
issued in the order the tensors need them within a memory window (``read_ahead``), and each
chunk's chain — its standalone base, then each XOR delta in order — is decoded into its target
on the worker pool as soon as the chain is in; what no pending chunk needs is released at once.
Every link is verified on the way (:func:`~lightning_incremental.core.chunks.decode.decode_chunk`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, Union

import numpy as np
import torch

from lightning_incremental.core.buffers import collection_paused
from lightning_incremental.core.chunks.decode import (
    Chunks,
    ObjectReader,
    decode_chunk,
    staging_buffer,
)
from lightning_incremental.core.format.pieces import whole
from lightning_incremental.core.format.records import Manifest, closure
from lightning_incremental.core.format.tree import torch_dtype
from lightning_incremental.core.load.scatter import piece_targets
from lightning_incremental.core.load.targets import ChunkTarget, Regions, Staged, Target
from lightning_incremental.core.storage import Storage

_Dest = tuple[Union[np.ndarray, None], Union[Staged, None], int]  # flat bytes, or staged at offset
READ_AHEAD = 32 << 20  # bytes of objects a restore holds at a time (see restore_arrays)
# A pool task decodes chunks ready together up to this many bytes or chunks: one task per
# small chunk would cost more in the pool's hand-offs than the decode (4 KiB tensors by the
# ten thousand), while a batch this size still spreads a large read over every worker.
BATCH_BYTES = 4 << 20
BATCH_JOBS = 256


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
    with collection_paused():  # objects per chunk, all live (see scatter.piece_targets)
        jobs = _jobs(items, chunks)
    if jobs:
        reader = ObjectReader(storage, manifest, where)
        _Schedule(reader, pool, list(jobs.values()), read_ahead, chunks, where).run()


def _jobs(items: list[ChunkTarget], chunks: Chunks) -> dict[str, _Job]:
    """One job per chunk to decode, with every destination that wants it."""
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
    return jobs


@dataclass
class _Job:
    """One chunk to decode, and every destination that wants its bytes."""

    digest: str
    links: tuple[str, ...]
    size: int
    dests: list[_Dest]

    def run(self, blobs: Mapping[str, memoryview], chunks: Chunks, where: str) -> None:
        first = self.dests[0][0]
        out = first if first is not None else staging_buffer(self.size)
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
        self.workers = getattr(pool, "max_workers", 1)

    def run(self) -> None:
        # Completions come through a queue (each future's done-callback puts it there), and
        # small decodes go to the pool in batches: both keep the loop linear in the chunks — a
        # ``wait(FIRST_COMPLETED)`` over every running future costs their number per call.
        finished: SimpleQueue[Future[Any]] = SimpleQueue()
        running: dict[Future[Any], tuple[str, Any]] = {}
        next_read = 0
        started: set[int] = set()
        decoded = 0

        def submit(kind: str, what: Any) -> None:
            if kind == "read":
                future = self.pool.submit(self.reader.read, self.plans[what])
            else:
                future = self.pool.submit(self._decode_all, what)
            running[future] = (kind, what)
            future.add_done_callback(finished.put)

        try:
            while decoded < len(self.jobs):
                while next_read < len(self.order) and (self.held < self.read_ahead or not running):
                    i = self.order[next_read]
                    next_read += 1
                    _, start, end, _ = self.plans[i]
                    self.held += end - start
                    submit("read", i)
                if not running:
                    raise AssertionError("restore stalled: no read or decode can run")
                future = finished.get()
                kind, what = running.pop(future)
                future.result()  # re-raises the read's or decode's error
                if kind == "read":
                    ready: list[int] = []
                    for link in [d for _, _, d in self.plans[what][3]]:
                        if not self.users.get(link):
                            self._release(link)  # an unused member of a coalesced read
                            continue
                        for j in self.waiting.pop(link, []):
                            job = self.jobs[j]
                            if j not in started and all(x in self.reader.blobs for x in job.links):
                                started.add(j)
                                ready.append(j)
                    for batch in _batches(ready, self.jobs, self.workers):
                        submit("decode", batch)
                else:
                    decoded += len(what)
                    for index in what:
                        for link in self.jobs[index].links:
                            self.users[link] -= 1
                            if not self.users[link]:
                                self._release(link)
        except BaseException:
            for future in running:
                future.cancel()
            for future in running:
                if not future.cancelled():
                    future.exception()  # wait: no worker may still write into the targets
            raise

    def _decode_all(self, batch: list[int]) -> None:
        for index in batch:
            self.jobs[index].run(self.reader.blobs, self.chunks, self.where)

    def _release(self, link: str) -> None:
        if self.reader.blobs.pop(link, None) is None:
            return
        i = self.read_of[link]
        self.members_left[i] -= 1
        if not self.members_left[i]:
            _, start, end, _ = self.plans[i]
            self.held -= end - start


def _batches(ready: list[int], jobs: list[_Job], workers: int = 1) -> list[list[int]]:
    """Split the jobs ready together into pool tasks of at most :data:`BATCH_BYTES` decoded
    (or :data:`BATCH_JOBS` jobs), and at most a ``workers``-th of them each, so that every
    worker gets a share of what one read made ready; a larger job is a task alone."""
    batches: list[list[int]] = []
    batch: list[int] = []
    size = 0
    total = sum(jobs[index].size for index in ready)
    limit = min(BATCH_BYTES, -(-total // max(1, workers)))
    count = min(BATCH_JOBS, -(-len(ready) // max(1, workers)))
    for index in ready:
        job_size = jobs[index].size
        if batch and (size + job_size > limit or len(batch) >= count):
            batches.append(batch)
            batch, size = [], 0
        batch.append(index)
        size += job_size
    if batch:
        batches.append(batch)
    return batches
