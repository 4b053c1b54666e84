"""The memory tier on one node: a rank's part of a step as files in node-local memory (tmpfs)
that outlive the training process.

A part is a directory ``s<step>-g<generation>-r<rank>`` under ``<memory_dir>/<job>`` holding

- ``data.bin``: every tensor's raw bytes, one after another (64-byte aligned) — restored by
  viewing the file, no decoding and no unpickling;
- ``index.json``: the state's skeleton (:mod:`lightning_incremental.core.format.tree`, the
  engine's own) and each tensor's dtype, shape and offset;
- ``header.json``: job, generation, world size, rank, step, and the size and xxh3-128 hash of
  the two other files, checked when the part is read (the files, their records and checks:
:mod:`.part`).

It is written under a temporary name and made visible by one rename: a part is complete or
absent. From a rank's second step on, the snapshot is copied straight into the mapped
``data.bin`` of the part it becomes (:mod:`.slots`): one copy of the state per step, on
the training thread; the hash, the index and the rename run in the background. A part of this
process that is no longer kept is renamed back to a hidden slot and becomes the next step's
file. Anything the tier cannot do (a full tmpfs, any ``OSError``) is a warning and ``None``:
the persistent store remains the tier of record; training never stops for the memory tier.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import shutil
import warnings
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_incremental.core.buffers import BufferPool
from lightning_incremental.core.codecs.bytes import chunk_hash, chunk_hasher
from lightning_incremental.core.save.snapshot import flatten
from lightning_incremental.runtime.memory.part import (
    ALIGN,
    DATA,
    FORMAT,
    HEADER,
    INDEX,
    NAME,
    Held,
    Part,
    Snapshot,
    changed,
    check,
    entry,
    parse_header,
    raw,
    read_index,
    snapshot,
)
from lightning_incremental.runtime.memory.read import (
    MemoryPartError,
    assemble,
    copy_hashed,
    plan,
    read_hashed,
)
from lightning_incremental.runtime.memory.slots import (
    Slot,
    SlotPool,
    Slots,
    fill,
    hash_file,
    sweep,
)

log = logging.getLogger(__name__)

ENV = "LIGHTNING_INCREMENTAL_MEMORY_DIR"

def default_dir() -> Path:
    """``$LIGHTNING_INCREMENTAL_MEMORY_DIR`` when set, else ``/dev/shm/lightning-incremental``
    (each job's parts go to a directory of their own in it)."""
    env = os.environ.get(ENV)
    return Path(env) if env else Path("/dev/shm/lightning-incremental")


class MemoryTier:
    """The parts in ``directory`` of job ``job``, generation ``generation``, on a world of
    ``world_size`` ranks."""

    def __init__(
        self,
        directory: str | Path,
        *,
        job: str,
        generation: int,
        world_size: int,
        allow_pickle: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.parts = self.directory / job  # jobs sharing a directory never meet
        self.job = job
        self.generation = generation
        self.world_size = world_size
        self.layout = 0  # what a part's header says of where the replicated state is (Held)
        self.allow_pickle = allow_pickle
        self.failures = 0  # writes that failed (each warned or logged)
        self.copies = 0  # copies of a tensor's bytes made by write() (after the snapshot's own)
        self.slots = Slots(self.parts)  # this process's mapped data files
        sweep(self.parts)

    def name(self, rank: int, step: int, generation: int | None = None) -> str:
        gen = self.generation if generation is None else generation
        return f"s{step:012d}-g{gen:06d}-r{rank:06d}"

    # ------------------------------------------------------------------ writing

    def snapshot(self, state: Any, rank: int, pool: BufferPool | None = None) -> Snapshot:
        """Copy ``state`` (``rank``'s part) to host memory on the caller's thread: straight into
        a slot's mapped file when this rank's previous part gave its size, else into buffers
        from ``pool``."""
        slot = self.slots.take(rank)
        if slot is None:
            return snapshot(state, allow_pickle=self.allow_pickle, pool=pool)
        mapped = SlotPool(slot, pool)
        try:
            skeleton, leaves, _ = flatten(state, allow_pickle=self.allow_pickle, pool=mapped)
        except BaseException:
            self.slots.spare(rank, slot)
            raise
        return Snapshot(skeleton, leaves, slot, mapped.used)

    def write(self, snap: Snapshot, rank: int, step: int) -> bool:
        """Write ``snap`` as ``rank``'s part of ``step``; False (after a warning) when the
        memory tier cannot take it."""
        if snap.slot is not None:
            return self._write_slot(snap, snap.slot, rank, step)
        index: list[dict[str, Any]] = []
        hasher = chunk_hasher()
        offset = 0
        tmp = self._tmp(rank, step)
        try:
            tmp.mkdir(parents=True)
            with open(tmp / DATA, "wb") as f:
                for leaf in snap.leaves:
                    pad = -offset % ALIGN
                    if pad:
                        f.write(bytes(pad))
                        hasher.update(bytes(pad))
                        offset += pad
                    raw = leaf.raw()
                    f.write(raw.data)
                    self.copies += 1
                    hasher.update(raw.data)
                    index.append(entry(leaf, offset))
                    offset += raw.nbytes
            body = json.dumps({"skeleton": snap.skeleton, "leaves": index}).encode()
            header = self._header(rank, step, body, offset, hasher.hexdigest())
            self.slots.sizes[rank] = offset
            return self._commit(tmp, rank, step, header, body)
        except OSError as exc:
            return self._failed(tmp, f"could not write rank {rank}'s part of step {step}", exc)

    def _write_slot(self, snap: Snapshot, slot: Slot, rank: int, step: int) -> bool:
        """The background half of a snapshot taken into ``slot``: what did not fit written
        after the rest, the file hashed through its mapping, index and header written, the slot
        renamed to the part's name."""
        try:
            offsets, size, copies = fill(slot, snap.leaves, snap.used)
            self.copies += copies
            index = [entry(leaf, offset) for leaf, offset in zip(snap.leaves, offsets)]
            body = json.dumps({"skeleton": snap.skeleton, "leaves": index}).encode()
            header = self._header(rank, step, body, size, hash_file(slot, size))
            self.slots.sizes[rank] = size
            self._commit(slot.path, rank, step, header, body)
            self.slots.parts[self.name(rank, step)] = slot
            return True
        except OSError as exc:
            what = f"could not write rank {rank}'s part of step {step}"
            return self._failed(slot.path, what, exc)

    def write_part(self, part: Part) -> bool:
        """Keep ``part`` (another node's, received as a replica) as it came; False (after a
        warning) when it is malformed or the memory tier cannot take it."""
        try:
            head = parse_header(part.header)
            rank, step, generation = head["rank"], head["step"], head["generation"]
        except MemoryPartError as exc:
            warnings.warn(f"memory tier: a received part is unusable: {exc}", stacklevel=2)
            return False
        slot = self.slots.received(rank, part.data)  # None: written below
        tmp = self._tmp(rank, step) if slot is None else slot.path
        try:
            if slot is None:
                tmp.mkdir(parents=True)
                with open(tmp / DATA, "wb") as f:
                    f.write(raw(part.data).data)
            self._commit(tmp, rank, step, part.header, part.index, generation)
        except OSError as exc:
            return self._failed(tmp, f"could not keep the replica of rank {rank}, step {step}", exc)
        if slot is not None:
            self.slots.parts[self.name(rank, step, generation)] = slot
        return True

    def receiver(self, rank: int, nbytes: int) -> torch.Tensor | None:
        """Node memory to receive the data of ``rank``'s part (``nbytes``) into: a slot sized
        to it, whose file :meth:`write_part` then makes the part's; None when there is no room
        (the part is then received into host memory and written)."""
        return self.slots.receiver(rank, nbytes)

    def unused_receivers(self) -> None:
        """Slots handed out by :meth:`receiver` that no part was kept in become spares."""
        self.slots.unused_receivers()

    def _tmp(self, rank: int, step: int) -> Path:
        return self.parts / f".tmp-{self.name(rank, step)}-{os.getpid()}"

    def _header(self, rank: int, step: int, body: bytes, size: int, digest: str) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "job": self.job,
                "generation": self.generation,
                "world_size": self.world_size,
                "layout": self.layout,
                "rank": rank,
                "step": step,
                "files": {
                    INDEX: {"size": len(body), "hash": chunk_hash(body)},
                    DATA: {"size": size, "hash": digest},
                },
            }
        ).encode()

    def _commit(
        self,
        tmp: Path,
        rank: int,
        step: int,
        header: bytes,
        body: bytes,
        generation: int | None = None,
    ) -> bool:
        (tmp / INDEX).write_bytes(body)
        (tmp / HEADER).write_bytes(header)
        final = self.parts / self.name(rank, step, generation)
        if final.exists():  # the same step of the same generation, written again
            self.slots.parts.pop(final.name, None)
            shutil.rmtree(final)
        os.rename(tmp, final)
        return True

    def _failed(self, tmp: Path, what: str, exc: OSError) -> bool:
        shutil.rmtree(tmp, ignore_errors=True)
        message = (
            f"memory tier: {what} in {self.directory}: {exc}. Recovery falls back to the "
            "persistent store for this step; give the memory directory more room "
            "(memory_dir, or a bigger /dev/shm) or turn the memory tier off."
        )
        self.failures += 1
        if self.failures == 1:  # not once a step: the first, then every 100th, then logs
            warnings.warn(message + " (later failures: logged)", stacklevel=3)
        elif self.failures % 100 == 0:
            warnings.warn(f"{message} ({self.failures} failures so far)", stacklevel=3)
        else:
            log.warning(message)
        return False

    # ------------------------------------------------------------------ reading

    def inventory(self) -> list[Held]:
        """The complete parts held here, of any job, generation or world size (headers only)."""
        held = []
        for path in self._listing():
            try:
                head = parse_header((path / HEADER).read_bytes())
            except (OSError, MemoryPartError):
                continue  # torn or foreign: not a part
            fields = ("rank", "step", "generation", "job", "world_size", "layout")
            held.append(Held(*(head[k] for k in fields)))
        return held

    def load(self, rank: int, step: int, generation: int) -> Any:
        """``rank``'s part of ``step`` as the state it was written from, every byte checked.

        Raises:
            MemoryPartError: the part is missing, not this job's, or its bytes changed.
        """
        path = self.parts / self.name(rank, step, generation)
        try:
            head = self._check_header((path / HEADER).read_bytes())
            index = (path / INDEX).read_bytes()
            check(INDEX, index, head)
            size = int(head["files"][DATA]["size"])
            with open(path / DATA, "rb", buffering=0) as f:  # straight into each tensor
                if os.fstat(f.fileno()).st_size != size:
                    raise MemoryPartError(f"{path / DATA} is not {size} bytes long")
                body = read_index(index, path / INDEX)
                buffers, made = plan(body["leaves"], size, path / INDEX, len(index))
                try:
                    digest = read_hashed(f.fileno(), buffers)
                except EOFError as exc:
                    raise MemoryPartError(f"{path / DATA} is shorter than its index says") from exc
            if digest != head["files"][DATA]["hash"]:
                raise changed(DATA, head)
        except OSError as exc:
            raise MemoryPartError(f"cannot read {path}: {exc}") from exc
        return assemble(body, made, allow_pickle=self.allow_pickle)

    def part(self, rank: int, step: int, generation: int) -> Part:
        """The files of ``rank``'s part of ``step`` (the data viewed, not copied).

        Raises:
            MemoryPartError: the part is missing or unreadable.
        """
        path = self.parts / self.name(rank, step, generation)
        try:
            header = (path / HEADER).read_bytes()
            index = (path / INDEX).read_bytes()
            with open(path / DATA, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    data = torch.empty(0, dtype=torch.uint8)
                else:
                    view = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
                    data = torch.frombuffer(view, dtype=torch.uint8)
        except OSError as exc:
            raise MemoryPartError(f"cannot read {path}: {exc}") from exc
        return Part(header, index, data)

    def restore(self, part: Part) -> Any:
        """The state a part holds, after checking its header and hashes.

        Raises:
            MemoryPartError: of another job or world size, or its bytes do not match.
        """
        head = self._check_header(part.header)
        check(INDEX, part.index, head)
        where = "a received part's index"
        body = read_index(part.index, where)
        data = raw(part.data)
        if data.nbytes != (head["files"].get(DATA) or {}).get("size"):
            raise changed(DATA, head)
        # copied into the tensors on several threads, hashed on the way (as a read from memory)
        buffers, made = plan(body["leaves"], data.nbytes, where, len(part.index))
        if copy_hashed(data, buffers) != head["files"][DATA].get("hash"):
            raise changed(DATA, head)
        return assemble(body, made, allow_pickle=self.allow_pickle)

    def _check_header(self, raw: bytes) -> dict[str, Any]:
        head = parse_header(raw)
        if head["job"] != self.job or head["world_size"] != self.world_size:
            raise MemoryPartError(
                f"part of job {head['job']!r} on {head['world_size']} ranks, not of this job"
            )
        if head["layout"] != self.layout:
            raise MemoryPartError(f"part of layout {head['layout']}, not {self.layout}")
        return head

    # ------------------------------------------------------------------ retention

    def prune(
        self, ranks: Iterable[int], keep: Collection[tuple[int, int]], *, recycle: bool = True
    ) -> None:
        """Delete this job's parts of ``ranks`` but those of the ``(step, generation)`` pairs
        in ``keep`` (and torn leftovers of this process); another job's parts in the same
        directory stay. A part this process wrote into a slot becomes its rank's spare slot
        instead (``recycle``; one per rank), renamed out of sight before anything in it
        changes."""
        ranks = set(ranks)
        for path in self._listing(every=True):
            match = NAME.match(path.name)
            if match is None:
                if path.name.endswith(f"-{os.getpid()}") and not self.slots.is_spare(path):
                    shutil.rmtree(path, ignore_errors=True)
                continue
            step, generation, rank = (int(g) for g in match.groups())
            gone = rank in ranks and (step, generation) not in keep and self._ours(path)
            if gone and not (recycle and self.slots.recycle(path, rank)):
                self.slots.parts.pop(path.name, None)
                shutil.rmtree(path, ignore_errors=True)

    def release(self) -> None:
        """Delete this process's spare slots: nothing of it stays in the node's memory but its
        parts; the job's directory goes too once nothing is left in it (a finished run leaves
        nothing behind)."""
        self.slots.release()
        try:
            self.parts.rmdir()  # only when empty: another rank's parts or a part being written stay
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                log.warning("memory tier: %s could not be removed: %s", self.parts, exc)

    def _ours(self, path: Path) -> bool:
        try:
            return bool(parse_header((path / HEADER).read_bytes())["job"] == self.job)
        except (OSError, MemoryPartError):
            return False

    def _listing(self, every: bool = False) -> list[Path]:
        try:
            entries = list(self.parts.iterdir())
        except OSError:
            return []
        return [p for p in entries if every or NAME.match(p.name)]

