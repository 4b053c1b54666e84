"""The save pipeline after the snapshot: hash, reuse, choose a codec, encode, pack, write.

Runs on the store's background thread; CPU-heavy work (prediction, byte planes, compression) is
spread over the store's worker pool and the pack writes over its writer threads — zstd, numpy
and file I/O release the GIL.
Every encoding goes through the codec registry (:mod:`~lightning_incremental.core.codecs`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field, replace

import numpy as np

from lightning_incremental.core import codecs
from lightning_incremental.core.buffers import collection_paused
from lightning_incremental.core.chunks.decode import BaseReader
from lightning_incremental.core.chunks.delta_base import Parent
from lightning_incremental.core.chunks.hints import Hints
from lightning_incremental.core.chunks.lossy import (
    family,
    lossy_codec,
    lossy_key,
    reusable,
)
from lightning_incremental.core.chunks.pace import Pacer, shrinks_little
from lightning_incremental.core.chunks.packs import PackWriter, aligned_from
from lightning_incremental.core.chunks.small import STORE_SMALL, encode_small, small_leaves
from lightning_incremental.core.codecs import STORED, Codec, Hint, chunk_hash
from lightning_incremental.core.codecs.stored import stored
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.format.records import ChunkRecipe, TensorEntry, closure
from lightning_incremental.core.format.tree import Leaf
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.workers import cpu_times

log = logging.getLogger("lightning_incremental")


@dataclass
class Encoded:
    """The result of encoding one save's tensors: manifest tables and figures."""

    tensors: list[TensorEntry]
    chunks: dict[str, ChunkRecipe]
    packs: dict[str, int]
    written: set[str] = field(default_factory=set)  # packs this save wrote (the rest: adopted)
    bytes_written: int = 0
    encode_s: float = 0.0
    write_s: float = 0.0
    chunks_total: int = 0
    chunks_reused: int = 0
    chunks_delta: int = 0
    chunks_full: int = 0
    fast: bool = False  # changed chunks stored as they are (codec_effort)
    chunks_as_is: int = 0  # changed chunks stored as they are (fast, or paced: see encode)
    cpu_run_s: float = 0.0  # the encoding thread's time on a CPU during encode
    cpu_wait_s: float = 0.0  # ... and runnable but waiting for one (see workers.cpu_times)
    # encode(durable=False): waits until the packs it wrote are durable (raising write errors)
    pending: Callable[[], None] | None = field(default=None, repr=False, compare=False)


@dataclass
class _Task:
    digest: str  # the chunk's key: its raw hash, or its lossy_key when coded lossily
    raw: np.ndarray
    width: int
    base: np.ndarray | None
    base_digest: str | None
    base_recipe: ChunkRecipe | None
    # No base in memory: decode the parent's chunk ``base_digest`` from storage (on the worker)
    fetch: Callable[[str], np.ndarray | None] | None = None
    lossy: Codec | None = None  # the lossy codec configured for this tensor, if any
    place: tuple[str, int] = ("", 0)  # tensor key, chunk index (a delta's: for its hint)
    slot: tuple[str, int] = ("", 0)  # tensor key, chunk index (every chunk's: for pacing)
    hint: Hint | None = None  # how the same place was coded last time (see Hints)
    raw_digest: str = ""  # the raw hash: the key if its lossy codec declines it (stored exactly)
    tensor_bytes: int = 0  # the size of the tensor it belongs to (for aligned packs)
    last: bool = True  # it is that tensor's last chunk


@dataclass(frozen=True)
class _Payload:
    codec: Codec
    blob: bytes | memoryview
    decoded: str | None  # hash of the decoded bytes, for a lossy codec
    seconds: float
    hint: Hint | None = None  # the delta codec's choice, for the next save


# Chunks smaller than this are encoded on the scheduling thread itself. Their encoding is
# mostly Python (tens of microseconds, numpy and zstd calls too short to release the GIL for
# long): handed to the workers, each cost a queue round trip and GIL hand-offs between three
# threads. Saving only the small tensors of the benchmark's transformer (biases, norms, their
# moments: 300 of its 408 chunks, 0.2 % of its bytes) took 50 ms a save that way, 37 ms inline.
INLINE_MAX = 64 << 10
# Paced, while the writers wait, the window may grow to this many times its limit before the
# scheduling thread waits for the encoders (a bound: lossy chunks are coded all the same).
PACED_AHEAD = 2


