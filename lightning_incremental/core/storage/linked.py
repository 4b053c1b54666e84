"""LinkedStorage: a store whose data objects live elsewhere — in a shared object pool, and (for
a fork) in the stores it was forked from.

Everything that is not a data object (manifests, leases, fences, the marker, quarantine) goes
to the store's own location. Data objects (``packs/...``) are written to ``objects`` (the pool,
or the own location) and read from ``objects`` first, then from each of ``sources`` in order
(the object locations of the stores a fork references).

A pool's collection does not delete an object in one step: it moves it to the pool's trash
(``trash/packs/...``, the same name under :data:`TRASH_DIR`), and purges it from there later
(:mod:`~lightning_incremental.core.maintain.pool_gc`). A read of a data object that no location
holds under ``packs/`` therefore looks in each location's trash, then under ``packs/`` once more
(a collection that restores an object writes it back before it drops the trash's copy): a step
a member committed while the collection moved one of its objects loads, bit-exact, before the
next collection puts the object back. Such reads are recorded in :attr:`LinkedStorage.in_trash`
(``verify`` says where the object is).

Deletion is structural: a data object is only ever listed and deleted in the store's own
location. A member of a pool keeps no data objects of its own, so its ``gc`` finds none to
remove; the pool's objects are removed by the pool's own collection alone
(:mod:`~lightning_incremental.core.maintain.pool_gc`), and a source's by its own ``gc``, which
honours the fork's pin.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from lightning_incremental.core.storage.base import Storage

OBJECT_DIR = "packs"  # the store layout's data objects (format.layout.PACK_DIR)
TRASH_DIR = "trash"  # a pool's collected objects, until a later collection purges them


def trash_path(path: str) -> str:
    """Where the pool's collection moves data object ``path``: the same name in the trash."""
    return f"{TRASH_DIR}/{path}"


def _is_object(path: str) -> bool:
    return path.startswith(OBJECT_DIR + "/")


class LinkedStorage(Storage):
    """The storage of a pool member or a fork; see the module docstring.

    Args:
        own: the store's own location (its URL).
        objects: where new data objects are written (a pool), or None: the own location.
        sources: read-only locations of data objects the store's manifests may name.
    """

    def __init__(
        self, own: Storage, objects: Storage | None = None, sources: Sequence[Storage] = ()
    ) -> None:
        self.own = own
        self.objects = own if objects is None else objects
        self.sources = tuple(sources)
        self.url = own.url
        #: data objects read from a location's trash -> that location's URL
        self.in_trash: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"LinkedStorage({self.own!r}, objects={self.objects.url!r})"

    def readers(self) -> tuple[Storage, ...]:
        """The locations data objects are read from, in order: ``objects``, then ``sources``."""
        return (self.objects, *self.sources)

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        target = self.objects if _is_object(path) else self.own
        return target.put(path, data, overwrite=overwrite)

    def put_parts(
        self,
        path: str,
        parts: Sequence[bytes | memoryview],
        *,
        overwrite: bool = False,
        durable: bool = True,
    ) -> bool:
        target = self.objects if _is_object(path) else self.own
        return target.put_parts(path, parts, overwrite=overwrite, durable=durable)

    def sync(self, paths: Sequence[str]) -> None:
        objects = [path for path in paths if _is_object(path)]
        if objects:
            self.objects.sync(objects)
        if len(objects) < len(paths):
            self.own.sync([path for path in paths if not _is_object(path)])

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if not _is_object(path):
            return self.own.get(path, start, end)
        return self._first("get", path, start, end)  # type: ignore[no-any-return]

    def get_view(self, path: str, start: int, end: int) -> memoryview:
        if not _is_object(path):
            return self.own.get_view(path, start, end)
        return self._first("get_view", path, start, end)  # type: ignore[no-any-return]

    def exists(self, path: str) -> bool:
        if not _is_object(path):
            return self.own.exists(path)
        readers = self.readers()
        return any(reader.exists(path) for reader in readers) or any(
            reader.exists(trash_path(path)) for reader in readers
        )

    def size(self, path: str) -> int:
        if not _is_object(path):
            return self.own.size(path)
        return self._first("size", path)  # type: ignore[no-any-return]

    def mtime(self, path: str) -> float | None:
        if not _is_object(path):
            return self.own.mtime(path)
        return self._first("mtime", path)  # type: ignore[no-any-return]

    def list(self, prefix: str) -> builtins.list[str]:
        return self.own.list(prefix)  # data objects too: only the own location's

    def listdir(self, prefix: str) -> builtins.list[str]:
        return self.own.listdir(prefix)

    def delete(self, path: str) -> None:
        self.own.delete(path)  # never the pool's or a source's

    def _first(self, op: str, path: str, *args: object) -> object:
        """``op`` on the first location that holds ``path``, then on the first whose trash
        does, then on the locations again (an object restored from the trash meanwhile);
        FileNotFoundError when none does."""
        missing: FileNotFoundError | None = None
        readers = self.readers()
        for attempt in (path, trash_path(path), path):
            for reader in readers:
                try:
                    found = getattr(reader, op)(attempt, *args)
                except FileNotFoundError as exc:
                    missing = missing or exc
                    continue
                if attempt != path:
                    self.in_trash[path] = reader.url
                elif self.in_trash:
                    self.in_trash.pop(path, None)  # back in place
                return found
        assert missing is not None
        raise missing

    def where(self, path: str) -> str | None:
        """The URL of the first location holding data object ``path`` (``URL/trash`` for a
        location's trash); None when none does."""
        for reader in (self.own, *self.readers()):
            if reader.exists(path):
                return reader.url
        for reader in self.readers():
            if reader.exists(trash_path(path)):
                return f"{reader.url}/{TRASH_DIR}"
        return None


def where_read(storage: Storage) -> str:
    """Where a read of a data object through ``storage`` looked, for a message saying it is
    missing."""
    if not isinstance(storage, LinkedStorage):
        return "the store"
    urls = ", ".join(dict.fromkeys(reader.url for reader in storage.readers()))
    return (
        f"every location {storage.url} reads objects from ({urls}, and their trash): a store "
        "a fork reads from must be kept while the fork names its objects (its pin says so), "
        "and a pool's objects are removed by its collection alone"
    )
