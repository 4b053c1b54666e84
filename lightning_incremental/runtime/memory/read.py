"""Reading a memory part back into tensors: every tensor allocated fresh, the part's data read
(from its file) or copied (from a received buffer) into them in chunks on several threads,
and hashed in order on the way (:func:`fill_hashed`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch

from lightning_incremental.core.buffers import collection_paused
from lightning_incremental.core.codecs.bytes import chunk_hasher
from lightning_incremental.core.format.tree import torch_dtype, unflatten
from lightning_incremental.core.format.validation import element_count
from lightning_incremental.core.workers import usable_cores


class MemoryPartError(RuntimeError):
    """A memory part that cannot be used: missing, torn, of another job, or its bytes do not
    match their hash."""


READ_CHUNK = 8 << 20
_IOV_MAX = 1024  # views a preadv call takes (Linux's IOV_MAX)
_SHARED_PIECES = 16  # a job of more pieces than this runs on the calling thread
_SMALL_BYTES = 1 << 20

Job = list[tuple[memoryview, int]]  # pieces of buffers, each with its offset, in order


def read_hashed(fd: int, buffers: Sequence[memoryview], workers: int = 0) -> str:
    """Fill ``buffers`` (writable, in the file's order, together its bytes from offset 0) from
    the file ``fd`` and return the hash of those bytes (:func:`chunk_hasher`); see
    :func:`fill_hashed`. A job's pieces are one ``preadv`` (no shared file position, the GIL
    released).

    Raises:
        EOFError: the file ends before the buffers are filled.
        OSError: a read failed.
    """
    return fill_hashed(buffers, partial(_read_job, fd), workers)


def copy_hashed(source: np.ndarray, buffers: Sequence[memoryview], workers: int = 0) -> str:
    """:func:`read_hashed` from the bytes of ``source`` (a flat uint8 array as long as the
    buffers together) instead of a file: numpy's copy releases the GIL."""

    whole = memoryview(source).cast("B")

    def copy(job: Job) -> None:
        for view, at in job:
            if len(view) < _SMALL_BYTES:  # under the GIL, but without numpy's fixed cost
                view[:] = whole[at : at + len(view)]
            else:
                np.copyto(np.frombuffer(view, dtype=np.uint8), source[at : at + len(view)])

    return fill_hashed(buffers, copy, workers)


def fill_hashed(
    buffers: Sequence[memoryview], fill: Callable[[Job], None], workers: int = 0
) -> str:
    """Fill ``buffers`` (flat, contiguous) in jobs of at most :data:`READ_CHUNK` bytes (a large
    buffer split, small ones together), ``fill(job)``, on ``workers`` threads at once (default:
    one a CPU this process may use, 2 to 4), and hash each job's bytes in order on the calling
    thread as they arrive, while they are still in the cache. A restore's cost is the copy into
    fresh memory and its page faults: one thread does them at about 2.3 GB/s here, two at about
    4 GB/s, where ``torch.load`` does them on one. No ``fill`` runs past the return (the buffers
    and their source may go then).
    """
    with collection_paused():
        jobs = _jobs(buffers)
    hasher = chunk_hasher()
    # A job of many small pieces runs on the calling thread when its turn comes: its work is
    # mostly Python's, under the GIL, and threads would only take turns at it
    shared = [len(job) <= _SHARED_PIECES for job in jobs]
    pool = None
    if sum(shared) > 1:
        pool = ThreadPoolExecutor(workers or _workers(), thread_name_prefix="li-memory-read")
    try:
        futures = [pool.submit(fill, job) if pool and s else None for job, s in zip(jobs, shared)]
        for job, future in zip(jobs, futures):
            if future is None:
                fill(job)
            else:
                future.result()
            for view, _ in job:
                hasher.update(view)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return str(hasher.hexdigest())


def _jobs(buffers: Sequence[memoryview]) -> list[Job]:
    jobs: list[Job] = []
    job: Job = []
    size = offset = 0
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        for start in range(0, len(view), READ_CHUNK):
            piece = view[start : start + READ_CHUNK]
            if job and (size + len(piece) > READ_CHUNK or len(job) == _IOV_MAX):
                jobs.append(job)
                job, size = [], 0
            job.append((piece, offset + start))
            size += len(piece)
        offset += len(view)
    if job:
        jobs.append(job)
    return jobs


def _workers() -> int:
    return max(2, min(4, usable_cores()))


def _read_job(fd: int, job: Job) -> None:
    """A job's pieces, contiguous in the file: one ``preadv``, then what it left unfilled."""
    n = os.preadv(fd, [view for view, _ in job], job[0][1]) if hasattr(os, "preadv") else 0
    for view, at in job:
        if n >= len(view):
            n -= len(view)
            continue
        _read_into(fd, view[n:], at + n)
        n = 0


