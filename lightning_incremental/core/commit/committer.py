"""Committing a checkpoint, in two phases.

1. :meth:`Committer.write_part` encodes tensors against the delta base and writes their objects;
   it returns a :class:`Part` once every object it names is durable. Nothing is visible yet.
2. :meth:`Committer.commit` assembles one manifest from the parts (:func:`assemble`), checks
   that every object the parts wrote is there, and writes the manifest create-only, fenced by
   generation: the checkpoint becomes visible at once, whole, or not at all.

A single process writes the one part of a checkpoint. In a distributed save each rank calls
``write_part`` for its own arrays (with its own delta base) and sends the :class:`Part` to the
coordinator, which calls ``commit`` with all of them and the merged tensor table
(:mod:`~lightning_incremental.core.commit.sharded`). A part that is never committed leaves
unreferenced objects only, which ``gc`` collects.
"""

from __future__ import annotations

import datetime
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from lightning_incremental.core.chunks.delta_base import DeltaBase, Parent
from lightning_incremental.core.chunks.encode import Encoded, encode
from lightning_incremental.core.chunks.hints import Hints
from lightning_incremental.core.chunks.pace import Pacer
from lightning_incremental.core.chunks.packs import damaged_objects
from lightning_incremental.core.commit.effort import Effort
from lightning_incremental.core.commit.fencing import Fencing
from lightning_incremental.core.commit.history import History
from lightning_incremental.core.commit.lease import Lease
from lightning_incremental.core.commit.location import Location
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FencedError,
    ManifestError,
    NotDurableError,
    StepError,
    StorageError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import ChunkRecipe, Manifest, TensorEntry
from lightning_incremental.core.format.tree import Leaf
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")


@dataclass(frozen=True)
class Part:
    """The durable objects of some of a checkpoint's tensors, and their manifest tables.

    Attributes:
        step: the checkpoint it belongs to.
        parent: the checkpoint its chunks were encoded against (None: none).
        since_base: the ``since_base`` the checkpoint gets (0: a full base).
        tensors, chunks, packs: its manifest tables (``packs``: path -> size).
        written: the packs this part wrote (the others it references were there already).
        encoded: the encoder's figures.
    """

    step: int
    parent: int | None
    since_base: int
    tensors: tuple[TensorEntry, ...]
    chunks: Mapping[str, ChunkRecipe]
    packs: Mapping[str, int]
    written: frozenset[str]
    encoded: Encoded = field(repr=False, compare=False)

    @property
    def full_base(self) -> bool:
        return self.since_base == 0


def assemble(
    step: int,
    parts: Sequence[Part],
    *,
    generation: int,
    chunk_size: int,
    audit: Mapping[str, Any],
    tree: Any,
    pickled: Sequence[str] = (),
    created: str | None = None,
    extra: Mapping[str, Any] | None = None,
    tensors: Sequence[TensorEntry] | None = None,
) -> Manifest:
    """The manifest of ``step`` made of ``parts`` (their tensors in order: the tree's tensor
    indices count across the parts; or ``tensors``, a table merged from the parts' arrays), with
    its statistics.

    Raises:
        ManifestError: no part, or parts of another step or built on different parents.
    """
    if not parts:
        raise ManifestError(f"step {step}: a checkpoint needs at least one part")
    first = parts[0]
    for part in parts:
        if part.step != step or (part.parent, part.since_base) != (first.parent, first.since_base):
            raise ManifestError(
                f"step {step}: part of step {part.step} built on {part.parent} does not belong "
                f"with parts of step {step} built on {first.parent}"
            )
    chunks: dict[str, ChunkRecipe] = {}
    packs: dict[str, int] = {}
    for part in parts:
        chunks.update(part.chunks)
        packs.update(part.packs)
    figures = [p.encoded for p in parts]
    return Manifest(
        step=step,
        parent=first.parent,
        generation=generation,
        since_base=first.since_base,
        chunk_size=chunk_size,
        created=created or datetime.datetime.now(datetime.timezone.utc).isoformat(),
        audit=audit,
        stats={
            "bytes_logical": sum(t.nbytes for p in parts for t in p.tensors),
            "bytes_data": sum(f.bytes_written for f in figures),
            "chunks_total": sum(f.chunks_total for f in figures),
            "chunks_reused": sum(f.chunks_reused for f in figures),
            "chunks_delta": sum(f.chunks_delta for f in figures),
            "chunks_full": sum(f.chunks_full for f in figures),
            "full_base": first.full_base,
        },
        pickled=tuple(pickled),
        tree=tree,
        tensors=tuple(t for p in parts for t in p.tensors) if tensors is None else tuple(tensors),
        chunks=chunks,
        packs=packs,
        extra=dict(extra or {}),
    )


