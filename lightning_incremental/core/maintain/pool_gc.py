"""The pool's collection: delete the objects of a shared pool that no member needs.

A member's own ``gc`` never deletes an object of its pool (:mod:`..storage.linked`); this does,
from one process, with no lease (two collections at once remove the same objects at most).

1. Fix the time by the pool's clock (:func:`.sweep.plan_clock`), before anything is listed.
2. Mark: list the members, and for each every manifest file (visible, superseded by a
   compaction, or written by a fenced-off generation: all of them, since what a member still
   shows is its own fencing's business) and every pin; read each once. A member whose location
   cannot be listed, has no store, or holds an unreadable manifest or pin stops the collection
   before anything is deleted: its live set is unknown, and a failed listing is never an empty
   one.
3. Mark again while a pass found a manifest that vanished before it was read: it was removed
   by the member's retention after a newer commit, which names every object it still needs,
   and that newer one is read then. A manifest committed after a member was listed needs no
   other pass: it names objects its save wrote (written again when they existed, so younger
   than the minimum age) and objects of its parent, which was read, vanished (another pass) or
   is newer still (the same again); a member whose retention removes its delta base writes a
   full one next. Members that keep committing do not keep the collection from finishing.
4. Sweep the pool (:func:`.sweep.sweep`): an object no manifest or pin names goes, unless it
   was younger than the minimum object age at step 1 — the largest of the argument and every
   member's recorded ``min_object_age_s`` — by its modification time read just before the
   delete (a save that writes an existing object again makes it young).

Cost: one listing per member per pass (one pass, unless manifests vanish meanwhile), one read
per manifest and pin, one listing of the pool and a few requests per unreferenced object:
linear in members, manifests and objects.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from lightning_incremental.core.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
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
from lightning_incremental.core.maintain.sweep import plan_clock, sweep
from lightning_incremental.core.storage import Storage

log = logging.getLogger("lightning_incremental")

MAX_PASSES = 8  # mark passes before giving up on manifests that vanish faster than they are read


class PoolMemberError(CheckpointError):
    """A member of the pool cannot be read: the pool's collection deleted nothing."""


@dataclass
class PoolGcReport:
    """What the pool's collection removed (or would, with ``dry_run``)."""

    members: list[str]
    live_objects: int
    removed_objects: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = False


class _Marker:
    def __init__(self, pool: Storage, options: dict[str, dict[str, Any]]) -> None:
        self.pool, self.options = pool, options
        self.live: set[str] = set()
        self.read: dict[str, set[str]] = {}  # member URL -> manifests and pins read
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
    """Delete the objects of the pool at ``pool`` that no member's manifest or pin names and
    that are older than the minimum object age (see the module docstring).

    Args:
        min_age_s: never remove an object younger than this (nor than any member's own
            ``min_object_age_s``); lower it only when no member is saving.
        grace_s: keep unreferenced objects younger than this as well.
        storage_options: for the pool's URL. member_options: per member URL.

    Raises:
        PoolMemberError: a member cannot be listed or read (nothing is deleted).
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
    removed, freed = sweep(
        storage, marker.live, grace_s, dry_run, planned_at=planned_at, min_age_s=age
    )
    report = PoolGcReport(sorted(marker.read), len(marker.live), removed, freed, dry_run)
    log.info(
        "pool gc of %s: %d members, %d live objects, removed %d objects (%d bytes)",
        storage.url,
        len(report.members),
        report.live_objects,
        len(removed),
        freed,
    )
    return report
