"""The save pipeline after the snapshot: hash, reuse, delta-encode, compress, pack, write.

Runs on the store's background thread; CPU-heavy work (compression, XOR, byte grouping) and the
object writes are spread over the store's worker pool — zstd, numpy and file I/O release the GIL.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_incremental.core import codec
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.decoder import ObjectReader, decode_chunk
from lightning_incremental.core.errors import CorruptCheckpointError
from lightning_incremental.core.manifest import closure, pack_path
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.tree import Leaf

log = logging.getLogger("lightning_incremental")


@dataclass
class Parent:
    """The newest committed checkpoint, as the next save builds on it."""

    step: int
    manifest: dict[str, Any]
    # XOR base: tensor path -> (its raw bytes, its chunk hashes); only what fits the budget.
    base: dict[str, tuple[np.ndarray, list[str]]] = field(default_factory=dict)
    # The host buffers behind ``base``, recycled once a newer parent replaces this one.
    buffers: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Encoded:
    """The result of encoding one save: manifest tables and figures."""

    tensors: list[dict[str, Any]]
    chunks: dict[str, dict[str, Any]]
    packs: dict[str, dict[str, int]]
    written: set[str] = field(default_factory=set)  # packs this save wrote (the rest: adopted)
    bytes_written: int = 0
    encode_s: float = 0.0
    write_s: float = 0.0
    chunks_total: int = 0
    chunks_reused: int = 0
    chunks_delta: int = 0
    chunks_full: int = 0


@dataclass
class _Task:
    digest: str
    raw: np.ndarray
    width: int
    base: np.ndarray | None
    base_digest: str | None
    base_recipe: dict[str, Any] | None
    # No base in memory: decode the parent's chunk ``base_digest`` from storage (on the worker)
    fetch: Callable[[str], np.ndarray | None] | None = None


# Choosing between standalone and XOR encodings: compressing both costs twice the CPU. For a
# chunk of at least SAMPLE_MIN bytes both are first tried on a sample (SAMPLE_SLICES slices
# spread over the chunk); when one wins by more than SAMPLE_MARGIN only it is compressed in
# full, otherwise both are and the smaller is kept. Either way the result is exact — only the
# choice between two lossless encodings is estimated.
SAMPLE_MIN = 256 << 10
SAMPLE_SLICES = 4
SAMPLE_SLICE = 16 << 10
SAMPLE_MARGIN = 0.10


def _sample(data: np.ndarray) -> np.ndarray:
    stride = data.size // SAMPLE_SLICES
    return np.concatenate(
        [data[i * stride : i * stride + SAMPLE_SLICE] for i in range(SAMPLE_SLICES)]
    )


def _encode_task(task: _Task, level: int, max_chain_ratio: float) -> tuple[str, bytes, float]:
    start = time.perf_counter()
    raw, base = task.raw, task.base
    if base is None and task.fetch is not None and task.base_digest is not None:
        base = task.fetch(task.base_digest)
    if base is None or task.base_recipe is None:
        return codec.KIND_FULL, codec.encode_full(raw, task.width, level), _since(start)
    chain_budget = max_chain_ratio * raw.size - task.base_recipe["chain"]
    try_full = try_xor = True
    if raw.size >= SAMPLE_MIN:
        s_raw, s_base = _sample(raw), _sample(base)
        full_est = len(codec.encode_full(s_raw, task.width, level))
        xor_est = len(codec.encode_xor(s_raw, s_base, task.width, level))
        try_full = not xor_est < full_est * (1 - SAMPLE_MARGIN)
        try_xor = not full_est < xor_est * (1 - SAMPLE_MARGIN)
    if try_xor:
        delta = codec.encode_xor(raw, base, task.width, level)
        if len(delta) > chain_budget:
            try_full = True  # the chain would grow past max_chain_ratio
        elif not try_full:
            return codec.KIND_XOR, delta, _since(start)
    full = codec.encode_full(raw, task.width, level)
    if try_xor and len(delta) <= chain_budget and len(delta) < len(full):
        return codec.KIND_XOR, delta, _since(start)
    return codec.KIND_FULL, full, _since(start)


def _since(start: float) -> float:
    return time.perf_counter() - start


class _PackWriter:
    """Appends encoded chunks to pack objects and writes full packs in the background."""

    def __init__(self, storage: Storage, pool: Executor, pack_size: int, out: Encoded) -> None:
        self.storage, self.pool, self.pack_size, self.out = storage, pool, pack_size, out
        self.parts: list[bytes] = []
        self.filled = 0
        self.pending_recipes: list[dict[str, Any]] = []
        self.writes: deque[Future[float]] = deque()

    def add(self, blob: bytes, recipe: dict[str, Any]) -> None:
        recipe["offset"] = self.filled
        recipe["length"] = len(blob)
        self.parts.append(blob)
        self.filled += len(blob)
        self.pending_recipes.append(recipe)
        if self.filled >= self.pack_size:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        data = b"".join(self.parts)
        path = pack_path(codec.chunk_hash(data))
        for recipe in self.pending_recipes:
            recipe["pack"] = path
        self.out.packs[path] = {"size": len(data)}
        self.out.written.add(path)
        self.out.bytes_written += len(data)
        self.parts, self.filled, self.pending_recipes = [], 0, []
        self.writes.append(self.pool.submit(self._write, path, data))
        while len(self.writes) > 2:
            self.out.write_s += self.writes.popleft().result()

    def _write(self, path: str, data: bytes) -> float:
        start = time.perf_counter()
        if not self.storage.put(path, data):
            # Same content, same name: an earlier checkpoint's object, or one left behind by a
            # deleted checkpoint or a crashed save. It is written again all the same: it may
            # have rotted or been truncated, and an old object that no manifest names yet may
            # be collected by a concurrent gc at any moment — a fresh one is protected by its
            # grace period, like every other object this save writes.
            self.storage.put(path, data, overwrite=True)
        return time.perf_counter() - start

    def finish(self) -> None:
        """Flush the last pack and wait until every pack is durable (re-raising write errors)."""
        self.flush()
        while self.writes:
            self.out.write_s += self.writes.popleft().result()

    def abandon(self) -> None:
        for fut in self.writes:
            fut.cancel()
        for fut in self.writes:
            if not fut.cancelled():
                fut.exception()  # wait; the first error is already being raised


def encode(
    leaves: list[Leaf],
    parent: Parent | None,
    *,
    full_base: bool,
    config: StoreConfig,
    storage: Storage,
    pool: Executor,
    avoid: set[str] | frozenset[str] = frozenset(),
) -> Encoded:
    """Encode and write the data of one checkpoint; returns its manifest tables once every object
    it wrote is durable. Writes nothing visible: the caller commits the manifest. Chunks whose
    chain touches an object in ``avoid`` (found damaged) are neither reused nor delta bases."""
    parent_chunks: dict[str, Any] = parent.manifest["chunks"] if parent else {}
    if avoid:
        whole = parent_chunks
        parent_chunks = {
            digest: recipe
            for digest, recipe in whole.items()
            if not any(whole[link]["pack"] in avoid for link in closure(digest, whole))
        }
    out = Encoded(tensors=[], chunks={}, packs={})
    pack = _PackWriter(storage, pool, config.pack_size, out)
    fetch = None
    stored: dict[str, dict[str, Any]] = {}
    if parent is not None and config.uses_xor and config.xor_base_from_storage:
        stored = {t["path"]: t for t in parent.manifest["tensors"] if t["path"] not in parent.base}
        fetch = BaseReader(storage, parent.manifest, parent_chunks).read
    window: deque[tuple[Future[tuple[str, bytes, float]], _Task]] = deque()
    scheduled: set[str] = set()

    def adopt(digest: str) -> None:
        while digest not in out.chunks:
            recipe = parent_chunks[digest]
            out.chunks[digest] = recipe
            out.packs[recipe["pack"]] = parent.manifest["packs"][recipe["pack"]]  # type: ignore[union-attr]
            if recipe["kind"] != codec.KIND_XOR:
                return
            digest = recipe["base"]

    def drain(limit: int) -> None:
        while len(window) > limit:
            fut, task = window.popleft()
            kind, blob, seconds = fut.result()
            out.encode_s += seconds
            recipe: dict[str, Any] = {
                "size": int(task.raw.size),
                "width": task.width,
                "kind": kind,
                "base": None,
                "depth": 0,
                "chain": len(blob),
            }
            if kind == codec.KIND_XOR:
                assert task.base_digest is not None and task.base_recipe is not None
                adopt(task.base_digest)
                recipe["base"] = task.base_digest
                recipe["depth"] = task.base_recipe["depth"] + 1
                recipe["chain"] = task.base_recipe["chain"] + len(blob)
                out.chunks_delta += 1
            else:
                out.chunks_full += 1
            pack.add(blob, recipe)
            out.chunks[task.digest] = recipe

    try:
        for leaf in leaves:
            raw = leaf.raw()
            width = leaf.width
            xor_base = parent.base.get(leaf.path) if (parent and config.uses_xor) else None
            if xor_base is not None and (
                xor_base[0].size != raw.size or parent.manifest["chunk_size"] != config.chunk_size  # type: ignore[union-attr]
            ):
                xor_base = None  # different size or chunking: chunk i is not chunk i any more
            # Not in memory (a parent read from storage, e.g. after a restart or a restore):
            # the parent's chunks are decoded from storage one by one on the workers.
            stored_base = None
            if xor_base is None and fetch is not None:
                before = stored.get(leaf.path)
                if (
                    before is not None
                    and before["nbytes"] == raw.size
                    and parent.manifest["chunk_size"] == config.chunk_size  # type: ignore[union-attr]
                ):
                    stored_base = before["chunks"]
            digests = []
            for offset in range(0, raw.size, config.chunk_size):
                piece = raw[offset : offset + config.chunk_size]
                digest = codec.chunk_hash(piece)
                digests.append(digest)
                out.chunks_total += 1
                if digest in out.chunks or digest in scheduled:
                    out.chunks_reused += 1
                    continue
                known = parent_chunks.get(digest)
                if known is not None and (not full_base or known["depth"] == 0):
                    adopt(digest)
                    out.chunks_reused += 1
                    continue
                task = _Task(digest, piece, width, None, None, None)
                index = offset // config.chunk_size
                base_digests = xor_base[1] if xor_base is not None else stored_base
                if base_digests is not None and not full_base and index < len(base_digests):
                    base_digest = base_digests[index]
                    base_recipe = parent_chunks.get(base_digest)
                    if (
                        base_recipe is not None
                        and base_recipe["depth"] < config.max_chain
                        and base_recipe["size"] == piece.size
                    ):
                        if xor_base is not None:
                            task.base = xor_base[0][offset : offset + config.chunk_size]
                        else:
                            task.fetch = fetch
                        task.base_digest, task.base_recipe = base_digest, base_recipe
                scheduled.add(digest)
                window.append(
                    (
                        pool.submit(
                            _encode_task, task, config.compression_level, config.max_chain_ratio
                        ),
                        task,
                    )
                )
                drain(2 * config.workers)
            out.tensors.append(
                {
                    "path": leaf.path,
                    "dtype": leaf.dtype,
                    "shape": leaf.shape,
                    "nbytes": int(raw.size),
                    "width": width,
                    "device": leaf.device,
                    "numpy": leaf.is_numpy,
                    "param": leaf.parameter,
                    "requires_grad": leaf.requires_grad,
                    "chunks": digests,
                }
            )
        drain(0)
        pack.finish()
    except BaseException:
        for fut, _ in window:
            fut.cancel()
        pack.abandon()
        raise
    return out


class BaseReader:
    """A parent checkpoint's chunks, decoded from storage on demand (as XOR bases when the
    parent's bytes are not in memory). A chunk that cannot be read or fails its hash is no base:
    the chunk it would have been the base of is stored standalone instead."""

    def __init__(self, storage: Storage, manifest: dict[str, Any], chunks: dict[str, Any]) -> None:
        self.storage, self.manifest, self.chunks = storage, manifest, chunks

    def read(self, digest: str) -> np.ndarray | None:
        if digest not in self.chunks:
            return None
        reader = ObjectReader(self.storage, self.manifest, f"step {self.manifest.get('step')}")
        out = np.empty(self.chunks[digest]["size"], dtype=np.uint8)
        try:
            for plan in reader.plan(set(closure(digest, self.chunks))):
                reader.read(plan)
            decode_chunk(digest, self.chunks, reader.blobs, out, reader.where)
        except (CorruptCheckpointError, OSError):
            return None
        return out


def next_parent(
    step: int,
    manifest: dict[str, Any],
    leaves: list[Leaf],
    tensors: list[dict[str, Any]],
    config: StoreConfig,
) -> tuple[Parent, list[torch.Tensor]]:
    """The parent of the next save after ``step`` committed: its XOR base is this snapshot's
    bytes, tensor by tensor, within ``config.xor_base_memory``. Also returns the snapshot buffers
    the base does not keep (free to recycle)."""
    parent = Parent(step, manifest)
    spare: list[torch.Tensor] = []
    used, budget = 0, config.xor_base_memory
    for leaf, entry in zip(leaves, tensors):
        raw = leaf.raw()
        if not config.uses_xor or (budget is not None and used + raw.size > budget):
            spare.append(leaf.data)
            continue
        parent.base[leaf.path] = (raw, entry["chunks"])
        parent.buffers.append(leaf.data)
        used += raw.size
    return parent, spare
