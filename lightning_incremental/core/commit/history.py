"""The store's history as this process knows it: committed steps, the newest step saved, which
checkpoints are quarantined (found corrupt), and which objects are trusted (written or checked
since damage was last seen, so a save may reuse them by hash without reading them first)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_incremental.core.commit.fencing import Fencing
from lightning_incremental.core.commit.versions import Version, Versions, by_step
from lightning_incremental.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ManifestError,
    NotAStoreError,
    StepError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")


def read_manifest(storage: Storage, step: int, version: Version = None) -> Manifest:
    """The validated manifest of ``step``: the commit's own, or with ``version`` the full base
    a compaction by that generation rewrote it as.

    Raises:
        CheckpointNotFoundError: there is none. CorruptCheckpointError: it does not validate.
    """
    where = f"step {step} of {storage.url}"
    if version is not None:
        where = f"step {step} (compacted by generation {version}) of {storage.url}"
    try:
        data = storage.get(mf.manifest_path(step, version))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint {where} does not exist") from exc
    doc = canonical.loads(data, where)
    if doc.step != step:
        raise ManifestError(f"manifest {where} records step {doc.step}")
    if version is not None and doc.generation != version:
        raise ManifestError(f"manifest {where} records generation {doc.generation}")
    return doc


FORK_BASE = "fork-base.json"  # a fork's delta base that is no step of it (``fork(as_base=True)``)


def read_fork_base(storage: Storage) -> Manifest | None:
    """The manifest a fork made with ``as_base=True`` builds its first save on (a step of its
    source, not of this store); None when there is none.

    Raises:
        CorruptCheckpointError: it does not validate.
    """
    try:
        data = storage.get(FORK_BASE)
    except FileNotFoundError:
        return None
    return canonical.loads(data, f"the fork base {FORK_BASE} of {storage.url}")


def check_step_type(step: Any) -> None:
    """Raises StepError unless ``step`` is an int a manifest name can hold."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise StepError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise StepError(f"step must be >= 0, got {step}")
    if step > mf.MAX_STEP:
        raise StepError(
            f"step must be < 10**20 (manifest names hold 20 digits), got {step}; count steps "
            "from 0 (the global step, a sample count)"
        )