def _read_into(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], at + done)
        else:  # no preadv on this platform: a position of its own per read
            n = len(data := os.pread(fd, len(view) - done, at + done))
            view[done : done + n] = data
        if n == 0:
            raise EOFError(f"the file ends at byte {at + done}, before {at + len(view)}")
        done += n


def slots(leaves: list[dict[str, Any]]) -> list[Any]:
    """Room for the state's tensors, by slot (the entries checked by :func:`plan`)."""
    return [None] * (1 + max((e["slot"] for e in leaves), default=-1))


def allocate(e: dict[str, Any]) -> tuple[Any, np.ndarray]:
    """A tensor (or array) of its own for an index entry, and its bytes as a flat uint8 view.
    Not a view into the part: some of torch's functions misread views at an offset
    (``torch.set_rng_state`` crashes on one), and the part's file is deleted later."""
    nbytes = int(e["nbytes"])
    if e["numpy"]:
        raw = np.empty(nbytes, dtype=np.uint8)
        return raw, raw
    dtype = torch_dtype(e["dtype"])
    if element_count(e["shape"], nbytes) * dtype.itemsize != nbytes:  # before allocating
        raise MemoryPartError(f"an index entry's size does not match its shape: {e!s:.300}")
    tensor = torch.empty(e["shape"], dtype=dtype)
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else np.empty(0, np.uint8)
    return tensor, raw


def finish(holder: Any, e: dict[str, Any]) -> Any:
    if e["numpy"]:
        return holder.view(np.dtype(e["dtype"])).reshape(e["shape"])
    if e["param"]:
        return torch.nn.Parameter(holder, requires_grad=bool(e["grad"]))
    if e["grad"] and (holder.is_floating_point() or holder.is_complex()):
        holder.requires_grad_(True)
    return holder


def gap(n: int) -> memoryview:
    """Room for the bytes between two tensors (alignment): read to be hashed, then dropped."""
    return memoryview(np.empty(n, dtype=np.uint8)).cast("B")


def plan(
    leaves: Any, size: int, where: Any, index_bytes: int
) -> tuple[list[memoryview], list[tuple[Any, dict[str, Any]]]]:
    """Fresh tensors for ``leaves``, and the buffers a part's ``size`` bytes of data fill in
    order: each tensor's bytes and the gaps between them (alignment, read to be hashed). Made
    with the garbage collector paused: at tens of thousands of tensors its collections, each
    scanning the same live objects again, took more than half of a restore.

    Every entry is checked before anything is allocated, so that what is allocated is bounded
    by the bytes that exist: its bytes lie in the data, and its slot (an index into the state's
    skeleton, which names each slot in a few bytes of the index's ``index_bytes``) is less than
    ``index_bytes``.

    Raises:
        MemoryPartError: a malformed entry, or the index names bytes outside the data, or
            overlapping.
    """
    if not isinstance(leaves, list) or not all(_well_formed(e, index_bytes) for e in leaves):
        raise MemoryPartError(f"{where} holds a malformed entry")
    buffers, made, offset = [], [], 0
    with collection_paused():
        for e in sorted(leaves, key=lambda e: int(e["offset"])):
            start = int(e["offset"])
            if start < offset or start + int(e["nbytes"]) > size:
                raise MemoryPartError(f"{where} names bytes outside its data")
            holder, raw = allocate(e)
            if start > offset:
                buffers.append(gap(start - offset))
            if raw.nbytes:
                buffers.append(memoryview(raw).cast("B"))
            made.append((holder, e))
            offset = start + raw.nbytes
        if size > offset:
            buffers.append(gap(size - offset))
    return buffers, made


def _natural(value: Any) -> bool:
    return type(value) is int and value >= 0


def _well_formed(e: Any, index_bytes: int) -> bool:
    return (
        isinstance(e, dict)
        and _natural(e.get("slot"))
        and e["slot"] < index_bytes
        and _natural(e.get("offset"))
        and _natural(e.get("nbytes"))
        and isinstance(e.get("dtype"), str)
        and type(e.get("numpy")) is bool
        and isinstance(e.get("shape"), list)
        and all(map(_natural, e["shape"]))
    )


def assemble(
    body: dict[str, Any], made: list[tuple[Any, dict[str, Any]]], *, allow_pickle: bool
) -> Any:
    """The state a part's index ``body`` describes, of the tensors :func:`plan` made and that
    were filled since (the garbage collector paused, as there)."""
    with collection_paused():
        tensors = slots(body["leaves"])
        for holder, e in made:
            tensors[int(e["slot"])] = finish(holder, e)
        return unflatten(body["skeleton"], tensors, allow_pickle=allow_pickle)
