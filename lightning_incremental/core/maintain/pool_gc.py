"""The pool's collection: remove the objects of a shared pool that no member needs.

A member's own ``gc`` never deletes an object of its pool (:mod:`..storage.linked`); this does,
one collection of a pool at a time: it holds the pool's collection lease (see the last point).

1. Fix the time by the pool's clock (:func:`.sweep.plan_clock`), before anything is listed.
2. Mark: list the members, and for each every manifest file (visible, superseded by a
   compaction, or written by a fenced-off generation: all of them, since what a member still
   shows is its own fencing's business), every pin, and its fork base (``fork-base.json``: a
   fork of weights only builds its first save on it, and loads its weights from it); read each
   once. A member whose location cannot be listed, has no store, or holds an unreadable
   manifest, pin or fork base stops the collection before anything is moved or purged: its
   live set is unknown, and a failed listing is never an empty one.
3. Mark again while a pass found a manifest that vanished before it was read: it was removed
   by the member's retention after a newer commit, which names every object it still needs,
   and that newer one is read then. A manifest committed after a member was listed needs no
   other pass: it names objects its save wrote (written again when they existed, so younger
   than the minimum age) and objects of its parent, which was read, vanished (another pass) or
   is newer still (the same again); a member whose retention removes its delta base writes a
   full one next. Members that keep committing do not keep the collection from finishing.
4. Tidy the trash (``trash/``, one listing, failing before anything is done): an entry a
   manifest or pin marked in step 2 goes back to ``packs/`` (written create-only: when
   ``packs/`` holds it again, the trash's copy is just dropped); an entry that entered the
   trash at least the minimum age before step 1's time is purged, for good.
5. Sweep ``packs/`` (:func:`.sweep.sweep`): an object no manifest or pin names, and that was
   older than the minimum object age at step 1 — the largest of the argument and every
   member's recorded ``min_object_age_s`` — by its modification time read just before it is
   moved, is *moved* to the trash: renamed where the backend can (a local directory), else
   copied there, then deleted from ``packs/``. After the move a small marker
   (``trash/packs/...pack.moved``, written over any older one) records, by its modification
   time, when the object entered the trash.

Why a committed step never loses an object. The system assumes that a save commits within the
minimum age of writing its objects (data first, manifest last). Take an object ``X`` that a
collection ``C1`` moves, and a member's save that names it in a manifest committed at ``c``.

- If the save wrote ``X`` (at ``w``, so ``c < w + min_age``) after the move finished, ``packs/``
  holds it again (a create-only write of a missing object creates it). If it wrote ``X``
  before ``C1`` read ``X``'s age, either ``X`` was young then (kept), or ``w`` was at least
  ``min_age`` before ``C1``'s time, so the commit came before ``C1`` listed the member and ``C1``
  marked ``X`` (kept). Otherwise ``w`` falls between
  that read and the end of the move — the window this design closes: the rename moves the
  save's bytes into the trash, or the copy holds the same bytes (content addressing) that the
  delete then removes. Either way the trash holds ``X`` from the end of the move on.
- The trash's copy goes only when a later collection ``C2`` purges it, and ``C2`` purges only an
  entry whose marker is at least ``min_age`` older than ``C2``'s time ``P2``. The marker is
  written after the move ended, so ``w < marker <= P2 - min_age``, hence ``c < w + min_age <=
  P2``: the commit came before ``C2`` fixed its time, so before ``C2`` listed that member, and
  ``C2`` read the manifest (or the newer commit that replaced it, by step 3's argument, which
  names ``X`` when it still needs it) and marked ``X``: ``C2`` restores it instead.
- A save that names ``X`` only because its parent did is covered by the parent's own case,
  and readers find ``X`` meanwhile in the trash (:class:`..storage.linked.LinkedStorage` looks
  there when ``packs/`` lacks an object), so the step loads, and verifies, from the moment it
  is committed.

Crashes. A collection that stops between the copy and the delete leaves both copies: the next
collection leaves a trash entry without a marker alone while ``packs/`` holds the object
(sweeping ``packs/`` moves it over the entry later, when it is unreferenced and old). One that
stops between the move and the marker leaves an entry without a marker and no ``packs/`` copy:
the next collection writes the marker then (a time after the move), or restores the entry
when it is named. A restore writes ``packs/`` before it drops the trash's copy. No step of this
deletes the last copy of a named object, and a collection stopped at any point loses nothing;
an entry left behind only waits for a later collection.

A collection may pause anywhere, for any time: only saves are bound by the minimum age (a purge
judges markers against the collection's own time, fixed before it marks). Two collections must
not overlap: one paused between reading a trash entry's marker and purging it while another
moves a re-written object over that entry would purge the new bytes. So a collection (not a dry
run) first takes the pool's lease (``lease/`` in the pool: the writer lease of
:mod:`..commit.lease`, with its heartbeat thread), and a second one is refused
(:class:`PoolGcBusyError`, naming the holder) while the holder's heartbeat is fresh and its
process lives. It checks it still holds the lease before it moves, purges or restores anything,
again every few objects and every second (the sweep's guard), and stops at once when another
collection took the lease over (the holder froze for longer than ``POOL_LEASE_TTL_S``): the
overlap left is the one object in flight when the holder froze — the same bound as a store's
own gc under its writer lease. Two collections in one process share no lease: the second is
refused by a process-wide lock.

Cost: the lease (a record written, a heartbeat every ``POOL_LEASE_TTL_S / 4`` seconds, a listing and
a read per check), one listing per member per pass (one pass, unless manifests vanish meanwhile),
one read per manifest and pin, one listing of the pool's objects and one of its trash, and a few
requests per unreferenced object or trash entry (a rename and a marker write per move on a local
disk; a read, a write, a delete and a marker write on object stores, which cannot rename): linear in
members, manifests and objects. Space is freed when an entry is purged, by the first collection at
least the minimum age after the one that moved it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lightning_incremental.core.commit.history import FORK_BASE, read_fork_base
from lightning_incremental.core.commit.lease import Lease, lease_path, newest
from lightning_incremental.core.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    WriterLeaseError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.pins import read_pins
from lightning_incremental.core.maintain.pool import (
    POOL_MARKER,
    Url,
    check_pool,
    members,
    open_location,
)
from lightning_incremental.core.maintain.pool_trash import MOVED as MOVED  # re-exported
from lightning_incremental.core.maintain.pool_trash import Trash as _Trash
from lightning_incremental.core.maintain.sweep import (
    GUARD_EVERY,
    GUARD_EVERY_S,
    plan_clock,
    sweep,
)
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")

MAX_PASSES = 8  # mark passes before giving up on manifests that vanish faster than they are read
# The pool's collection lease: a collection whose heartbeat is older than this (its process
# froze or is cut off) may be taken over by another; the holder renews it 4 times as often.
POOL_LEASE_TTL_S = 60.0


class PoolMemberError(CheckpointError):
    """A member of the pool cannot be read: the pool's collection deleted nothing."""