@dataclass(frozen=True)
class Committed:
    """A written manifest: its record, its bytes, and warnings about the commit."""

    manifest: Manifest
    nbytes: int
    write_s: float
    warnings: tuple[str, ...] = ()


class Committer:
    """Writes parts and commits manifests for one store (see the module docstring)."""

    def __init__(
        self,
        storage: Storage,
        config: StoreConfig,
        pool: Executor,
        *,
        writer: Executor | None = None,
        fencing: Fencing,
        lease: Lease,
        history: History,
        base: DeltaBase,
        location: Location | None = None,
    ) -> None:
        self.storage, self.config, self.pool = storage, config, pool
        self.location = location if location is not None else Location()
        self._part_began: tuple[int, int] | None = None  # (step, sweeps here) of the last part
        self.writer = writer if writer is not None else pool
        self.fencing, self.lease, self.history, self.base = fencing, lease, history, base
        self.hints = Hints()  # how each place was coded last: the next save skips the race
        self.effort = Effort(config.codec_effort)  # when changed chunks are stored as they are
        # The encoders' and writers' rates (codec_effort="auto": see .pace). Not with one thread
        # for both (workers=1): a chunk's coding never overlaps a write there.
        self.pacer = (
            Pacer(getattr(pool, "max_workers", 1), getattr(self.writer, "max_workers", 1))
            if self.writer is not pool
            else None
        )

    # ------------------------------------------------------------------ phase 1

    def write_part(
        self,
        step: int,
        leaves: list[Leaf],
        *,
        parent: Parent | None = None,
        full: bool = False,
        durable: bool = True,
    ) -> Part:
        """Encode ``leaves`` against ``parent`` (default: the delta base) and write their objects;
        returns once every object the part names is durable (or known intact) — without
        ``durable``, once the objects it writes are handed to the writers: :meth:`commit` then
        prepares the manifest while they are written, and waits for them before writing it.

        Chunks are reused by hash from the parent only while their objects are known intact:
        an object this store neither wrote nor checked since it last saw damage is read back
        whole and checked first; the chunks of a damaged one are encoded again from the state.

        Raises:
            CorruptCheckpointError: objects to reuse keep vanishing (another process deleting).
        """
        self._part_began = (step, self.location.sweeps)
        explicit = parent is not None
        parent = parent if explicit else self.base.parent
        full = full or parent is None or parent.manifest.since_base + 1 >= self.config.base_every
        avoid: set[str] = set()
        reloaded = False
        fast = self.effort.fast()
        started = time.perf_counter()
        while True:
            enc = encode(
                leaves,
                parent,
                full_base=full,
                config=self.config,
                storage=self.storage,
                pool=self.pool,
                writer=self.writer,
                avoid=avoid,
                hints=self.hints,
                fast=fast,
                pacer=self.pacer if self.effort.paced() else None,  # auto, not fast
                durable=durable,
            )
            adopted = {p: enc.packs[p] for p in set(enc.packs) - enc.written}
            try:
                vanished = sorted(p for p in adopted if not self.storage.exists(p))
                if vanished and explicit:
                    raise CorruptCheckpointError(
                        f"step {step} not committed: objects it would reuse are missing from "
                        f"{self.storage.url} ({', '.join(vanished[:3])}): lost, or deleted by "
                        "another process (give a gc beside training a grace period, grace_s)"
                    )
                if vanished and reloaded:
                    # Still missing from what is committed now: lost (or still being deleted).
                    # Their chunks are encoded again from the state; each round avoids more
                    # objects, so this ends (at worst with nothing reused).
                    log.warning(
                        "step %d: objects it would reuse are missing (%s); encoding their chunks "
                        "again from the state being saved",
                        step,
                        ", ".join(vanished[:3]),
                    )
                    self.history.saw_damage()
                    avoid |= set(vanished)
                    _drop(enc)  # this attempt's writes end before the next
                    continue
                if vanished:
                    # Another process compacted and collected this store since our parent was
                    # read: build on what is committed now, as a full base, not on what is gone.
                    log.warning(
                        "objects of checkpoint step %s vanished (%s): another process ran gc or "
                        "compact on %s; writing step %d as a full base",
                        parent.step if parent else None,
                        ", ".join(vanished[:3]),
                        self.storage.url,
                        step,
                    )
                    parent = Parent.of(self.history.newest_readable())
                    self.base.set(parent)
                    full, avoid, reloaded = True, set(), True
                    _drop(enc)  # this attempt's writes end before the next
                    continue
                unknown = self.history.untrusted(adopted)
                damaged = damaged_objects(self.storage, unknown)
                if not damaged:
                    self.history.trust(unknown)
                    said = self.effort.observe(
                        fast=fast,
                        seconds=time.perf_counter() - started,
                        cpu_run_s=enc.cpu_run_s,
                        cpu_wait_s=enc.cpu_wait_s,
                    )
                    if said is not None:
                        log.info("store %s: %s", self.storage.url, said)
                    return Part(
                        step=step,
                        parent=parent.step if parent else None,
                        since_base=0 if full else parent.manifest.since_base + 1,  # type: ignore[union-attr]
                        tensors=tuple(enc.tensors),
                        chunks=enc.chunks,
                        packs=enc.packs,
                        written=frozenset(enc.written),
                        encoded=enc,
                    )
                log.warning(
                    "step %d: objects it would reuse are damaged (%s); encoding their chunks again "
                    "from the state being saved",
                    step,
                    ", ".join(sorted(damaged)[:3]),
                )
                self.history.saw_damage()
                avoid |= damaged
                _drop(enc)  # this attempt's writes end before the next
            except BaseException:
                _drop(enc, quiet=True)  # no write may outlive the save's buffers
                raise

    # ------------------------------------------------------------------ phase 2

    def commit(
        self,
        step: int,
        parts: Sequence[Part],
        *,
        generation: int,
        audit: Mapping[str, Any],
        tree: Any,
        pickled: Sequence[str] = (),
        tensors: Sequence[TensorEntry] | None = None,
    ) -> Committed:
        """Make ``step`` visible: one manifest naming every part, written create-only once every
        object the parts wrote is present, fenced by ``generation``. ``tensors``: the manifest's
        tensor table when the parts' arrays are not it (pieces of sharded tensors).

        Raises:
            ManifestError: parts that do not make one valid checkpoint.
            CorruptCheckpointError: an object a part wrote is missing or of the wrong size.
            FencedError: a newer generation fenced this writer off.
            StepError: another writer committed ``step`` already.
        """
        try:
            manifest = assemble(
                step,
                parts,
                generation=generation,
                chunk_size=self.config.chunk_size,
                audit=audit,
                tree=tree,
                pickled=pickled,
                tensors=tensors,
            )
            data, manifest = canonical.seal(manifest, f"step {step} of {self.storage.url}")
        except BaseException:
            _wait_written(parts, quiet=True)  # no write may outlive the save's buffers
            raise
        _wait_written(parts)  # the manifest is prepared while they were written
        with self.location.lock:  # no sweep of this process between the checks and the write
            return self._commit(step, parts, data, manifest, generation)

    def _commit(
        self, step: int, parts: Sequence[Part], data: bytes, manifest: Manifest, generation: int
    ) -> Committed:
        self._check_durable(step, parts)
        began = self._part_began
        if began is None or began != (step, self.location.sweeps):
            self._check_reused(step, parts)  # a sweep here since (or not known: check)
        start = time.perf_counter()
        self.fencing.check(step, generation, "not committed")  # before touching others'
        self.lease.check()
        self.history.unquarantine(step)
        manifest = self._put_manifest(step, data, manifest, generation)
        unconfirmed = self._confirm(step, generation)
        with self.history.lock:
            self.history.committed = step
            self.history.trust(manifest.packs)  # written now, or read back and checked
        return Committed(manifest, len(data), time.perf_counter() - start, unconfirmed)

    def _put_manifest(
        self, step: int, data: bytes, manifest: Manifest, generation: int
    ) -> Manifest:
        """Write the manifest create-only; returns the manifest that is committed at ``step``.

        A write can land although the client reports an error (the response was lost and the
        retries ran out), and a retried create-only write can find the object its own first
        attempt made: either way the manifest there is read back, and when it is these very
        bytes, or the same checkpoint (the same tensors and values: a retried save of the same
        state, whatever its time stamps and encoding), the step is committed and that manifest
        is the one returned.

        Raises:
            OSError: the write's own error when the manifest is not there (not committed).
            StorageError: whether it landed could not be read (the message says so).
            StepError: another checkpoint is committed at ``step``.
        """
        path = mf.manifest_path(step)
        try:
            if self.storage.put(path, data):
                return manifest
        except NotDurableError:
            raise  # it may lie there, but not durably: not committed (the storage removes it)
        except OSError as exc:
            if self._landed(step, path, exc) == data:
                log.warning(
                    "the manifest of step %d in %s landed although its write reported an "
                    "error (%s): the step is committed",
                    step,
                    self.storage.url,
                    exc,
                )
                return manifest
            raise  # what lies there is not this save's manifest (torn, or another writer's)
        existing = self._existing(path)
        if existing is not None and (existing == data or self._same(step, existing, manifest)):
            return canonical.loads(existing, f"step {step} of {self.storage.url}")
        self.fencing.check(step, generation, "not committed")  # a newer one holds it
        self.fencing.displace(step, self.history.visible)
        if not self.storage.put(path, data):
            raise StepError(
                f"step {step} is already committed in {self.storage.url} (another writer "
                "saved it); checkpoints are create-only — use a newer step"
            )
        return manifest

    def _landed(self, step: int, path: str, exc: OSError) -> bytes:
        """After a failed manifest write: its bytes if it landed anyway.

        Raises:
            OSError: ``exc`` itself when it did not land (not committed).
            StorageError: whether it landed cannot be read.
        """
        code = exc.errno or 0
        try:
            return self.storage.get(path)
        except FileNotFoundError:
            raise exc from None  # not committed: the storage's error says what failed
        except OSError as again:
            raise StorageError(
                code,
                f"step {step} may or may not be committed in {self.storage.url}: writing its "
                f"manifest failed ({exc}) and whether it landed could not be read ({again}); "
                "list the store's steps once the storage answers. Saving the same step with "
                "the same state again is safe: it finds the committed one",
            ) from exc

    def _existing(self, path: str) -> bytes | None:
        try:
            return self.storage.get(path)
        except FileNotFoundError:
            return None  # removed since (a displaced or quarantined manifest)

    def _same(self, step: int, existing: bytes, manifest: Manifest) -> bool:
        """Whether the manifest ``existing`` records the checkpoint ``manifest`` does: the same
        values (tree, tensors and their chunks' content hashes) built on the same parent, by
        the same generation."""
        try:
            other = canonical.loads(existing, f"step {step} of {self.storage.url}")
        except CheckpointError:
            return False
        return (other.tree, other.tensors, other.pickled, other.parent, other.generation) == (
            manifest.tree,
            manifest.tensors,
            manifest.pickled,
            manifest.parent,
            manifest.generation,
        )

    def _check_durable(self, step: int, parts: Sequence[Part]) -> None:
        for part in parts:
            for path in sorted(part.written):
                try:
                    size = self.storage.size(path)
                except FileNotFoundError:
                    size = None
                if size != part.packs[path]:
                    raise CorruptCheckpointError(
                        f"step {step} not committed: object {path} of a part is "
                        f"{'missing' if size is None else f'{size} bytes, not {part.packs[path]}'}"
                        f" in {self.storage.url}"
                    )

    def _check_reused(self, step: int, parts: Sequence[Part]) -> None:
        """A sweep ran in this process since the parts were written (a sharded save does not
        hold the lock from its part to its commit): every object they reuse must still be
        there."""
        for part in parts:
            for path in sorted(set(part.packs) - part.written):
                if not self.storage.exists(path):
                    raise CorruptCheckpointError(
                        f"step {step} not committed: object {path} it reuses was deleted by a "
                        "gc in this process while the ranks wrote their parts "
                        f"({self.storage.url}); the next save writes it again"
                    )

    def _confirm(self, step: int, generation: int) -> tuple[str, ...]:
        """A claim that landed between the check and the write makes the commit invisible (the
        fence decides on every read): tell the writer. If the check itself cannot be made, the
        step is committed all the same: that is a warning, not the save's error."""
        try:
            self.fencing.check(
                step, generation, "committed after it was fenced off, so it is not visible"
            )
        except FencedError:
            raise
        except Exception as exc:
            message = (
                f"step {step} is committed, but whether a newer generation fenced this writer "
                f"off meanwhile could not be checked: {type(exc).__name__}: {exc}"
            )
            warnings.warn(message, stacklevel=1)
            log.warning(message)
            return (message,)
        return ()


def _wait_written(parts: Sequence[Part], *, quiet: bool = False) -> None:
    for part in parts:
        _drop(part.encoded, quiet=quiet)


def _drop(enc: Encoded, *, quiet: bool = False) -> None:
    """Wait until the objects ``enc`` wrote with ``durable=False`` are durable, re-raising the
    first write error (``quiet``: none, another error is being raised)."""
    pending, enc.pending = enc.pending, None
    if pending is None:
        return
    try:
        pending()
    except BaseException:
        if not quiet:
            raise
