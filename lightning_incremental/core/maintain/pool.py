"""Shared object pools and forks: making a fork, removing its pin, and a deleted member leaving
its pool. Where a store's objects live, and how it opens them, is :mod:`.links` (its names are
also importable from here).

A fork (:func:`fork`) starts as a copy of one manifest of another store and reads the objects
that manifest names where they are, without copying them — except those in another pool, which
it copies into its own (:mod:`.fork_objects`). A pin in the source (:mod:`.pins`) keeps the
step's objects there for the fork; :func:`unpin` removes it once the fork no longer needs them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

from lightning_incremental.core.commit.fencing import Fencing
from lightning_incremental.core.commit.history import (
    FORK_BASE,
    History,
    read_fork_base,
    read_manifest,
)
from lightning_incremental.core.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.fork_objects import copy_foreign
from lightning_incremental.core.maintain.links import (
    LINKS,
    MEMBER_DIR,
    POOL_MARKER,
    Links,
    Url,
    attach,
    check_pool,
    join_pool,
    member_path,
    members,
    object_locations,
    open_location,
    read_links,
)
from lightning_incremental.core.maintain.pins import (
    PIN_DIR,
    new_pin,
    parse_pin,
    pin_path,
    read_pins,
)
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.storage.linked import LinkedStorage, trash_path

__all__ = [
    "LINKS",
    "MEMBER_DIR",
    "POOL_MARKER",
    "Links",
    "Url",
    "attach",
    "check_pool",
    "fork",
    "join_pool",
    "leave",
    "member_path",
    "members",
    "object_locations",
    "open_location",
    "read_links",
    "unpin",
]


def _history(storage: Storage) -> History:
    return History(storage, Fencing(storage, functools.partial(read_manifest, storage)))


def _fork_pool(
    source: Storage, pool: Url | None, options: dict[str, Any] | None, target: str
) -> str | None:
    """The URL of the pool a fork of ``source`` at ``target`` joins: ``pool``, else the
    source's (None for a source in no pool).

    Raises:
        ConfigError: the pool is the fork's own location, or a store's.
    """
    url = os.fspath(pool) if pool is not None else None
    if url is None and isinstance(source, LinkedStorage) and source.objects is not source.own:
        url = source.objects.url
    if url is None:
        return None
    url = open_location(url, options).url
    if url == target:
        raise ConfigError(f"{target} cannot be its own pool")
    check_pool(open_location(url, options))
    return url


def fork(
    src: Url,
    dst: Url,
    step: int | None = None,
    *,
    pool: Url | None = None,
    storage_options: dict[str, Any] | None = None,
    src_storage_options: dict[str, Any] | None = None,
    pool_storage_options: dict[str, Any] | None = None,
    min_age_s: float = 900.0,
    as_base: bool = False,
) -> int:
    """Make a new store at ``dst`` whose step ``step`` (default: the newest) is that of
    ``src``, referencing ``src``'s objects instead of copying them; returns the step.

    With ``as_base`` the step is not a step of ``dst``: ``dst`` holds no checkpoint, and its
    first save is encoded against that step (:data:`~..commit.history.FORK_BASE`), so what did
    not change is referenced, what changed is a delta, and the new run numbers its steps from
    wherever it starts (a run that takes only the weights and starts again at step 0).

    The source step is pinned first (a pin record in the source, :mod:`.pins`), then the pinned
    objects are checked to exist; those that lie in a pool other than ``dst``'s are copied into
    ``dst``'s pool (:mod:`.fork_objects`: that pool's collection would forget the fork once the
    source left it); then ``dst`` records its links and gets a copy of the step's manifest.
    ``dst`` joins ``pool`` (default: the source's pool, if it is in one).

    Raises:
        ConfigError: ``dst`` already holds a store; ``src`` is already forked into ``dst``.
        CheckpointNotFoundError: no such step in ``src``, or its objects vanished (retention
            removed it while the fork was made).
        CorruptCheckpointError: an object to copy is damaged.

    Whatever fails before ``dst``'s links are written leaves nothing pinned and ``dst`` empty.
    """
    source = attach(
        open_location(os.fspath(src), src_storage_options),
        None,
        pool_options=pool_storage_options,
        options=src_storage_options,
        fsync=True,
        min_age_s=min_age_s,
    )
    target = open_location(os.fspath(dst), storage_options)
    if read_links(target) is not None or target.list(mf.MANIFEST_DIR):
        raise ConfigError(f"{target.url} already holds a store; fork into a new location")
    history = _history(source)
    chosen = history.resolve(step)
    version = history.version(chosen)
    data = source.get(mf.manifest_path(chosen, version))
    doc = canonical.loads(data, f"step {chosen} of {source.url}")
    pin = pin_path(target.url)
    if not source.put(pin, new_pin(chosen, target.url, list(doc.packs)).to_bytes()):
        raise ConfigError(
            f"{source.url} is already forked into {target.url} (pin {pin}); remove the pin "
            "with unpin() once that fork is gone, or fork into a new location"
        )
    pinned = [source]
    try:  # until the fork's links are written, a failure leaves nothing pinned
        # The exact version read: one a compaction replaced may be gone, its objects swept by a
        # gc that read the pins before this one was written (it re-reads them after deleting it).
        if (
            chosen not in history.visible()
            or not source.exists(mf.manifest_path(chosen, version))
            or any(not source.exists(p) for p in doc.packs)
        ):
            raise CheckpointNotFoundError(
                f"step {chosen} of {source.url} was removed while it was being forked; fork a "
                "step its retention keeps"
            )
        pool_url = _fork_pool(source, pool, pool_storage_options, target.url)
        readers = source.readers() if isinstance(source, LinkedStorage) else (source,)
        pooled = [r.exists(POOL_MARKER) for r in readers]
        # Objects in another pool are copied into the fork's (see fork_objects): that pool's
        # collection forgets the fork once the source leaves it. (A store in no pool reads from
        # none: a fork of a pool member joins a pool.)
        foreign = [p and pool_url not in (None, r.url) for r, p in zip(readers, pooled)]
        if pool_url is not None and any(foreign):
            into = open_location(pool_url, pool_storage_options)
            where = f"step {chosen} of {source.url}"
            copy_foreign(source, readers, foreign, into, doc.packs, where)
        kept = [
            (r, p)
            for r, p, f in zip(readers, pooled, foreign)
            if not f and r.url not in (pool_url, target.url)
        ]
        # The fork's own pin in every other store it reads from (those the source was forked
        # from): it holds there whatever becomes of the source and of the source's pins.
        for store, is_pool in kept:
            if not is_pool and store.url != source.url:
                pinned.append(store)
                via = new_pin(chosen, target.url, list(doc.packs), via=source.url)
                store.put(pin, via.to_bytes(), overwrite=True)
    except BaseException:
        for store in pinned:
            store.delete(pin)
        raise
    origin: dict[str, Any] = {"url": source.url, "step": chosen}
    if as_base:
        origin["as_base"] = True
    urls = tuple(dict.fromkeys(r.url for r, _ in kept))
    target.put(LINKS, Links(pool_url, urls, origin).to_bytes())
    if pool_url is not None:
        join_pool(open_location(pool_url, pool_storage_options), target.url, min_age_s)
    target.put(mf.MARKER, mf.marker_bytes())
    target.put(FORK_BASE if as_base else mf.manifest_path(chosen), data)
    return chosen


def unpin(
    src: Url,
    dst: Url,
    *,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
    src_storage_options: dict[str, Any] | None = None,
) -> None:
    """Remove the pin the fork at ``dst`` holds in ``src``.

    Refused while a manifest of the fork (or the pin of a fork of the fork) still names an
    object that only ``src`` (or the stores it reads from) holds, unless ``force``: the source's
    gc could then delete it. A fork of weights only keeps its fork base when the fork's own pool
    or location holds everything it names (that pool's collection keeps it); otherwise the base
    goes with the pin, and the pin stays while the fork holds no checkpoint yet (unless
    ``force``: its next save is then a full one).

    Raises:
        CheckpointNotFoundError: no such pin. ConfigError: the fork still needs the objects.
    """
    source = open_location(os.fspath(src), src_storage_options)
    target_own = open_location(os.fspath(dst), storage_options)
    path = pin_path(target_own.url)
    try:
        parse_pin(source.get(path), f"{path} of {source.url}")
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{source.url} holds no pin for {target_own.url}") from exc
    target: Storage = target_own
    owned: tuple[Storage, ...] = ()
    if read_links(target_own) is not None:
        target = attach(
            target_own, None, pool_options=None, options=storage_options, fsync=True, min_age_s=0
        )
        assert isinstance(target, LinkedStorage)
        owned = (target.own, target.objects)

    def held(paths: Iterable[str]) -> bool:
        # an object in the pool's trash is the pool's: its collection restores it
        return all(any(o.exists(p) or o.exists(trash_path(p)) for o in owned) for p in paths)

    base = target_own.exists(FORK_BASE)
    try:
        fork_base = read_fork_base(target_own) if base else None
    except CorruptCheckpointError:
        if not force:
            raise
        fork_base = None
    keep_base = fork_base is not None and held(fork_base.packs)
    if base and not keep_base and not force and not target_own.list(mf.MANIFEST_DIR):
        raise ConfigError(
            f"{target_own.url} holds no checkpoint yet: its next save is encoded against the "
            f"step of {source.url} it was forked from ({FORK_BASE}); unpin it after its first "
            "checkpoint, or pass force=True (its next save is then a full one)"
        )
    if not force and owned:
        named: list[tuple[str, list[str]]] = [
            (f"the pin of its fork {p.by}", list(p.packs)) for p in read_pins(target_own)
        ]
        for name in target.list(mf.MANIFEST_DIR):
            if mf.manifest_name(name.rsplit("/", 1)[-1]) is None:
                continue
            try:
                doc = canonical.loads(target.get(name), f"{name} of {target.url}")
            except FileNotFoundError:
                continue
            named.append((name, list(doc.packs)))
        for what, paths in named:  # forks of the fork reference what it references
            if not held(paths):
                raise ConfigError(
                    f"{target.url} ({what}) still names objects held in {source.url}; "
                    "delete those checkpoints of the fork (or compact it and gc it with "
                    "keep_last=1) first, or pass force=True to drop the pin anyway"
                )
    if base and not keep_base:  # no save may build on it any more: its objects may go
        target_own.delete(FORK_BASE)
    source.delete(path)


def leave(
    pool: Url,
    member: Url,
    *,
    storage_options: dict[str, Any] | None = None,
    member_options: dict[str, Any] | None = None,
) -> None:
    """Remove ``member``'s record from ``pool`` (a member deleted for good, so that the
    pool's collection can run again). Only a member whose location was removed may leave: a
    store there, even one without a checkpoint yet, may be open and about to commit one that
    names the pool's objects.

    Raises:
        ConfigError: the member's location still holds a store (its marker or its links),
            checkpoints or pins.
        OSError: the member's location cannot be read.
    """
    where = open_location(os.fspath(pool), storage_options)
    own = open_location(os.fspath(member), member_options)
    held = [name for name in (mf.MARKER, LINKS) if own.exists(name)]
    held += [f"{name}/" for name in (mf.MANIFEST_DIR, PIN_DIR) if own.list(name)]
    if held:
        raise ConfigError(
            f"{own.url} still holds checkpoints or a store ({', '.join(held)}) that may "
            f"reference objects of the pool {where.url}; only a member whose location was "
            "deleted may leave: delete the store's location first"
        )
    where.delete(member_path(own.url))