class PoolGcBusyError(WriterLeaseError):
    """Another collection of the pool is running (or this one lost the pool's lease to another
    and stopped): run one collection of a pool at a time."""


_RUNNING: set[str] = set()  # pools this process is collecting now
_RUNNING_LOCK = threading.Lock()


@contextmanager
def _collection_lease(pool: Storage) -> Iterator[Callable[[], None]]:
    """Hold the pool's collection lease for the ``with`` block; yields the guard that raises
    :class:`PoolGcBusyError` once the lease was lost."""
    with _RUNNING_LOCK:
        if pool.url in _RUNNING:
            raise PoolGcBusyError(
                f"pool gc of {pool.url} deleted nothing: this process is collecting that pool "
                "already; run one collection of a pool at a time"
            )
        _RUNNING.add(pool.url)
    lease = Lease(pool, POOL_LEASE_TTL_S)
    try:
        try:
            lease.acquire(0)
        except WriterLeaseError as exc:
            holder = newest(pool)
            who = holder.describe() if holder is not None else "a process"
            path = lease_path(holder.sequence) if holder is not None else "lease/"
            raise PoolGcBusyError(
                f"pool gc of {pool.url} deleted nothing: another collection of the pool is "
                f"running ({who}); run one at a time. If that process is gone, its lease "
                f"expires {POOL_LEASE_TTL_S:.0f}s after its last heartbeat (or delete {path} "
                "of the pool once you are sure)"
            ) from exc

        checked = {"at": -GUARD_EVERY_S, "calls": 0}

        def guard() -> None:  # a listing and a read: every GUARD_EVERY calls or seconds
            checked["calls"] += 1
            now = time.monotonic()
            if checked["calls"] < GUARD_EVERY and now - checked["at"] < GUARD_EVERY_S:
                return
            checked["at"], checked["calls"] = now, 0
            try:
                lease.check()
            except WriterLeaseError as exc:
                raise PoolGcBusyError(
                    f"pool gc of {pool.url} stopped: {exc}. Another collection took the pool's "
                    "lease over (this one was frozen or cut off longer than "
                    f"{POOL_LEASE_TTL_S:.0f}s); what this one did is complete up to here"
                ) from exc

        yield guard
    finally:
        try:
            lease.release()
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(pool.url)


