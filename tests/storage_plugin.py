"""A storage backend as another package would write one: objects in a dict, only the abstract
methods of :class:`Storage` implemented (``listdir`` and ``get_view`` are the interface's own).

The conformance suite runs on it (registered by code), and the entry-point tests install it as
a plug-in (``tests/storage/test_storage_registry.py``). URLs: ``dictmem://<name>/<path>``; every
storage opened on the same ``<name>`` sees the same objects, in this process.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.core.storage import Storage

SCHEME = "dictmem"
_lock = threading.Lock()
_spaces: dict[str, dict[str, bytes]] = {}


def open_dict_storage(url: str, storage_options: dict[str, Any]) -> DictStorage:
    """The factory: ``factory(url, storage_options) -> Storage``."""
    if storage_options:
        raise ConfigError(f"{SCHEME}:// takes no storage_options, got {sorted(storage_options)}")
    scheme, _, rest = url.partition("://")
    if scheme.lower() != SCHEME or not rest.strip("/"):
        raise ConfigError(f"not a {SCHEME}:// URL with a name: {url!r}")
    space, _, root = rest.strip("/").partition("/")
    with _lock:
        objects = _spaces.setdefault(space, {})
    return DictStorage(objects, root.strip("/"), url=f"{SCHEME}://{rest.strip('/')}")


def forget(url: str) -> None:
    """Drop every object of the space of ``url``."""
    with _lock:
        _spaces.pop(url.partition("://")[2].strip("/").partition("/")[0], None)


class DictStorage(Storage):
    def __init__(self, objects: dict[str, bytes], root: str, *, url: str) -> None:
        self.objects = objects
        self.root = root
        self.url = url

    def _key(self, path: str) -> str:
        path = path.strip("/")
        return f"{self.root}/{path}" if self.root and path else self.root or path

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        key = self._key(path)
        with _lock:
            if not overwrite and key in self.objects:
                return False
            self.objects[key] = bytes(data)
        return True

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with _lock:
            try:
                data = self.objects[self._key(path)]
            except KeyError:
                raise FileNotFoundError(f"{self.url}/{path}") from None
        return data[start:end]

    def exists(self, path: str) -> bool:
        key = self._key(path)
        with _lock:
            if path.strip("/"):
                return key in self.objects
            return any(name.startswith(f"{key}/") or not key for name in self.objects)

    def list(self, prefix: str) -> list[str]:
        base = self._key(prefix)
        strip = len(self.root) + 1 if self.root else 0
        with _lock:
            names = [n for n in self.objects if not base or n.startswith(f"{base}/")]
        return sorted(name[strip:] for name in names)

    def delete(self, path: str) -> None:
        with _lock:
            self.objects.pop(self._key(path), None)

    def size(self, path: str) -> int:
        return len(self.get(path))

    def mtime(self, path: str) -> float | None:
        self.get(path)  # raises when missing
        return time.time()
