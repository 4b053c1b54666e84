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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_incremental.core.errors import ConfigError, StorageError

TMP_PREFIX = ".tmp-"
MMAP_MIN = 1 << 20  # smaller reads are copied: a mapping costs more than it saves
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
S3_PROTOCOLS = ("s3", "s3a")
SECRET_MIN_LEN = 4  # shorter option values ("s3", "us") are not worth redacting from text


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
    """The storage for ``url``: a local path, ``file://``, or any fsspec URL (``s3://`` and
    ``s3a://`` get :class:`~lightning_incremental.core.s3.S3Storage`).

    ``storage_options`` reach the backend and nothing else: no message, log record or stored
    object of this library contains one of their values.

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
    if protocol in S3_PROTOCOLS:
        try:
            from lightning_incremental.core.s3 import S3Storage
        except ImportError as exc:
            raise ConfigError(
                f"no backend for {protocol}:// is installed (pip install "
                f"'lightning-incremental[s3]'): {exc}"
            ) from exc
        return S3Storage.from_url(url, options)
    fs, root = filesystem(url, protocol, options)
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(root)
    return FsspecStorage(fs, root, url=f"{protocol}://{root}", secrets=secret_strings(options))


def filesystem(
    url: str, protocol: str, options: dict[str, Any]
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and root path of ``url``; errors name the problem, never an
    option's value (with options, the backend's exception is not chained: its text may hold
    one).

    Raises:
        ConfigError: unknown protocol, a backend that is not installed, bad storage options.
    """
    secrets = secret_strings(options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError, TypeError) as exc:
        text = redact(str(exc), secrets)
        if isinstance(exc, ImportError):
            hint = " (pip install 'lightning-incremental[s3]')" if protocol in S3_PROTOCOLS else ""
            error = ConfigError(f"no backend for {protocol}:// is installed{hint}: {text}")
        elif isinstance(exc, TypeError):
            error = ConfigError(f"bad storage_options for {protocol}://: {text}")
        elif "Protocol not known" in str(exc):
            known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) > 1)[:40])
            error = ConfigError(
                f"unknown storage protocol {protocol!r} in {url!r}; fsspec knows: {known}"
            )
        else:
            error = ConfigError(f"cannot open {url!r}: {text}")
        raise error from (None if secrets else exc)
    return fs, root


def secret_strings(options: Mapping[str, Any], where: str = "storage_options") -> dict[str, str]:
    """Every string value in ``options`` (nested dicts and lists included), mapped to the
    placeholder that replaces it in messages: ``<storage_options.secret>``. Every value is
    treated as a secret — credentials hide under many names (``key``, ``aws_session_token``,
    an endpoint with a password in it)."""
    found: dict[str, str] = {}

    def walk(value: Any, label: str) -> None:
        if isinstance(value, str):
            if len(value) >= SECRET_MIN_LEN:
                found.setdefault(value, f"<{label}>")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{label}.{key}")
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                walk(item, label)

    walk(options, where)
    return found


def redact(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with every value of ``secrets`` (from :func:`secret_strings`) replaced by its
    placeholder, longest first so that a value containing another is replaced whole."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, secrets[value])
    return text


@contextmanager
def _translate(what: str, secrets: Mapping[str, str] | None = None) -> Iterator[None]:
    """Turn backend errors into StorageError, keeping FileNotFoundError for missing objects.
    With ``secrets`` the message is redacted and the backend's exception is not shown in the
    traceback (its text may hold an option's value)."""
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
        if secrets:
            raise StorageError(
                exc.errno, f"storage error while {what}: {redact(str(exc), secrets)}"
            ) from None
        raise StorageError(exc.errno, f"storage error while {what}: {exc}") from exc


class FsspecStorage(Storage):
    """Any other fsspec filesystem (memory://, gs://, az://, ...)."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        url: str,
        secrets: Mapping[str, str] | None = None,
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self._secrets = dict(secrets or {})
        self._made: set[str] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if self.root else path

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        target = self._abs(path)
        with _translate(f"writing {path}", self._secrets):
            if not overwrite and self.fs.exists(target):
                return False
            parent = posixpath.dirname(target)
            if parent not in self._made:
                self.fs.makedirs(parent, exist_ok=True)
                self._made.add(parent)
            self.fs.pipe_file(target, bytes(data))
        return True

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with _translate(f"reading {path}", self._secrets):
            return bytes(self.fs.cat_file(self._abs(path), start=start, end=end))

    def exists(self, path: str) -> bool:
        with _translate(f"checking {path}", self._secrets):
            return bool(self.fs.exists(self._abs(path)))

    def list(self, prefix: str) -> list[str]:
        base = self._abs(prefix).rstrip("/")
        with _translate(f"listing {prefix}", self._secrets):
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
        with _translate(f"deleting {path}", self._secrets):
            try:
                self.fs.rm_file(self._abs(path))
            except FileNotFoundError:
                pass

    def size(self, path: str) -> int:
        with _translate(f"reading the size of {path}", self._secrets):
            return int(self.fs.size(self._abs(path)))

    def mtime(self, path: str) -> float | None:
        with _translate(f"reading the time of {path}", self._secrets):
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
