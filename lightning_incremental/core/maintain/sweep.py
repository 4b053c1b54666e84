"""The sweep of unreferenced objects: what no kept manifest names, old enough by the storage's own
clock, removed under the deletion guard (a process that lost its lease or was fenced stops).

Ages are read by the storage's clock (:func:`storage_clock`), not this host's: a grace period
means the same on every writer whatever their clocks say. They are judged against the moment the
live set was fixed (the plan's time, :func:`plan_clock`), not the moment the sweep reaches an
object: a sweep of hours over a large store never finds "old" an object a save wrote while it
ran, and an object written again since the plan (a pack re-created with the same bytes by a
save) is seen to be young by the time read just before it is deleted."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.verify import log
from lightning_incremental.core.storage import TMP_PREFIX, Storage

STALE_TMP_S = 3600.0  # temporary files younger than this may belong to a write in progress


# Where temporary files of interrupted writes can be left: beside the objects they were for.
CLOCK_DIR = "clock"  # markers of storage_clock: every one there is a temporary file

TMP_DIRS = (mf.PACK_DIR, mf.MANIFEST_DIR, mf.QUARANTINE_DIR, "fences", "lease", CLOCK_DIR)


def storage_clock(storage: Storage) -> Callable[[], float]:
    """Now by the storage's own clock: the modification time of a small object written now,
    advanced by this host's monotonic clock. An object's age is then the storage's time
    against the storage's time (S3's ``LastModified`` is the server's), whatever this host's
    clock says. A backend without modification times gives this host's clock."""
    path = f"{CLOCK_DIR}/{uuid.uuid4().hex}"
    storage.put(path, b"", overwrite=True)
    try:
        stamp = storage.mtime(path)
    finally:
        storage.delete(path)
    start = time.monotonic()
    base = time.time() if stamp is None else stamp
    return lambda: base + (time.monotonic() - start)


def plan_clock(storage: Storage, dry_run: bool, min_age_s: float) -> float:
    """The storage's time now, when a plan fixes its live set (this host's for a dry run, or
    when no age is asked for: no marker object is written then)."""
    if dry_run or min_age_s <= 0:
        return time.time()
    return storage_clock(storage)()


GUARD_EVERY = 64  # deletions between two checks that this process may still delete

GUARD_EVERY_S = 1.0  # ... or seconds


def sweep(
    storage: Storage,
    live: set[str],
    grace_s: float,
    dry_run: bool,
    *,
    planned_at: float,
    min_age_s: float = 0.0,
    guard: Callable[[], None] | None = None,
    remove: Callable[[str], None] | None = None,
) -> tuple[list[str], int]:
    """Delete every pack object not in ``live`` that was older than ``grace_s`` seconds (and
    never one younger than ``min_age_s``) at ``planned_at`` — the storage's time when ``live``
    was fixed (:func:`plan_clock`) — and stale temporary files; returns the paths removed (or
    that would be, with ``dry_run``) and bytes. An object that vanishes meanwhile (another
    process collecting) is skipped.

    An object's modification time is read just before it is deleted (after the guard), so
    one written again since the plan is kept.
    ``guard`` raises when this process may no longer delete (it lost the lease, a newer
    generation took over): it is called before the first deletion and again every
    ``GUARD_EVERY`` deletions or ``GUARD_EVERY_S`` seconds, so a sweep that outlives its
    writer (one request per object, on S3) stops within a batch.
    ``remove`` removes an unreferenced pack object (default: ``storage.delete``); the pool's
    collection moves it to the pool's trash instead (:mod:`.pool_gc`). Stale temporary files
    are deleted either way.
    """
    removed: list[str] = []
    freed = 0
    min_pack_age = max(grace_s, min_age_s)
    checked_at: float | None = None
    since_check = 0
    undated = 0  # objects whose age the backend cannot tell: never removed
    for directory in TMP_DIRS:
        for path in storage.list(directory):
            name = path.rsplit("/", 1)[-1]
            stale_tmp = name.startswith(TMP_PREFIX) or directory == CLOCK_DIR
            if directory != mf.PACK_DIR and not stale_tmp:
                continue
            if not stale_tmp and (path in live or not mf.is_pack_path(path)):
                continue
            min_age = max(min_pack_age, STALE_TMP_S) if stale_tmp else min_pack_age
            try:
                size = storage.size(path)
                if (
                    not dry_run
                    and guard is not None
                    and (
                        checked_at is None
                        or since_check >= GUARD_EVERY
                        or time.monotonic() - checked_at >= GUARD_EVERY_S
                    )
                ):
                    guard()
                    checked_at, since_check = time.monotonic(), 0
                if min_age > 0:
                    mtime = storage.mtime(path)
                    if mtime is None:
                        undated += 1
                        continue
                    if planned_at - mtime < min_age:
                        continue
                if not dry_run:
                    if remove is not None and not stale_tmp:
                        remove(path)
                    else:
                        storage.delete(path)
                    since_check += 1
            except FileNotFoundError:
                continue  # gone already
            removed.append(path)
            freed += size
    if undated:
        log.warning(
            "%s gives no modification times: %d unreferenced object(s) were kept, their age "
            "unknown (a minimum age or grace period needs one); with min_object_age_s=0 and no "
            "grace period, and no other process writing to the store, gc removes them",
            storage.url,
            undated,
        )
    return removed, freed