def _encode_task(task: _Task, level: int, max_chain_ratio: float, fast: bool = False) -> _Payload:
    start = time.perf_counter()
    raw = task.raw
    if fast and task.lossy is None:
        return _Payload(STORED, stored(raw), None, 0.0)
    if task.lossy is not None:
        blob = task.lossy.encode(raw, None, width=task.width, level=level)
        if blob is not None:
            out = np.empty(raw.size, dtype=np.uint8)
            task.lossy.decode_into(blob, out, None, width=task.width)
            codec: Codec = task.lossy
            delta = _lossy_delta(task, task.lossy, level, max_chain_ratio)
            if delta is not None and len(delta[1]) < len(blob):
                codec, blob = delta
            return _Payload(codec, blob, chunk_hash(out), _since(start))
        # Not codable that way (a NaN, a negative second moment): stored losslessly, standalone
        # (the parent's chunk is lossy: no base for a lossless delta).
        codec, blob = codecs.encode_best(raw, None, task.width, level)
        return _Payload(codec, blob, None, _since(start))
    base = task.base
    if base is None and task.fetch is not None and task.base_digest is not None:
        base = task.fetch(task.base_digest)
    if task.base_recipe is None:
        base = None
    budget = max_chain_ratio * raw.size - (task.base_recipe.chain if task.base_recipe else 0)
    codec, blob, hint = codecs.encode_choice(
        raw, base, task.width, level, delta_budget=budget, hint=task.hint
    )
    return _Payload(codec, blob, None, _since(start), hint)


def _lossy_delta(
    task: _Task, lossy: Codec, level: int, max_chain_ratio: float
) -> tuple[Codec, bytes | memoryview] | None:
    """The chunk as a lossy delta against the parent's chunk as it decodes (see
    :mod:`~lightning_incremental.core.codecs.lossy`), or None. The parent's chunk is taken from
    its raw bytes in memory (coded and decoded again) or decoded from storage, and used only
    when it matches the hash of its decoded bytes in the parent's manifest: a restore decodes
    exactly that base."""
    delta = codecs.delta_of(lossy)
    recipe = task.base_recipe
    if delta is None or recipe is None or task.base_digest is None:
        return None
    if max_chain_ratio * task.raw.size - recipe.chain <= 0:
        return None
    if task.base is not None:
        again = lossy.encode(task.base, None, width=task.width, level=level)
        if again is None:
            return None
        base = np.empty(task.base.size, dtype=np.uint8)
        lossy.decode_into(again, base, None, width=task.width)
    elif task.fetch is not None:
        fetched = task.fetch(task.base_digest)
        if fetched is None:
            return None
        base = fetched
    else:
        return None
    if chunk_hash(base) != recipe.decoded:
        return None
    blob = delta.encode(task.raw, base, width=task.width, level=level)
    if blob is None or len(blob) > max_chain_ratio * task.raw.size - recipe.chain:
        return None
    return delta, blob


def _done(payload: _Payload) -> Future[_Payload]:
    done: Future[_Payload] = Future()
    done.set_result(payload)
    return done


def _since(start: float) -> float:
    return time.perf_counter() - start


def mixed_key(out: Encoded, exact: set[str]) -> str | None:
    """A key whose recipe contradicts a use of it in ``out``: a lossy chunk named by a tensor
    of ``exact`` (those coded losslessly), or a delta on a base of the other kind; else None.

    Possible only when building on a checkpoint whose lossy chunks are keyed by their raw hash
    (written before :func:`lossy_key`): a lossy delta adopts such a chunk as its base, and a
    lossless chunk of the same bytes this save needs has the same key."""
    for tensor in out.tensors:
        if tensor.path in exact:
            for digest in tensor.chunks:
                if not out.chunks[digest].lossless:
                    return digest
    for recipe in out.chunks.values():
        if recipe.base is not None and out.chunks[recipe.base].lossless != recipe.lossless:
            return recipe.base
    return None


