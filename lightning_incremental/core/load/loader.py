"""Load with fallback: restore a checkpoint, or the newest one that verifies.

Restore-side only: it reads and reports what it found (damage to the history, which step it
returned and whether whole); what the save side makes of a restore is the store's decision
(:meth:`~lightning_incremental.core.chunks.delta_base.DeltaBase.adopt`).
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core.commit.history import History
from lightning_incremental.core.commit.versions import Version
from lightning_incremental.core.config import StoreConfig
from lightning_incremental.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    PickleNotAllowedError,
)
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.format.tree import unflatten
from lightning_incremental.core.load.materialise import MapLocation, materialise
from lightning_incremental.core.load.pipeline import restore_arrays
from lightning_incremental.core.load.restore import finish_inplace, plan, prune
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")

# With ``step=None``: how many checkpoints may vanish under one load (deleted while being read,
# each time the newest committed one is tried again) before it gives up.
VANISH_LIMIT = 8


@dataclass(frozen=True)
class Selection:
    """What a ``load`` restores: top-level ``keys`` (None: all), ``into`` the caller's tensors."""

    keys: tuple[str, ...] | None = None
    into: Any = None
    strict: bool = True


@dataclass(frozen=True)
class Loaded:
    """A restored state, the checkpoint it came from, and whether all of it was restored (every
    chunk verified)."""

    state: dict[str, Any]
    manifest: Manifest
    whole: bool

    @property
    def step(self) -> int:
        return self.manifest.step