class History:
    """Steps and integrity knowledge of one store (thread-safe)."""

    def __init__(self, storage: Storage, fencing: Fencing) -> None:
        self.storage, self.fencing = storage, fencing
        self.lock = threading.RLock()
        self.last_step: int | None = None  # newest step saved or being saved
        self.committed: int | None = None  # newest step committed (and not known corrupt)
        self.quarantined: set[int] = set()
        self.trusted: set[str] = set()
        self._marker_written = False
        # The version that is each visible step's manifest, as the last listing found it.
        self._current: dict[int, Version] = {}

    # ------------------------------------------------------------------ steps

    def written(self) -> dict[int, Versions]:
        """Every manifest in storage, visible or not, by step."""
        return by_step(self.storage.list(mf.MANIFEST_DIR))

    def written_steps(self) -> list[int]:
        """Every step with a manifest in storage, visible or not, oldest first."""
        return list(self.written())

    def visible(self) -> dict[int, Version]:
        """Committed steps visible under the newest generation's fence, oldest first, each with
        the version that is its manifest."""
        return self.remember(self.fencing.partition(self.written())[0])

    def remember(self, visible: dict[int, Version]) -> dict[int, Version]:
        """``visible`` is what a listing found now: reads go to those versions."""
        with self.lock:
            self._current = dict(visible)
        return visible

    def steps(self) -> list[int]:
        """Committed steps visible under the newest generation's fence, oldest first."""
        return list(self.visible())

    def version(self, step: int) -> Version:
        """The version of ``step``'s manifest that is visible, as the newest listing found it
        (listing again when it found none)."""
        with self.lock:
            if step in self._current:
                return self._current[step]
        return self.visible().get(step)

    def read(self, step: int) -> Manifest:
        """The validated manifest of ``step`` (the visible version). A version removed since it
        was listed (superseded by a compaction in another process) is looked up again.

        Raises:
            CheckpointNotFoundError: there is none. CorruptCheckpointError: it does not validate.
        """
        return self.read_version(step)[1]

    def read_version(self, step: int) -> tuple[Version, Manifest]:
        """:meth:`read`, and which version it read."""
        version = self.version(step)
        try:
            return version, read_manifest(self.storage, step, version)
        except CheckpointNotFoundError:
            again = self.visible().get(step)
            if again == version:
                raise
            return again, read_manifest(self.storage, step, again)

    def resolve(self, step: int | None) -> int:
        """``step``, or the newest committed one when None; checked to be committed.

        Raises:
            CheckpointNotFoundError, NotAStoreError: see :meth:`raise_empty`; a missing step.
        """
        if step is not None:
            check_step_type(step)
        steps = self.steps()
        if not steps:
            self.raise_empty()
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at step {step} in {self.storage.url}; committed "
                f"steps: {_summary(steps)}"
            )
        return step

    def newest_readable(self, steps: list[int] | None = None) -> Manifest | None:
        """The newest committed manifest that reads; unreadable newer ones are quarantined."""
        for step in reversed(self.steps() if steps is None else steps):
            try:
                return self.read(step)
            except CheckpointError as exc:
                log.warning("not building on checkpoint step %d: %s", step, exc)
                with self.lock:
                    self.quarantined.add(step)
        return None

    def committed_last(self) -> int | None:
        steps = [s for s in self.steps() if s not in self.quarantined]
        return steps[-1] if steps else None

    def forget(self, step: int) -> None:
        """Committed ``step`` was deleted (no save pending): when it was the newest, the newest
        step saved and committed is again the newest that remains, so it may be saved again."""
        with self.lock:
            self._current.pop(step, None)
            if step not in (self.last_step, self.committed):
                return
            remaining = [s for s in self.steps() if s not in self.quarantined and s != step]
            newest = remaining[-1] if remaining else None
            if self.last_step == step:
                self.last_step = newest
            if self.committed == step:
                self.committed = newest

    def check_step(self, step: Any) -> None:
        """Raises StepError unless ``step`` may be saved next (newer than every step saved)."""
        check_step_type(step)
        last = self.last_step
        if last is not None and last in self.quarantined:
            last = self.committed_last()
        if last is not None and step <= last:
            raise StepError(
                f"step {step} is not newer than step {last}, already saved in "
                f"{self.storage.url}. Steps must increase: checkpoints are immutable. Resume from "
                "the newest checkpoint, or save to a new location to start a separate history."
            )

    def rewind(self, pending: list[int]) -> None:
        """A save did not commit: the newest step is again the newest committed or pending."""
        with self.lock:
            known = [s for s in (self.committed, *pending) if s is not None]
            self.last_step = max(known) if known else None

    # ------------------------------------------------------------------ integrity

    def trust(self, packs: Iterable[str]) -> None:
        with self.lock:
            self.trusted.update(packs)

    def untrusted(self, packs: Mapping[str, int]) -> dict[str, int]:
        with self.lock:
            return {p: size for p, size in packs.items() if p not in self.trusted}

    def saw_damage(self, step: int | None = None) -> None:
        """Corruption was found: stop trusting objects unread since (the next save reads back
        what it reuses), and let a new history replace ``step``."""
        with self.lock:
            self.trusted.clear()
            if step is not None:
                self.quarantined.add(step)

    def unquarantine(self, step: int) -> None:
        """Move corrupt checkpoints at or after ``step`` out of the way of the new history."""
        with self.lock:
            stale = sorted(s for s in self.quarantined if s >= step)
        written = self.written() if stale else {}
        for old in stale:
            # Every version: a compaction left in place would stand for the new commit.
            for source in written.get(old, Versions()).paths(old):
                try:
                    data = self.storage.get(source)
                except FileNotFoundError:
                    continue
                name = source.rsplit("/", 1)[-1]
                self.storage.put(f"{mf.QUARANTINE_DIR}/{name}", data, overwrite=True)
                self.storage.delete(source)
                log.warning("moved corrupt checkpoint step %d to %s/", old, mf.QUARANTINE_DIR)
            with self.lock:
                self.quarantined.discard(old)
                self._current.pop(old, None)

    # ------------------------------------------------------------------ the store itself

    def write_marker(self) -> None:
        if not self._marker_written:
            self.storage.put(mf.MARKER, mf.marker_bytes())
            self._marker_written = True

    def raise_empty(self) -> None:
        """Raise why there is no committed checkpoint.

        Raises:
            CheckpointNotFoundError: an empty store, or none at all. NotAStoreError: the
                location holds something else.
        """
        url = self.storage.url
        try:
            marker = self.storage.get(mf.MARKER)
        except FileNotFoundError:
            marker = None
        if marker is not None:
            mf.check_marker(marker, f"{url}/{mf.MARKER}")
            raise CheckpointNotFoundError(f"the store {url} holds no committed checkpoint yet")
        if self.storage.exists(""):
            raise NotAStoreError(
                f"{url} exists but is not a lightning-incremental checkpoint store (it has "
                f"no {mf.MARKER} and no manifests); pass the location checkpoints were saved to"
            )
        raise CheckpointNotFoundError(f"there is no checkpoint store at {url}")


def _summary(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"
