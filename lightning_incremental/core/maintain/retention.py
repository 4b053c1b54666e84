"""Retention: which checkpoints ``gc`` keeps, and removing the rest.

Rules, in order:

1. Keep the newest ``keep_last`` visible checkpoints (all when None), plus ``keep``, minus
   ``drop`` (what ``delete`` names).
2. Never leave the store without an intact checkpoint: when checkpoints are to be removed and no
   kept one is intact, the newest intact one is kept as well; when none is intact at all, no
   checkpoint is removed. Then the steps forks pinned (:mod:`.pins`) are kept too, minus
   ``drop`` (a pinned step does not stand in for the newest intact one). A pinned step's
   objects stay whatever becomes of it: a fork's checkpoints name them; the pins are read again
   right before the sweep, for a fork that pinned a step meanwhile.
   ``thorough`` checks read every object (``verify``); otherwise the store's knowledge is used
   (what it wrote or checked, what it found damaged).
3. Delete the manifests first, then every object that no kept manifest (nor the next save's
   parent, unless ``delete`` removes that parent with no save pending) names and that was older
   than the grace period and the minimum object age (``StoreConfig.min_object_age_s``, by the
   storage's clock) when the kept manifests were listed — ages are judged against that moment,
   however long the sweep then runs, so an object a checkpoint committed during the sweep names
   is never old enough. Objects or manifests that vanish while this runs (another process
   collecting the same store) are skipped, not errors.
   The writer (it holds the lease) also removes the versions of kept checkpoints that a visible
   compaction supersedes (:mod:`~lightning_incremental.core.commit.versions`); a ``gc`` without
   the lease keeps them, and every object they name.
4. Deletions are fenced like commits: a writer that lost its lease, or that a newer generation
   took over from, deletes nothing (checked before the first deletion and again during a long
   sweep); the minimum age spares what a save in flight may name when a check and a late
   delete race (:meth:`.fencing.Generation.check_current`).

:class:`Maintainer` runs ``gc``, ``delete`` and ``compact`` (which rewrites the newest
checkpoint as a full base, so the ones before it can be removed) under the store's locks and
writer lease.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from lightning_incremental.core.chunks.delta_base import DeltaBase, Parent
from lightning_incremental.core.chunks.packs import damaged_objects
from lightning_incremental.core.commit import rewrites
from lightning_incremental.core.commit.committer import Committer
from lightning_incremental.core.commit.fencing import Fencing, Generation, check_process
from lightning_incremental.core.commit.figures import save_result
from lightning_incremental.core.commit.history import History, check_step_type
from lightning_incremental.core.commit.lease import Lease
from lightning_incremental.core.commit.location import Location
from lightning_incremental.core.commit.versions import Version, Versions
from lightning_incremental.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.maintain.compact import rewrite_as_base
from lightning_incremental.core.maintain.pins import read_pins
from lightning_incremental.core.maintain.sweep import plan_clock, sweep
from lightning_incremental.core.maintain.verify import verify_manifest
from lightning_incremental.core.results import GcReport, SaveResult, VerifyReport
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")


@dataclass(frozen=True)
class Plan:
    keep_last: int | None
    keep: tuple[int, ...]
    drop: tuple[int, ...]
    grace_s: float
    dry_run: bool
    thorough: bool
    writer: bool = False  # run by the lease holder: superseded versions are removed too

    @classmethod
    def for_gc(
        cls, keep_last: int | None, keep: Iterable[int], grace_s: float, dry_run: bool
    ) -> Plan:
        """The plan of a ``gc`` call, its arguments checked.

        Raises:
            ConfigError: a bad argument. StepError: a bad step in ``keep``.
        """
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        kept = tuple(keep)
        for step in kept:
            check_step_type(step)
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
            raise ConfigError(f"grace_s must be a number >= 0, got {grace_s!r}")
        return cls(keep_last, kept, (), float(grace_s), dry_run, thorough=True)


def collect(
    plan: Plan,
    *,
    storage: Storage,
    written: Mapping[int, Versions],
    visible: Mapping[int, Version],
    fenced: list[int],
    read: Callable[[int], tuple[Version, Manifest]],
    intact: Callable[[int, Manifest, bool], bool],
    pinned: set[str],
    planned_at: float,
    min_age_s: float = 0.0,
    guard: Callable[[], None] | None = None,
    forget: Callable[[int], None] = lambda step: None,
    repin: Callable[[], set[str]] = set,
    pinned_steps: Iterable[int] = (),
) -> GcReport:
    """Apply ``plan`` to the store; see the module docstring. ``written`` is one listing of the
    manifests, split by the fence into ``visible`` steps (with their versions) and ``fenced``
    ones; ``planned_at`` the storage's time just before it was made; ``read`` reads the visible
    version of a step (looking it up again if it was superseded since); ``guard`` raises when
    this process may no longer delete; ``pinned_steps`` are kept whatever the plan keeps, but
    do not count as kept when deciding whether a kept checkpoint is intact; ``repin`` reads the
    pins' objects again right before the sweep (a fork that pinned a step after ``pinned`` was
    read, and checked after that its manifest was still there, holds a pin this finds).

    Raises:
        CorruptCheckpointError: a kept manifest cannot be read, so the objects it needs are
            unknown (nothing is deleted then).
        FencedError, WriterLeaseError: from ``guard`` (nothing deleted past it).
    """
    # One listing for both: a checkpoint committed while gc runs is in neither list, so it is
    # neither removed as fenced off nor counted against keep_last.
    steps = list(visible)
    newest = steps if plan.keep_last is None else steps[-plan.keep_last :]
    kept = (set(newest) | (set(plan.keep) & set(steps))) - set(plan.drop)
    docs: dict[int, tuple[Version, Manifest] | None] = {}

    def doc_of(step: int) -> tuple[Version, Manifest] | None:
        """The manifest, None when it vanished (another gc removed it); errors propagate."""
        if step not in docs:
            try:
                docs[step] = read(step)
            except CheckpointNotFoundError:
                docs[step] = None
        return docs[step]

    def restores(step: int) -> bool:
        try:
            found = doc_of(step)
        except CheckpointError:
            return False
        return found is not None and intact(step, found[1], plan.thorough)

    doomed = [s for s in steps if s not in kept]
    spared: list[int] = []
    if doomed and not plan.drop and not any(restores(s) for s in sorted(kept, reverse=True)):
        rescue = next((s for s in reversed(doomed) if restores(s)), None)
        if rescue is not None:
            spared = [rescue]
            log.warning(
                "gc keeps checkpoint step %d as well: no checkpoint it would keep is intact, "
                "and it is the newest one that is",
                rescue,
            )
        else:
            spared = doomed
            log.warning(
                "gc removes no checkpoint from %s: none is intact, so none is known to be "
                "worth less than another",
                storage.url,
            )
        kept |= set(spared)
        doomed = [s for s in doomed if s not in spared]
    # Pinned steps stay for their forks; they are no reason to drop the newest intact one.
    pins_kept = (set(pinned_steps) & set(steps)) - set(plan.drop) - kept
    kept |= pins_kept
    doomed = [s for s in doomed if s not in pins_kept]
    live = set(pinned)
    superseded: list[str] = []
    for step in sorted(kept):
        try:
            found = doc_of(step)
        except CheckpointError as exc:
            raise _unknown_live_set(step, exc) from exc
        if found is None:
            kept.discard(step)  # removed meanwhile by another process
            continue
        version, doc = found
        live.update(doc.packs)
        others = written.get(step, Versions()).superseded(step, version)
        if plan.writer:
            superseded += others
        else:  # not ours to remove: what they name stays
            live.update(_packs_of(storage, others, step))
    # Manifests a fenced-off generation wrote are invisible: they go too.
    report = GcReport(sorted(kept), sorted(doomed + fenced), [], 0, plan.dry_run)
    report.kept_intact = spared[0] if len(spared) == 1 else None
    if (doomed + fenced or superseded) and not plan.dry_run and guard is not None:
        guard()
    if not plan.dry_run:
        for step in doomed + fenced:
            for path in written.get(step, Versions(original=True)).paths(step):
                storage.delete(path)
            forget(step)
        for path in superseded:
            storage.delete(path)
        # Manifests this call or another process deleted may be what a fork pinned meanwhile.
        live |= repin()
    report.removed_objects, report.bytes_freed = sweep(
        storage,
        live,
        plan.grace_s,
        plan.dry_run,
        planned_at=planned_at,
        min_age_s=min_age_s,
        guard=guard,
    )
    if doomed:
        log.info(
            "gc removed steps %s and %d objects (%d bytes)",
            ", ".join(map(str, doomed[:8])) + (", ..." if len(doomed) > 8 else ""),
            len(report.removed_objects),
            report.bytes_freed,
        )
    return report


def _unknown_live_set(step: int, exc: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"gc stopped before deleting anything: kept checkpoint step {step} cannot be "
        f"read, so the objects it needs are unknown ({exc})"
    )


def _packs_of(storage: Storage, paths: list[str], step: int) -> set[str]:
    """The objects the manifests at ``paths`` (versions of ``step``) name; one removed
    meanwhile names none.

    Raises:
        CorruptCheckpointError: one cannot be read (what it needs is unknown).
    """
    packs: set[str] = set()
    for path in paths:
        try:
            data = storage.get(path)
            packs.update(canonical.loads(data, f"{path} of {storage.url}").packs)
        except FileNotFoundError:
            continue
        except CheckpointError as exc:
            raise _unknown_live_set(step, exc) from exc
    return packs


class Collector:
    """Runs retention plans on one store, with what the store knows: its history (what is
    trusted, what is quarantined) and the delta base (whose objects the next save needs)."""

    def __init__(
        self,
        storage: Storage,
        fencing: Fencing,
        history: History,
        base: DeltaBase,
        *,
        min_age_s: float = 0.0,
        guard: Callable[[], None] | None = None,
        location: Location | None = None,
    ) -> None:
        self.storage, self.fencing, self.history, self.base = storage, fencing, history, base
        self.min_age_s, self.guard = min_age_s, guard
        self.location = location if location is not None else Location()

    def run(self, plan: Plan) -> GcReport:
        """Apply ``plan`` (see :func:`collect`). The caller holds the store's write lock."""
        # The storage's time before the listing: what is younger than the grace period then
        # was possibly written for a checkpoint that is not committed yet.
        planned_at = plan_clock(self.storage, plan.dry_run, max(plan.grace_s, self.min_age_s))
        written = self.history.written()
        visible, fenced = self.fencing.partition(written)
        self.history.remember(visible)
        try:
            report = self._collect(plan, written, visible, fenced, planned_at)
        finally:
            if not plan.dry_run:
                self.location.swept()
        if not plan.dry_run and self.base.step in report.removed_steps:
            # Its objects are pinned by this call only: another process's gc may collect them at
            # any time, so the next save must not name them. It writes a full base.
            self.base.set(None)
        return report

    def _collect(
        self,
        plan: Plan,
        written: Mapping[int, Versions],
        visible: Mapping[int, Version],
        fenced: list[int],
        planned_at: float,
    ) -> GcReport:
        # Forks reference the pinned steps' objects (pins.py): kept whatever the plan says,
        # and their objects live even if the step's manifest goes.
        pins = read_pins(self.storage)
        return collect(
            plan,
            storage=self.storage,
            written=written,
            visible=visible,
            fenced=fenced,
            read=self.history.read_version,
            intact=self.intact,
            pinned=self.base.pinned().union(*(p.packs for p in pins)),
            planned_at=planned_at,
            min_age_s=self.min_age_s,
            guard=self.guard,
            forget=self.fencing.forget,
            repin=lambda: set().union(*(p.packs for p in read_pins(self.storage))),
            pinned_steps=[p.step for p in pins if p.via is None],  # via: objects only
        )

    def intact(self, step: int, doc: Manifest, thorough: bool) -> bool:
        """Whether checkpoint ``step`` restores. Thorough: read and check everything
        (``verify``). Otherwise: not known damaged, and every object it names was written or
        checked by this store (objects it does not know are read back whole and checked now)."""
        if thorough:
            report = verify_manifest(self.storage, doc, VerifyReport(step=step), f"step {step}")
            if not report.ok:
                self.history.saw_damage(step)
            return report.ok
        if step in self.history.quarantined:
            return False
        unknown = self.history.untrusted(doc.packs)
        if damaged_objects(self.storage, unknown):
            self.history.saw_damage(step)
            return False
        self.history.trust(unknown)
        return True