def encode(
    leaves: list[Leaf],
    parent: Parent | None,
    *,
    full_base: bool,
    config: StoreConfig,
    storage: Storage,
    pool: Executor,
    writer: Executor | None = None,
    avoid: set[str] | frozenset[str] = frozenset(),
    hints: Hints | None = None,
    fast: bool = False,
    pacer: Pacer | None = None,
    durable: bool = True,
) -> Encoded:
    """Encode and write the data of one checkpoint; returns its manifest tables once every object
    it wrote is durable — or, without ``durable``, once every pack is handed to a writer, the
    tables complete: ``Encoded.pending`` then waits for the writes (the caller prepares the
    manifest meanwhile). Writes nothing visible: the caller commits the manifest. Chunks are
    encoded on ``pool``, packs written on ``writer`` (default: ``pool``). Chunks whose chain
    touches an object in ``avoid`` (found damaged) are neither reused nor delta bases. ``hints``:
    the store's memory of how each place was coded (read, and updated when this save is done).
    ``fast``: changed chunks are stored as they are (codec ``s``), lossy ones excepted.
    ``pacer``: each changed chunk is coded in full only while that costs no time, else stored
    as it is (:mod:`.pace`; ``codec_effort="auto"``).
    A member of a shared pool writes aligned packs (see :class:`~.packs.PackWriter`).

    A chunk coded lossily is keyed by :func:`lossy_key`, apart from a lossless chunk of the same
    bytes; one its lossy codec declines is stored exactly, under its raw hash."""
    parent_chunks: Mapping[str, ChunkRecipe] = parent.manifest.chunks if parent else {}
    if avoid:
        whole = parent_chunks
        parent_chunks = {
            digest: recipe
            for digest, recipe in whole.items()
            if not any(whole[link].pack in avoid for link in closure(digest, whole))
        }
    out = Encoded(tensors=[], chunks={}, packs={}, fast=fast)
    times = cpu_times()
    pack = PackWriter(
        storage,
        writer or pool,
        config.pack_size,
        out,
        sum(leaf.nbytes for leaf in leaves),
        aligned_from=aligned_from(storage),
        # Paced, how a chunk is coded depends on timing: not in aligned packs, whose bytes must
        # be the same in two runs that store the same tensors (a shared pool holds them once).
        pacer=pacer if not fast and aligned_from(storage) is None else None,
    )
    paced = pack.pacer
    fetch = None
    stored: dict[str, TensorEntry] = {}
    same_chunking = parent is not None and parent.manifest.chunk_size == config.chunk_size
    if parent is not None and config.uses_xor and config.xor_base_from_storage:
        stored = {
            a.path: a
            for t in parent.manifest.tensors
            for a in t.arrays()
            if a.path not in parent.base
        }
        fetch = BaseReader(storage, parent.manifest, parent_chunks).read
    window: deque[tuple[Future[_Payload], _Task]] = deque()

    def _worth(task: _Task) -> bool:
        """Paced: whether to code ``task`` in full now (before the first pack is handed
        over, yes: see :mod:`.pace`). The window holds at most ``PACED_AHEAD`` times its
        limit (see drain): counting it is bounded work."""
        assert paced is not None
        if not pack.handed:
            return True
        coding = sum(1 for fut, _ in window if not fut.done())
        return paced.code(
            nbytes=int(task.raw.size),
            coding=coding,
            unwritten=pack.unwritten,
            ratio=paced.estimate(task.slot, delta=task.base_recipe is not None),
        )

    scheduled: set[str] = set()
    made: dict[tuple[str, int], tuple[Hint, bool]] = {}
    declined: dict[str, str] = {}  # lossy key -> raw hash, for chunks stored exactly instead
    exact: set[str] = set()  # keys of the tensors coded losslessly

    def adopt(digest: str) -> None:
        while digest not in out.chunks:
            assert parent is not None
            recipe = parent_chunks[digest]
            out.chunks[digest] = recipe
            out.packs[recipe.pack] = parent.manifest.packs[recipe.pack]
            if recipe.base is None:
                return
            digest = recipe.base

    def drain(limit: int, *, end: bool = False) -> None:
        """Pack the oldest chunks until ``limit`` are left being encoded. Paced, while the
        writers wait for the encoder: return, so that the next chunks are stored as they are
        (up to ``PACED_AHEAD`` times ``limit`` in the window: lossy chunks are coded whatever
        the writers do); at the ``end``, store those whose coding has not started as they are."""
        while len(window) > limit:
            oldest, task = window[0]
            if paced is not None and not oldest.done():
                if pack.waiting():
                    if end:
                        if _cancel_waiting():
                            continue
                    elif len(window) <= PACED_AHEAD * limit:
                        return
                running = pack.writing()
                either = [oldest] if running is None else [oldest, running]
                wait(either, return_when=FIRST_COMPLETED)
                continue
            fut, task = window.popleft()
            if fut.cancelled():  # by _cancel_waiting
                assert paced is not None
                paced.stored(task.slot, delta=task.base_recipe is not None)
                settle(_done(_encode_task(task, 0, 0.0, True)), task)
                out.chunks_as_is += 1
            else:
                settle(fut, task)

    def _cancel_waiting() -> bool:
        """Cancel the coding of every lossless chunk in the window whose coding has not
        started and whose place the codec shrinks little (they are then stored as they
        are); whether any was."""
        assert paced is not None
        return sum(fut.cancel() for fut, task in window if task.lossy is None and _pace(task)) > 0

    def _pace(task: _Task) -> bool:
        """Whether ``task``'s place is one that pacing may store as it is (see .pace)."""
        assert paced is not None
        return shrinks_little(paced.estimate(task.slot, delta=task.base_recipe is not None))

    def settle(fut: Future[_Payload], task: _Task) -> None:
        """Add an encoded chunk to its pack, its recipe to the tables."""
        done = fut.result()
        out.encode_s += done.seconds
        if paced is not None and done.seconds > 0 and task.lossy is None:  # coded, not as is
            delta = task.base_recipe is not None
            paced.coded(int(task.raw.size), done.seconds, task.slot, len(done.blob), delta=delta)
        if done.hint is not None:
            made[task.place] = (done.hint, done.hint == task.hint)
        # The recipe's fields; the pack writer adds where the payload lies and builds it.
        fields = {
            "kind": done.codec.kind,
            "size": int(task.raw.size),
            "width": task.width,
            "chain": len(done.blob),
            "lossless": done.codec.lossless,
            "decoded": done.decoded,
        }
        if done.codec.needs_base:
            assert task.base_digest is not None and task.base_recipe is not None
            adopt(task.base_digest)
            fields["base"] = task.base_digest
            fields["depth"] = task.base_recipe.depth + 1
            fields["chain"] = task.base_recipe.chain + len(done.blob)
            out.chunks_delta += 1
        else:
            out.chunks_full += 1
        key = task.digest
        if task.lossy is not None and done.codec.lossless:
            key = declined[task.digest] = task.raw_digest
        pack.add(key, done.blob, fields, tensor_bytes=task.tensor_bytes, last=task.last)

    entries: list[TensorEntry | None] = [None] * len(leaves)

    def has_base(key: str, size: int) -> bool:
        """Whether the loop below would code a new chunk of ``key`` against a base."""
        if parent is None or full_base or not same_chunking:
            return False
        in_memory = parent.base.get(key) if config.uses_xor else None
        if in_memory is not None and in_memory[0].size == size:
            return True
        before = stored.get(key) if fetch is not None else None
        return before is not None and before.nbytes == size

    try:
        general = range(len(leaves))
        small = small_leaves(leaves, config.chunk_size)
        if small:
            with collection_paused():  # an entry or two per tensor, all live
                rest = encode_small(
                    leaves, small, entries, parent=parent, parent_chunks=parent_chunks,
                    has_base=has_base, out=out, pack=pack, scheduled=scheduled, exact=exact,
                    adopt=adopt, full_base=full_base, config=config,
                )  # fmt: skip
            general = sorted({*general} - set(small) | set(rest))  # type: ignore[assignment]
        for number in general:
            leaf = leaves[number]
            raw = leaf.raw()
            width = leaf.width
            lossy = lossy_codec(leaf.path, config, leaf.dtype)
            if lossy is None:
                exact.add(leaf.key)
            xor_base = parent.base.get(leaf.key) if (parent and config.uses_xor) else None
            if xor_base is not None and (xor_base[0].size != raw.size or not same_chunking):
                xor_base = None  # different size or chunking: chunk i is not chunk i any more
            # Not in memory (a parent read from storage, e.g. after a restart or a restore):
            # the parent's chunks are decoded from storage one by one on the workers.
            stored_base = None
            if xor_base is None and fetch is not None:
                before = stored.get(leaf.key)
                if before is not None and before.nbytes == raw.size and same_chunking:
                    stored_base = before.chunks
            digests = []
            for offset in range(0, raw.size, config.chunk_size):
                piece = raw[offset : offset + config.chunk_size]
                pack.remaining -= piece.size
                raw_digest = chunk_hash(piece)
                digest = raw_digest if lossy is None else lossy_key(raw_digest, lossy.kind)
                digests.append(digest)
                out.chunks_total += 1
                if digest in out.chunks or digest in scheduled:
                    out.chunks_reused += 1
                    continue
                known = parent_chunks.get(digest)
                if known is not None and reusable(known, lossy, full_base):
                    adopt(digest)
                    out.chunks_reused += 1
                    continue
                task = _Task(
                    digest, piece, width, None, None, None, lossy=lossy, raw_digest=raw_digest,
                    tensor_bytes=int(raw.size), last=offset + config.chunk_size >= raw.size,
                )  # fmt: skip
                index = offset // config.chunk_size
                task.slot = (leaf.key, index)  # pacing remembers how it coded (see .pace)
                base_digests = xor_base[1] if xor_base is not None else stored_base
                if base_digests is not None and not full_base and index < len(base_digests):
                    base_digest = base_digests[index]
                    base_recipe = parent_chunks.get(base_digest)
                    if (
                        base_recipe is not None
                        and (
                            base_recipe.lossless
                            if lossy is None
                            else base_recipe.kind in family(lossy)
                        )
                        and base_recipe.depth < config.max_chain
                        and base_recipe.size == piece.size
                    ):
                        if xor_base is not None:
                            task.base = xor_base[0][offset : offset + config.chunk_size]
                        else:
                            task.fetch = fetch
                        task.base_digest, task.base_recipe = base_digest, base_recipe
                        task.place = (leaf.key, index)
                        task.hint = hints.get(task.place) if hints is not None else None
                scheduled.add(digest)
                as_is = lossy is None and (fast or (paced is not None and not _worth(task)))
                args = (task, config.compression_level, config.max_chain_ratio, as_is)
                small = raw.size < STORE_SMALL and task.base_recipe is None  # the tensor
                if lossy is None and (as_is or small):  # stored as it is (see .small)
                    args = (task, config.compression_level, config.max_chain_ratio, True)
                    out.chunks_as_is += as_is and not small
                if as_is and paced is not None:
                    paced.stored(task.slot, delta=task.base_recipe is not None)
                if (piece.size < INLINE_MAX and task.fetch is None) or as_is:
                    done = _done(_encode_task(*args))
                else:
                    done = pool.submit(_encode_task, *args)
                if paced is not None and as_is:
                    settle(done, task)  # packed now, not behind the chunks still being coded
                else:
                    window.append((done, task))
                drain(2 * getattr(pool, "max_workers", 2))
            entries[number] = TensorEntry(
                path=leaf.key,
                dtype=leaf.dtype,
                shape=tuple(leaf.shape),
                nbytes=int(raw.size),
                width=width,
                device=leaf.device,
                numpy=leaf.is_numpy,
                param=leaf.parameter,
                requires_grad=leaf.requires_grad,
                chunks=tuple(digests),
            )
        drain(0, end=True)
        out.tensors = entries  # type: ignore[assignment]  # every one is filled in
        pack.finish(wait=durable)
        if not durable:
            out.pending = pack.wait
        after = cpu_times()
        if times is not None and after is not None:
            out.cpu_run_s, out.cpu_wait_s = after[0] - times[0], after[1] - times[1]
    except BaseException:
        for fut, _ in window:
            fut.cancel()
        pack.abandon()
        raise
    if declined:
        out.tensors = [
            replace(t, chunks=tuple(declined.get(d, d) for d in t.chunks)) for t in out.tensors
        ]
    mixed = mixed_key(out, exact)
    if mixed is not None:
        if full_base:  # no delta, no adopted chain: every key has one meaning
            raise AssertionError(f"chunk {mixed} is both lossy and lossless in one save")
        # What this attempt wrote is left unreferenced (gc collects it).
        if out.pending is not None:
            out.pending()
        log.warning(
            "chunk %s of checkpoint step %s is keyed by its raw hash and lossy, and this save "
            "needs that key for a lossless chunk: writing this save as a full base",
            mixed,
            parent.step if parent else None,
        )
        return encode(
            leaves,
            parent,
            full_base=True,
            config=config,
            storage=storage,
            pool=pool,
            writer=writer,
            avoid=avoid,
            hints=hints,
            fast=fast,
            pacer=pacer,
            durable=durable,
        )
    if hints is not None:
        hints.update(made, {leaf.key for leaf in leaves})
    if pacer is not None:
        pacer.forget_except({leaf.key for leaf in leaves})
    return out