class Loader:
    """Restores checkpoints of one store."""

    def __init__(
        self, storage: Storage, config: StoreConfig, pool: Executor, history: History
    ) -> None:
        self.storage, self.config, self.pool, self.history = storage, config, pool, history

    def load(
        self, step: int | None, map_location: MapLocation, selection: Selection, strict: bool
    ) -> Loaded:
        """Checkpoint ``step``, or with None the newest that restores, falling back past corrupt
        ones with a warning (unless ``strict``). Corrupt ones are quarantined in the history.

        A checkpoint deleted while being read (retention of the writing job, in another process)
        is not corrupt: with None the committed steps are listed again and the newest is tried,
        at most ``VANISH_LIMIT`` times. Nor is one whose manifest was replaced while being read
        (compacted in another process, then the objects of the old version collected): it is
        read again, as it is now.

        Raises:
            CorruptCheckpointError: the step (or with None, every one) is corrupt.
            CheckpointNotFoundError: the step was deleted while being read; with None, one
                checkpoint after another was, ``VANISH_LIMIT`` times.
        """
        if step is not None:
            step = self.history.resolve(step)
            for attempt in range(VANISH_LIMIT):
                version = self.history.version(step)
                try:
                    return self.load_step(step, map_location, selection)
                except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                    now = self.history.visible()
                    if step not in now:
                        raise CheckpointNotFoundError(
                            f"checkpoint step {step} in {self.storage.url} was deleted while "
                            f"being read (retention of the job writing it?): {exc}. Load a "
                            "newer step, or keep more checkpoints (a larger keep_last)"
                        ) from exc
                    if now[step] != version and attempt + 1 < VANISH_LIMIT:
                        self._replaced(step)
                        continue
                    if isinstance(exc, CorruptCheckpointError):
                        self.history.saw_damage(step)  # a new history may replace it
                    raise
        newest = self.history.resolve(None)
        candidates = [s for s in reversed(self.history.steps()) if s <= newest]
        problems: list[str] = []
        corrupt: set[int] = set()
        vanished: list[int] = []
        while candidates:
            candidate = candidates.pop(0)
            version = self.history.version(candidate)
            try:
                loaded = self.load_step(candidate, map_location, selection)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                if self.vanished(candidate, version):
                    vanished.append(candidate)
                    log.info(
                        "checkpoint step %d in %s was deleted or compacted while being read; "
                        "trying the newest committed one",
                        candidate,
                        self.storage.url,
                    )
                    if len(vanished) >= VANISH_LIMIT:
                        raise CheckpointNotFoundError(
                            f"checkpoints in {self.storage.url} keep being deleted while being "
                            f"read: steps {vanished} were, one after another. The job writing "
                            "them removes old ones faster than a load takes; keep more "
                            "(a larger keep_last) or load from a copy"
                        ) from exc
                    candidates = [s for s in reversed(self.history.steps()) if s not in corrupt]
                    continue
                if not isinstance(exc, CorruptCheckpointError):
                    raise
                corrupt.add(candidate)
                self.history.saw_damage(candidate)
                if strict:
                    raise
                problems.append(str(exc))
                message = f"checkpoint step {candidate} in {self.storage.url} is unusable: {exc}"
                log.warning(message)
                warnings.warn(message + " — falling back to an older checkpoint", stacklevel=3)
                continue
            if problems:
                log.warning(
                    "restored step %d after skipping %d corrupt checkpoint(s)",
                    candidate,
                    len(problems),
                )
            return loaded
        if not problems:
            raise CheckpointNotFoundError(
                f"no committed checkpoint left in {self.storage.url}: steps {vanished} were "
                "deleted while being read"
            )
        gone = f" (steps {vanished} were deleted while being read)" if vanished else ""
        raise CorruptCheckpointError(
            f"no intact checkpoint in {self.storage.url}; every committed one is corrupt{gone}:"
            "\n  " + "\n  ".join(problems)
        )

    def vanished(self, step: int, version: Version) -> bool:
        """Whether ``step`` is no longer committed as ``version`` (the version read): deleted
        (retention removes the manifest before the objects), fenced off, or replaced by a
        compaction. What then failed to read is not corruption."""
        now = self.history.visible()
        return step not in now or now[step] != version

    def _replaced(self, step: int) -> None:
        log.info(
            "checkpoint step %d in %s was compacted while being read; reading it again",
            step,
            self.storage.url,
        )

    def load_step(
        self, step: int, map_location: MapLocation, selection: Selection = Selection()
    ) -> Loaded:
        """Restore checkpoint ``step`` (no fallback).

        Raises:
            CorruptCheckpointError: a bad manifest or object. PickleNotAllowedError: pickles
                without ``allow_pickle``. ConfigError: see ``CheckpointStore.load``.
        """
        return self.restore(
            self.history.read(step), f"step {step} of {self.storage.url}", map_location, selection
        )

    def restore(
        self, doc: Manifest, where: str, map_location: MapLocation, selection: Selection
    ) -> Loaded:
        """Restore what manifest ``doc`` (described as ``where``) names; see :meth:`load_step`."""
        skeleton, wanted = prune(doc.tree, selection.keys, where)
        if doc.pickled and not self.config.allow_pickle:
            raise PickleNotAllowedError(
                f"checkpoint {where} holds pickled objects at {', '.join(doc.pickled[:5])}; "
                "loading them executes code — open the store with allow_pickle=True only if "
                "you trust this checkpoint"
            )
        destinations, targets = plan(doc, wanted, selection.into, where, strict=selection.strict)
        # No copy of the state is kept for the next save: it reads its XOR bases from storage
        # (StoreConfig.xor_base_from_storage), so a restore needs no memory beyond the state.
        restore_arrays(self.storage, doc, self.pool, where, targets)
        finish_inplace(destinations)
        values = [
            holder if mine or holder is None else materialise(holder, entry, map_location)
            for holder, mine, entry in zip(destinations.holders, destinations.inplace, doc.tensors)
        ]
        try:
            state = unflatten(skeleton, values, allow_pickle=self.config.allow_pickle)
        except PickleNotAllowedError as exc:
            raise PickleNotAllowedError(f"checkpoint {where}: {exc}") from exc
        except ManifestError as exc:
            raise ManifestError(f"manifest {where}: {exc}") from exc
        if not isinstance(state, dict):
            raise ManifestError(f"manifest {where}: the state is not a dict")
        lossy = doc.lossy_tensors
        if lossy:
            log.warning(
                "checkpoint %s restores %d tensor(s) encoded lossily (not bit-exact): %s",
                where,
                len(lossy),
                ", ".join(lossy[:5]),
            )
        return Loaded(state, doc, whole=wanted is None)