class KeepLast:
    """The retention policy run after each commit (never inside it): keep the newest
    ``keep_last`` checkpoints. The checkpoint is committed whatever happens here: a failure is a
    warning (also in the result's ``warnings``), never the save's error."""

    def __init__(self, keep_last: int | None, collector: Collector, lock: threading.RLock) -> None:
        self.keep_last, self.collector, self.lock = keep_last, collector, lock

    def after_commit(self, result: SaveResult) -> SaveResult:
        if self.keep_last is None:
            return result
        try:
            with self.lock:
                self.collector.run(Plan(self.keep_last, (), (), 0.0, False, False, writer=True))
        except Exception as exc:
            message = (
                f"retention after step {result.step} failed, nothing was deleted past the "
                f"failure and the checkpoint is committed: {type(exc).__name__}: {exc}"
            )
            warnings.warn(message, stacklevel=1)
            log.warning(message)
            return dataclasses.replace(result, warnings=(*result.warnings, message))
        return result


class Maintainer:
    """``gc``, ``delete`` and ``compact`` of one store. Each holds the store's write lock (a
    save never references what is being removed or rewritten) and the history's lock, and the
    writer lease where it may remove what a running save is about to reference. The caller has
    waited for its pending saves."""

    def __init__(
        self,
        committer: Committer,
        pool: Executor,
        collector: Collector,
        *,
        lease: Lease,
        history: History,
        base: DeltaBase,
        generation: Generation,
        lock: threading.RLock,
    ) -> None:
        self.committer, self.pool, self.collector = committer, pool, collector
        self.lease, self.history, self.base = lease, history, base
        self.generation, self.lock = generation, lock

    def admit(self) -> None:
        self.generation.admit(self.committer.fencing, self.lease, self.history)

    def gc(self, plan: Plan) -> GcReport:
        if not plan.dry_run:
            check_process("gc deleted nothing")
        with self.lock, self.history.lock:
            if plan.grace_s == 0 and not plan.dry_run:
                # Without a grace period gc may remove what a running save is about to
                # reference: only the writer may do that.
                self.admit()
                plan = dataclasses.replace(plan, writer=True)
            return self.collector.run(plan)

    def delete(self, step: int) -> GcReport:
        with self.lock, self.history.lock:
            target = self.history.resolve(step)
            self.admit()
            if target == self.base.step and self.history.last_step == self.history.committed:
                # Deleting the next save's delta base (the newest checkpoint, committed or
                # restored) with no save pending: nothing names its objects any more, so they
                # are not pinned; the next save writes a full base.
                self.base.set(None)
            report = self.collector.run(
                Plan(None, (), (target,), 0.0, False, thorough=False, writer=True)
            )
            self.history.forget(target)
            rewrites.ours(self.committer)
            return report

    def compact(self) -> SaveResult | None:
        """Rewrite the newest checkpoint as a full base (:func:`~.compact.rewrite_as_base`), and
        make it the next save's delta base; None when it already is one."""
        with self.lock, self.history.lock:
            step = self.history.resolve(None)
            self.admit()
            started = time.perf_counter()
            done = rewrite_as_base(
                self.committer,
                self.pool,
                step,
                self.generation.value,
                functools.partial(
                    self.generation.check_current,
                    self.committer.fencing,
                    self.lease,
                    f"compaction of step {step} removes nothing",
                ),
            )
            if done is None:
                return None
            committed, part, leaves, before = done
            rewrites.ours(self.committer)  # before this object's base is set: it is current
            if committed.manifest.sharded:  # the ranks' pieces: bases read from storage
                self.base.set(Parent(step, committed.manifest), [x.data for x in leaves])
            else:
                self.base.committed(committed.manifest, leaves, part.tensors)
            result = save_result(
                [part], committed, previous=before, snapshot_s=0.0, wait_s=0.0, total_s=0.0
            )
            return dataclasses.replace(result, total_s=time.perf_counter() - started)
