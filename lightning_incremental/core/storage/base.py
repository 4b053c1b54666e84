"""The storage interface: what the engine (and the pointer files of the Lightning plug-in) need
from a backend, and how backend errors become this library's errors.

Objects are written create-only (``put`` returns False when the object already exists) and
atomically: a reader sees the whole object or none. Paths are relative and '/'-separated.
"""

from __future__ import annotations

import builtins
import errno
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from lightning_incremental.core.buffers import gather
from lightning_incremental.core.errors import StorageError
from lightning_incremental.core.storage.redaction import redact


class Storage(ABC):
    """What the engine needs from a backend. Paths are relative, '/'-separated.

    A backend implements the seven abstract methods; ``get_view``, ``listdir``, ``put_parts``
    and ``sync`` have implementations in terms of them that a backend may replace with faster
    ones.
    """

    url: str

    @abstractmethod
    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        """Write ``data`` at ``path`` atomically and durably; when ``overwrite`` is False and the
        object exists, write nothing and return False."""

    def put_parts(
        self,
        path: str,
        parts: Sequence[bytes | memoryview],
        *,
        overwrite: bool = False,
        durable: bool = True,
    ) -> bool:
        """``put`` of the concatenation of ``parts``. This default joins them (copies that
        release the GIL) and calls ``put``; a backend that can write the parts one after
        another (a local file) should, saving that copy.

        ``durable=False``: the new object need not survive a crash of the machine until
        :meth:`sync` is called with its path (it is complete or absent to readers all the same);
        an object ``overwrite`` replaces is replaced only by a durable one (a checkpoint may
        need it). A backend whose writes are durable when they return ignores it."""
        return self.put(path, parts[0] if len(parts) == 1 else gather(parts), overwrite=overwrite)

    def sync(self, paths: Sequence[str]) -> None:
        """Make the objects at ``paths``, written with ``durable=False``, durable. This default
        does nothing: every write of a backend that does not override ``put_parts`` is durable
        when it returns."""
        return None

    @abstractmethod
    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object. Raises FileNotFoundError when it is missing."""

    def get_view(self, path: str, start: int, end: int) -> memoryview:
        """Like ``get``, as a read-only buffer; backends may map instead of copying."""
        return memoryview(self.get(path, start, end))

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether the object exists; ``exists("")``: whether anything is at the location."""

    @abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Relative paths of every object under directory ``prefix`` (recursively); none when it
        does not exist. A listing that fails raises (an OSError, e.g. StorageError): it is never
        returned incomplete, or empty."""

    def listdir(self, prefix: str) -> builtins.list[str]:
        """Relative paths of the objects directly in directory ``prefix``, not in its
        subdirectories (sorted). Backends that can list one level should: this default lists
        everything below ``prefix``."""
        base = prefix.strip("/")
        depth = base.count("/") + 1 if base else 0
        return [path for path in self.list(base) if path.count("/") == depth]

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete one object; deleting a missing object is not an error."""

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def mtime(self, path: str) -> float | None:
        """Modification time (seconds since the epoch), None when the backend has none."""


@contextmanager
def translate_errors(what: str, secrets: Mapping[str, str] | None = None) -> Iterator[None]:
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
