"""Shared object pools and forks: where a store's data objects live, recorded in the store.

A store opened with ``pool=URL`` writes its data objects (content-addressed, create-only) to
the pool and keeps its manifests, leases and fences at its own URL. A fork
(:func:`fork`) starts as a copy of one manifest of another store and reads the objects that
manifest names where they are, without copying them. Either way the store records it in
``links.json`` at its own URL (create-only), so it reopens as ``CheckpointStore(url)``:

    {"format": "lightning-incremental-links", "pool": URL or null,
     "sources": [URL, ...], "forked_from": {"url": URL, "step": N} or null}

``sources`` are the locations, in order, whose ``packs/`` hold objects its manifests may name
besides its own (or its pool's). A pool records its members in ``members/<id>.json`` (the
member's URL and minimum object age): the pool's collection (:mod:`.pool_gc`) reads every
member's manifests and pins from there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core.commit.fencing import Fencing
from lightning_incremental.core.commit.history import FORK_BASE, History, read_manifest
from lightning_incremental.core.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
)
from lightning_incremental.core.format import canonical
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.pins import (
    PIN_DIR,
    new_pin,
    parse_pin,
    pin_path,
    read_pins,
)
from lightning_incremental.core.storage import LocalStorage, Storage, open_storage
from lightning_incremental.core.storage.linked import LinkedStorage, trash_path

LINKS = "links.json"
POOL_MARKER = "pool.json"
MEMBER_DIR = "members"
_LINKS_FORMAT = "lightning-incremental-links"
_POOL_FORMAT = "lightning-incremental-pool"

Url = str | os.PathLike[str]


@dataclass(frozen=True)
class Links:
    pool: str | None
    sources: tuple[str, ...]
    forked_from: dict[str, Any] | None = None

    def to_bytes(self) -> bytes:
        doc = {
            "format": _LINKS_FORMAT,
            "pool": self.pool,
            "sources": list(self.sources),
            "forked_from": self.forked_from,
        }
        return json.dumps(doc, sort_keys=True).encode()


def read_links(own: Storage) -> Links | None:
    """The store's links record; None when it has none (a plain store).

    Raises:
        CorruptCheckpointError: the record is malformed.
    """
    try:
        data = own.get(LINKS)
    except FileNotFoundError:
        return None
    try:
        doc = mf.loads_record(data)
        if not isinstance(doc, dict) or doc.get("format") != _LINKS_FORMAT:
            raise ValueError("not a links record")
        pool, sources = doc.get("pool"), doc.get("sources", [])
        if pool is not None and not isinstance(pool, str):
            raise ValueError("pool is not a URL")
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise ValueError("sources is not a list of URLs")
        return Links(pool, tuple(sources), doc.get("forked_from"))
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"{own.url}/{LINKS} is unreadable ({exc}): where this store's objects live is "
            "unknown; restore the file"
        ) from exc


def open_location(url: str, options: dict[str, Any] | None, fsync: bool = True) -> Storage:
    """The storage at ``url``; ``options`` apply to URLs, not local paths."""
    storage = open_storage(url, options if "://" in str(url) else None)
    if isinstance(storage, LocalStorage):
        storage.fsync = fsync
    return storage


def member_path(url: str) -> str:
    return f"{MEMBER_DIR}/{hashlib.sha256(url.encode()).hexdigest()[:32]}.json"


def check_pool(pool: Storage) -> None:
    """Refuse a checkpoint store's location as a pool: its gc would delete the members' objects.

    Raises:
        ConfigError: ``pool`` holds a store.
    """
    if pool.exists(mf.MARKER) or pool.exists(LINKS):
        raise ConfigError(
            f"{pool.url} is a checkpoint store, not a shared object pool (its gc would delete "
            "the objects of the pool's members); give the pool a location of its own"
        )


def join_pool(pool: Storage, member_url: str, min_age_s: float) -> None:
    """Record ``member_url`` as a member of ``pool``, with the largest minimum object age it
    was opened with (one read when it is recorded already with at least this age)."""
    path = member_path(member_url)
    record = {"url": member_url, "min_object_age_s": min_age_s}
    try:
        known = mf.loads_record(pool.get(path))
    except FileNotFoundError:
        pool.put(POOL_MARKER, json.dumps({"format": _POOL_FORMAT, "layout": 1}).encode())
        pool.put(path, json.dumps(record, sort_keys=True).encode())
        return
    except ValueError:
        known = {}
    age = known.get("min_object_age_s") if isinstance(known, dict) else None
    if not isinstance(age, (int, float)) or age < min_age_s:
        pool.put(path, json.dumps(record, sort_keys=True).encode(), overwrite=True)


def members(pool: Storage) -> list[dict[str, Any]]:
    """The member records of ``pool`` (one listing, one read each).

    Raises:
        OSError: the listing or a read failed. CorruptCheckpointError: a malformed record.
    """
    found = []
    for path in pool.list(MEMBER_DIR):
        try:
            doc = mf.loads_record(pool.get(path))
        except FileNotFoundError:
            continue
        except ValueError as exc:
            raise CorruptCheckpointError(f"member record {path} of {pool.url}: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("url"), str):
            raise CorruptCheckpointError(f"member record {path} of {pool.url} is malformed")
        found.append(doc)
    return found


def attach(
    own: Storage,
    pool: Url | None,
    *,
    pool_options: dict[str, Any] | None,
    options: dict[str, Any] | None,
    fsync: bool,
    min_age_s: float,
    by_url: dict[str, dict[str, Any]] | None = None,
) -> Storage:
    """The storage a store at ``own`` works through: ``own`` itself for a plain store, else a
    :class:`LinkedStorage` over its pool and sources (read from its links record; with
    ``pool`` given and no record yet, the store joins that pool now). The pool is opened with
    ``pool_options``, each source with ``options``, unless ``by_url`` names its URL.

    Raises:
        ConfigError: ``pool`` differs from the pool the store was created in; a store with
            checkpoints of its own asked to join a pool.
    """
    links = read_links(own)
    if links is None and own.exists(POOL_MARKER):
        # Its objects are other stores' checkpoints: a store's gc here would delete them all.
        raise ConfigError(
            f"{own.url} is a shared object pool, not a checkpoint store: open one of its "
            "members (`lightning-incremental ls` of the pool lists them); its objects are "
            "collected by `lightning-incremental pool-gc` alone"
        )
    pool_url = None if pool is None else open_location(os.fspath(pool), pool_options).url
    if pool_url is not None and links is None:
        if pool_url == own.url:
            raise ConfigError(
                f"{own.url} cannot be its own pool: give the pool a location of its own"
            )
        check_pool(open_location(pool_url, pool_options))
        if own.list(mf.MANIFEST_DIR):
            raise ConfigError(
                f"{own.url} already holds checkpoints with their objects; it cannot join the "
                f"pool {pool_url}. Fork it into a new store in the pool instead: "
                f"CheckpointStore.fork(src, dst, pool={pool_url!r})"
            )
        links = Links(pool_url, ())
        own.put(LINKS, links.to_bytes())
        links = read_links(own)  # another process may have created it first
        assert links is not None
        own.put(mf.MARKER, mf.marker_bytes())
    if links is None:
        return own
    if pool_url is not None and links.pool != pool_url:
        raise ConfigError(
            f"{own.url} keeps its objects in {links.pool or 'its own location'}, not in the pool "
            f"{pool_url}; open it without pool= (its links record says where its objects are)"
        )
    objects = None
    if links.pool is not None:
        chosen = (by_url or {}).get(links.pool, pool_options or options)
        objects = open_location(links.pool, chosen, fsync)
        join_pool(objects, own.url, min_age_s)
    sources = [open_location(url, (by_url or {}).get(url, options), fsync) for url in links.sources]
    return LinkedStorage(own, objects, sources)


def object_locations(storage: Storage) -> list[str]:
    """The URLs whose ``packs/`` hold objects the store at ``storage`` may name, in read
    order."""
    if not isinstance(storage, LinkedStorage):
        return [storage.url]
    return [storage.objects.url, *(s.url for s in storage.sources)]


def _history(storage: Storage) -> History:
    return History(storage, Fencing(storage, functools.partial(read_manifest, storage)))


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
    objects are checked to exist, then ``dst`` records its links and gets a copy of the step's
    manifest. ``dst`` joins ``pool`` (default: the source's pool, if it is in one).

    Raises:
        ConfigError: ``dst`` already holds a store; ``src`` is already forked into ``dst``.
        CheckpointNotFoundError: no such step in ``src``, or its objects vanished (retention
            removed it while the fork was made: nothing is left pinned then).
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
    # The exact version read: one a compaction replaced may be gone, its objects swept by a gc
    # that read the pins before this one was written (it re-reads them after deleting it).
    if (
        chosen not in history.visible()
        or not source.exists(mf.manifest_path(chosen, version))
        or any(not source.exists(p) for p in doc.packs)
    ):
        source.delete(pin)
        raise CheckpointNotFoundError(
            f"step {chosen} of {source.url} was removed while it was being forked; fork a "
            "step its retention keeps"
        )
    pool_url = os.fspath(pool) if pool is not None else None
    if pool_url is None and isinstance(source, LinkedStorage) and source.objects is not source.own:
        pool_url = source.objects.url
    if pool_url is not None:
        pool_url = open_location(pool_url, pool_storage_options).url
        if pool_url == target.url:
            raise ConfigError(f"{target.url} cannot be its own pool")
        check_pool(open_location(pool_url, pool_storage_options))
    reads = [u for u in object_locations(source) if u not in (pool_url, target.url)]
    origin: dict[str, Any] = {"url": source.url, "step": chosen}
    if as_base:
        origin["as_base"] = True
    target.put(LINKS, Links(pool_url, tuple(dict.fromkeys(reads)), origin).to_bytes())
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

    Refused while a manifest of the fork still names an object that only ``src`` (or the
    stores it reads from) holds, unless ``force``: the source's gc could then delete it.

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
    base = target_own.exists(FORK_BASE)
    if base and not force and not target_own.list(mf.MANIFEST_DIR):
        raise ConfigError(
            f"{target_own.url} holds no checkpoint yet: its next save is encoded against the "
            f"step of {source.url} it was forked from ({FORK_BASE}); unpin it after its first "
            "checkpoint, or pass force=True (its next save is then a full one)"
        )
    if not force and read_links(target_own) is not None:
        target = attach(
            target_own,
            None,
            pool_options=None,
            options=storage_options,
            fsync=True,
            min_age_s=0.0,
        )
        assert isinstance(target, LinkedStorage)
        owned = (target.own, target.objects)
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
            # an object in the pool's trash is the pool's: its collection restores it
            if any(not any(o.exists(p) or o.exists(trash_path(p)) for o in owned) for p in paths):
                raise ConfigError(
                    f"{target.url} ({what}) still names objects held in {source.url}; "
                    "delete those checkpoints of the fork (or compact it and gc it with "
                    "keep_last=1) first, or pass force=True to drop the pin anyway"
                )
    if base:  # no save builds on it any more: the newest step of the fork (or nothing)
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
