"""Storage: one small interface over fsspec; backend quirks live here.

Objects are written create-only (``put`` returns False when the object already exists) and
atomically: a reader sees the whole object or none. On local disks a write goes to a temporary
file, is fsynced, then linked into place (``link`` fails if the name exists, which makes the
create-only check atomic) and the directory is fsynced.
"""

from __future__ import annotations

import errno
import mmap
import os
import posixpath
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_incremental.core.errors import ConfigError, StorageError

TMP_PREFIX = ".tmp-"
MMAP_MIN = 1 << 20  # smaller reads are copied: a mapping costs more than it saves
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")


class Storage(ABC):
    """What the engine needs from a backend. Paths are relative, '/'-separated."""

    url: str

    @abstractmethod
    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        """Write ``data`` at ``path`` atomically and durably; when ``overwrite`` is False and the
        object exists, write nothing and return False."""

    @abstractmethod
    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object. Raises FileNotFoundError when it is missing."""

    def get_view(self, path: str, start: int, end: int) -> memoryview:
        """Like ``get``, as a read-only buffer; backends may map instead of copying."""
        return memoryview(self.get(path, start, end))

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Relative paths of every object under directory ``prefix`` (recursively)."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete one object; deleting a missing object is not an error."""

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def mtime(self, path: str) -> float | None:
        """Modification time (seconds since the epoch), None when the backend has none."""


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Storage:
    """The storage for ``url``: a local path, ``file://``, or any fsspec URL.

    Raises:
        ConfigError: unknown protocol, a backend that is not installed, bad storage options.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url must be a non-empty str or path, got {url!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    options = dict(storage_options or {})
    match = _SCHEME.match(url)
    if match is None:
        if options:
            raise ConfigError("storage_options were given for a local path; they apply to URLs")
        return LocalStorage(os.path.abspath(os.path.expanduser(url)))
    protocol = match.group(1).lower()
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        hint = " (pip install 'lightning-incremental[s3]')" if protocol in ("s3", "s3a") else ""
        raise ConfigError(f"no backend for {protocol}:// is installed{hint}: {exc}") from exc
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) > 1)[:40])
            raise ConfigError(
                f"unknown storage protocol {protocol!r} in {url!r}; fsspec knows: {known}"
            ) from exc
        raise ConfigError(f"cannot open {url!r}: {exc}") from exc
    except TypeError as exc:
        raise ConfigError(f"bad storage_options for {protocol}://: {exc}") from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(root)
    return FsspecStorage(fs, root, url=f"{protocol}://{root}")


@contextmanager
def _translate(what: str) -> Iterator[None]:
    """Turn backend errors into StorageError, keeping FileNotFoundError for missing objects."""
    try:
        yield
    except FileNotFoundError:
        raise
    except StorageError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StorageError(
                exc.errno,
                f"disk full (ENOSPC) while {what}: free space or point the store "
                "at a larger volume; the previous checkpoint is intact",
            ) from exc
        raise StorageError(exc.errno, f"storage error while {what}: {exc}") from exc


class FsspecStorage(Storage):
    """Any fsspec filesystem (memory://, s3://, gs://, ...)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self._made: set[str] = set()

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if self.root else path

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        target = self._abs(path)
        with _translate(f"writing {path}"):
            if not overwrite and self.fs.exists(target):
                return False
            parent = posixpath.dirname(target)
            if parent not in self._made:
                self.fs.makedirs(parent, exist_ok=True)
                self._made.add(parent)
            self.fs.pipe_file(target, bytes(data))
        return True

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with _translate(f"reading {path}"):
            return bytes(self.fs.cat_file(self._abs(path), start=start, end=end))

    def exists(self, path: str) -> bool:
        with _translate(f"checking {path}"):
            return bool(self.fs.exists(self._abs(path)))

    def list(self, prefix: str) -> list[str]:
        base = self._abs(prefix).rstrip("/")
        with _translate(f"listing {prefix}"):
            try:
                found = self.fs.find(base)
            except FileNotFoundError:
                return []
        strip = self.fs._strip_protocol(self.root).rstrip("/") if self.root else ""
        out = []
        for name in found:
            name = self.fs._strip_protocol(name)
            rel = name[len(strip) + 1 :] if strip and name.startswith(strip + "/") else name
            out.append(rel.lstrip("/"))
        return sorted(out)

    def delete(self, path: str) -> None:
        with _translate(f"deleting {path}"):
            try:
                self.fs.rm_file(self._abs(path))
            except FileNotFoundError:
                pass

    def size(self, path: str) -> int:
        with _translate(f"reading the size of {path}"):
            return int(self.fs.size(self._abs(path)))

    def mtime(self, path: str) -> float | None:
        with _translate(f"reading the time of {path}"):
            try:
                modified = self.fs.modified(self._abs(path))
            except (NotImplementedError, AttributeError):
                return None
        return float(modified.timestamp())


class LocalStorage(Storage):
    """A local directory, with fsync and create-only links."""

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = root
        self.url = root
        self.fsync = fsync
        self._made: set[str] = set()

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def _makedirs(self, directory: str) -> None:
        if directory in self._made:
            return
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        if created and self.fsync:
            _fsync_dir(os.path.dirname(directory))
        self._made.add(directory)

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        target = self._abs(path)
        directory = os.path.dirname(target)
        with _translate(f"writing {path} under {self.root}"):
            if not overwrite and os.path.exists(target):
                return False
            self._makedirs(directory)
            tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}")
            try:
                with open(tmp, "xb") as fh:
                    fh.write(data)
                    fh.flush()
                    if self.fsync:
                        os.fsync(fh.fileno())
                if overwrite:
                    os.replace(tmp, target)
                else:
                    try:
                        os.link(tmp, target)
                    except FileExistsError:
                        return False
                    finally:
                        os.unlink(tmp)
            except BaseException:
                _silent_unlink(tmp)
                raise
            if self.fsync:
                _fsync_dir(directory)
        return True

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with _translate(f"reading {path} under {self.root}"), open(self._abs(path), "rb") as fh:
            if start:
                fh.seek(start)
            if end is None:
                return fh.read()
            return fh.read(max(0, end - (start or 0)))

    def get_view(self, path: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` mapped read-only instead of copied. Objects are immutable and
        only ever replaced by rename, never rewritten in place, so the mapping stays valid."""
        with _translate(f"reading {path} under {self.root}"), open(self._abs(path), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if end > size or end - start < MMAP_MIN:
                fh.seek(start)
                return memoryview(fh.read(max(0, end - start)))
            align = start - start % mmap.ALLOCATIONGRANULARITY
            mapped = mmap.mmap(fh.fileno(), end - align, offset=align, access=mmap.ACCESS_READ)
        return memoryview(mapped)[start - align :]

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def list(self, prefix: str) -> list[str]:
        base = self._abs(prefix)
        out: list[str] = []
        with _translate(f"listing {prefix} under {self.root}"):
            for dirpath, _, files in os.walk(base):
                rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
                prefix_dir = "" if rel_dir == "." else f"{rel_dir}/"
                out.extend(f"{prefix_dir}{name}" for name in files)
        return sorted(out)

    def delete(self, path: str) -> None:
        with _translate(f"deleting {path} under {self.root}"):
            _silent_unlink(self._abs(path))

    def size(self, path: str) -> int:
        with _translate(f"reading the size of {path}"):
            return os.path.getsize(self._abs(path))

    def mtime(self, path: str) -> float | None:
        with _translate(f"reading the time of {path}"):
            return os.path.getmtime(self._abs(path))


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the data files were fsynced
    finally:
        os.close(fd)


def _silent_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