@contextmanager
def _no_lease() -> Iterator[Callable[[], None]]:  # a dry run deletes nothing
    yield lambda: None


@dataclass
class PoolGcReport:
    """What the pool's collection did (or would do, with ``dry_run``).

    ``removed_objects`` left ``packs/`` for the trash (``bytes_moved``); ``purged_objects`` left
    the trash for good (``bytes_freed``: the space freed); ``restored_objects`` went back from
    the trash to ``packs/`` (a manifest or pin names them).
    """

    members: list[str]
    live_objects: int
    removed_objects: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = False
    bytes_moved: int = 0
    purged_objects: list[str] = field(default_factory=list)
    restored_objects: list[str] = field(default_factory=list)


class _Marker:
    def __init__(self, pool: Storage, options: dict[str, dict[str, Any]]) -> None:
        self.pool, self.options = pool, options
        self.live: set[str] = set()
        self.read: dict[str, set[str]] = {}  # member URL -> manifests, pins, fork base read
        self.stores: dict[str, Storage] = {}
        self.min_ages: list[float] = []

    def member(self, url: str) -> Storage:
        if url not in self.stores:
            try:
                self.stores[url] = open_location(url, self.options.get(url))
            except CheckpointError as exc:
                raise self._refuse(url, exc) from exc
        return self.stores[url]

    def _refuse(self, url: str, exc: Exception) -> PoolMemberError:
        return PoolMemberError(
            f"pool gc of {self.pool.url} deleted nothing: member {url} cannot be read ({exc}); "
            "what it references is unknown. Make it readable (storage options per member "
            "URL), or if the member was deleted for good, remove its record with "
            f"`lightning-incremental pool-leave {self.pool.url} {url}`"
        )

    def one_pass(self) -> bool:
        """Read every manifest and pin not read yet; True when a listed manifest vanished
        before it was read (another pass reads what replaced it)."""
        vanished = False
        for record in members(self.pool):
            url = record["url"]
            age = record.get("min_object_age_s")
            if isinstance(age, (int, float)):
                self.min_ages.append(float(age))
            storage = self.member(url)
            done = self.read.setdefault(url, set())
            try:
                if not storage.exists(mf.MARKER):
                    raise FileNotFoundError(f"no {mf.MARKER}: no store there")
                names = [
                    p
                    for p in storage.list(mf.MANIFEST_DIR)
                    if mf.manifest_name(p.rsplit("/", 1)[-1]) is not None
                ]
                for path in names:
                    if path in done:
                        continue
                    done.add(path)
                    try:
                        data = storage.get(path)
                    except FileNotFoundError:
                        vanished = True  # removed after a newer commit: the next pass reads it
                        continue
                    self.live.update(canonical.loads(data, f"{path} of {url}").packs)
                pins = read_pins(storage)
                if FORK_BASE not in done:  # what a fork of weights only builds its first save on
                    done.add(FORK_BASE)
                    base = read_fork_base(storage)
                    self.live.update(base.packs if base is not None else ())
            except (OSError, CorruptCheckpointError) as exc:
                raise self._refuse(url, exc) from exc
            for pin in pins:
                key = f"pin:{pin.by}:{pin.step}"
                if key not in done:
                    done.add(key)
                    self.live.update(pin.packs)
        return vanished


