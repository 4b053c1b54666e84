"""Where a store's data objects live, recorded in the store: its links record, the pool it is
a member of, and the storage it works through.

A store opened with ``pool=URL`` writes its data objects (content-addressed, create-only) to
the pool and keeps its manifests, leases and fences at its own URL; a fork (:mod:`.pool`) also
reads objects from the stores it was forked from. Either way the store records it in
``links.json`` at its own URL (create-only), so it reopens as ``CheckpointStore(url)``:

    {"format": "lightning-incremental-links", "pool": URL or null,
     "sources": [URL, ...], "forked_from": {"url": URL, "step": N} or null}

``sources`` are the locations, in order, whose ``packs/`` hold objects its manifests may name
besides its own (or its pool's). A pool records its members in ``members/<id>.json`` (the
member's URL and minimum object age): the pool's collection (:mod:`.pool_gc`) reads every
member's manifests, pins and fork base from there.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from lightning_incremental.core.errors import ConfigError, CorruptCheckpointError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import LocalStorage, Storage, open_storage
from lightning_incremental.core.storage.linked import LinkedStorage

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
    ``pool_options`` (default: ``options``), each source with ``options``, unless ``by_url``
    names its URL.

    Raises:
        ConfigError: ``pool`` differs from the pool the store was created in; a store with
            checkpoints of its own asked to join a pool.
    """
    pool_options = pool_options or options  # the pool's own, else the store's
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
        chosen = (by_url or {}).get(links.pool, pool_options)
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
