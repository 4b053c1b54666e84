"""FsspecStorage: any fsspec filesystem (``memory://``, ``gs://``, ``az://``, ...) behind the
:class:`Storage` interface; the backend of every URL scheme that has no backend of its own.

A write is one ``pipe_file`` under the final name: on object stores one PUT, which makes the
object visible whole or not at all. Object stores have buckets, not directories: nothing is
created for a write there (a mistyped bucket name must fail the write, not create a bucket).
"""

from __future__ import annotations

import builtins
import os
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from lightning_incremental.core.errors import ConfigError
from lightning_incremental.core.storage.base import Storage, translate_errors
from lightning_incremental.core.storage.local import LocalStorage
from lightning_incremental.core.storage.redaction import redact, secret_strings

#: Schemes of object stores: no directories to create, and creating one may create a bucket.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "r2"})


def open_fsspec(url: str, storage_options: dict[str, Any]) -> Storage:
    """The storage for an fsspec URL: :class:`LocalStorage` for local filesystems
    (``file://``), :class:`FsspecStorage` for any other.

    Raises:
        ConfigError: unknown protocol, a backend that is not installed, bad storage options.
    """
    protocol = url.split("://", 1)[0].lower()
    fs, root = filesystem(url, protocol, storage_options)
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(os.path.abspath(root))
    # Most filesystems strip the protocol from the root; http(s) keeps the whole URL.
    url = root if "://" in root else f"{protocol}://{root}"
    return FsspecStorage(fs, root, url=url, secrets=secret_strings(storage_options))


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
            error = ConfigError(f"no backend for {protocol}:// is installed: {text}")
        elif isinstance(exc, TypeError):
            error = ConfigError(f"bad storage_options for {protocol}://: {text}")
        elif "Protocol not known" in str(exc):
            error = ConfigError(f"unknown storage protocol {protocol!r} in {url!r}")
        else:
            error = ConfigError(f"cannot open {url!r}: {text}")
        raise error from (None if secrets else exc)
    return fs, root


class FsspecStorage(Storage):
    """Any other fsspec filesystem (memory://, gs://, az://, ...).

    Args:
        fs: the filesystem.
        root: the store's path on it.
        url: the store's URL, as shown in messages.
        secrets: values to keep out of messages (see :func:`secret_strings`).
    """

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
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self._directories = not OBJECT_STORES.intersection(protocols)
        # fsspec's generic find omits every error below the top directory: walked here instead
        self._own_find = _overrides_find(fs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if self.root else path

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        target = self._abs(path)
        with translate_errors(f"writing {path}", self._secrets):
            if not overwrite and self.fs.exists(target):
                return False
            parent = posixpath.dirname(target)
            if self._directories and parent not in self._made:
                self.fs.makedirs(parent, exist_ok=True)
                self._made.add(parent)
            self.fs.pipe_file(target, bytes(data))
        return True

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with translate_errors(f"reading {path}", self._secrets):
            return bytes(self.fs.cat_file(self._abs(path), start=start, end=end))

    def exists(self, path: str) -> bool:
        with translate_errors(f"checking {path}", self._secrets):
            return bool(self.fs.exists(self._abs(path)))

    def list(self, prefix: str) -> builtins.list[str]:
        """Every object under ``prefix``; a directory that does not exist holds none.

        Raises:
            StorageError: the listing failed (a directory could not be read).
        """
        base = self._abs(prefix).rstrip("/")
        with translate_errors(f"listing {prefix or 'the store'}", self._secrets):
            try:
                found = self._find(base) if self._own_find else self._walk(base)
            except FileNotFoundError:
                return []
        strip = self.fs._strip_protocol(self.root).rstrip("/") if self.root else ""
        return sorted(_relative(self.fs._strip_protocol(name), strip) for name in found)

    def _find(self, base: str) -> builtins.list[str]:
        """The filesystem's own recursive listing (one flat listing on object stores)."""
        return list(self.fs.find(base))

    def _walk(self, base: str) -> builtins.list[str]:
        """Every file under ``base``, directory by directory. fsspec's generic ``find`` walks
        with errors omitted (an unreadable directory reads as an empty one): this one raises
        them; only a directory that does not exist (or vanished meanwhile) holds nothing."""
        found: builtins.list[str] = []
        pending = [base]
        while pending:
            directory = pending.pop()
            try:
                entries = self.fs.ls(directory, detail=True)
            except FileNotFoundError:
                if directory == base:
                    raise
                continue
            for info in entries:
                name = info["name"].rstrip("/")
                if info.get("type") == "directory":
                    if name != directory:
                        pending.append(name)
                elif name != directory:  # ls of a file names the file: not under it
                    found.append(name)
        return found

    def listdir(self, prefix: str) -> builtins.list[str]:
        base = prefix.strip("/")
        where = self._abs(base) if base else self.root
        with translate_errors(f"listing {prefix}", self._secrets):
            self.fs.invalidate_cache(where)  # a listing cached by the filesystem may be stale
            try:
                entries = self.fs.ls(where, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
        names = (
            posixpath.basename(info["name"].rstrip("/"))
            for info in entries
            if info.get("type") != "directory"
        )
        return sorted(f"{base}/{name}" if base else name for name in names)

    def delete(self, path: str) -> None:
        with translate_errors(f"deleting {path}", self._secrets):
            try:
                self.fs.rm_file(self._abs(path))
            except FileNotFoundError:
                pass

    def size(self, path: str) -> int:
        with translate_errors(f"reading the size of {path}", self._secrets):
            return int(self.fs.size(self._abs(path)))

    def mtime(self, path: str) -> float | None:
        with translate_errors(f"reading the time of {path}", self._secrets):
            try:
                modified = self.fs.modified(self._abs(path))
            except (NotImplementedError, AttributeError):
                return None
        return float(modified.timestamp())


def _overrides_find(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` lists recursively its own way (object stores: one flat listing, whose
    errors are raised) rather than by fsspec's generic walk, which omits them."""
    cls = type(fs)
    if isinstance(fs, AsyncFileSystem):
        return cls._find is not AsyncFileSystem._find
    return cls.find is not AbstractFileSystem.find


def _relative(name: str, root: str) -> str:
    """``name`` (a path of the filesystem) relative to the store's ``root``."""
    rel = name[len(root) + 1 :] if root and name.startswith(root + "/") else name
    return rel.lstrip("/")