def collect_pool(
    pool: Url,
    *,
    min_age_s: float = 900.0,
    grace_s: float = 0.0,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    member_options: dict[str, dict[str, Any]] | None = None,
) -> PoolGcReport:
    """Move the objects of the pool at ``pool`` that no member's manifest or pin names and
    that are older than the minimum object age to the pool's trash; purge the trash's entries
    that entered it at least that age ago and that nothing names, and put back those that
    something names (see the module docstring).

    Args:
        min_age_s: never remove an object younger than this (nor than any member's own
            ``min_object_age_s``); lower it only when no member is saving.
        grace_s: keep unreferenced objects younger than this as well.
        storage_options: for the pool's URL. member_options: per member URL.

    Raises:
        PoolGcBusyError: another collection of the pool holds its lease (nothing is moved or
            purged), or took it over while this one was frozen (this one stopped).
        PoolMemberError: a member cannot be listed or read (nothing is moved or purged).
        OSError: the pool or its trash cannot be listed (nothing is moved or purged).
        CheckpointError: manifests keep vanishing before a mark pass reads them.
    """
    if isinstance(min_age_s, bool) or not isinstance(min_age_s, (int, float)) or min_age_s < 0:
        raise ConfigError(f"min_age_s must be a number >= 0, got {min_age_s!r}")
    storage = open_location(os.fspath(pool), storage_options)
    check_pool(storage)  # a store's location: its objects are not the pool's to collect
    if not storage.exists(POOL_MARKER):
        raise ConfigError(
            f"{storage.url} is not a shared object pool (no {POOL_MARKER}); pool gc deleted nothing"
        )
    with _no_lease() if dry_run else _collection_lease(storage) as guard:
        marker = _Marker(storage, member_options or {})
        # The time before anything is listed: a member's save in flight writes its objects after.
        planned_at = plan_clock(storage, dry_run, max(grace_s, min_age_s, 1.0))
        for _ in range(MAX_PASSES):
            if not marker.one_pass():
                break
        else:
            raise CheckpointError(
                f"pool gc of {storage.url} deleted nothing: manifests it listed vanished before "
                f"it read them in each of {MAX_PASSES} passes; run it again when its members "
                "remove checkpoints less often"
            )
        age = max([min_age_s, *marker.min_ages])
        trash = _Trash(storage)
        trash.list()
        restored, purged, freed = trash.tidy(
            marker.live, planned_at, max(age, grace_s), dry_run, guard
        )
        moved, moved_bytes = sweep(
            storage,
            marker.live,
            grace_s,
            dry_run,
            planned_at=planned_at,
            min_age_s=age,
            guard=guard,
            remove=trash.move,
        )
    report = PoolGcReport(
        sorted(marker.read),
        len(marker.live),
        moved,
        freed,
        dry_run,
        bytes_moved=moved_bytes,
        purged_objects=purged,
        restored_objects=restored,
    )
    log.info(
        "pool gc of %s: %d members, %d live objects; moved %d objects (%d bytes) to the "
        "trash, purged %d (%d bytes), restored %d",
        storage.url,
        len(report.members),
        report.live_objects,
        len(moved),
        moved_bytes,
        len(purged),
        freed,
        len(restored),
    )
    return report
