"""FaultyStorage: a Storage wrapper that fails at a chosen phase of a save.

It delegates every call to an inner :class:`Storage` (e.g. ``open_storage(url, None)``) and,
once armed with :meth:`FaultyStorage.fail`, makes the Nth matching call raise. The phase of a
call is read from its path (``packs/...`` data objects, ``manifests/...`` commit records,
``store.json`` the store marker), so a test can say "fail the 2nd pack write" or "fail the
manifest write after it landed" without knowing anything else about the engine.

Where the fault fires relative to the real write (``when``):

- ``"before"``: nothing is written, the caller sees the error (the backend refused the write);
- ``"after"``: the write landed, then the caller sees an error (a crash or a lost response after
  the object became durable — the ambiguous case every object store has);
- ``"torn"``: only the first half of the bytes landed under the name, then an error. The
  Storage contract forbids this (writes are atomic), so it models a broken backend.

Errors are raised the way the engine's own backends raise them: an ``OSError`` carrying the
errno, passed through the same translation the engine's storage classes apply, so the caller
sees a :class:`~lightning_incremental.core.StorageError` (``translate=True``, the default), or
the bare ``OSError`` a third-party Storage might raise (``translate=False``).
"""

from __future__ import annotations

import errno as errnos
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

from lightning_incremental.core.buffers import gather
from lightning_incremental.core.errors import StorageError
from lightning_incremental.core.storage import Storage, translate_errors

PHASES = ("marker", "pack", "manifest", "quarantine", "other")
OPS = ("put", "get", "exists", "list", "delete", "size", "mtime", "sync")
WHEN = ("before", "after", "torn")
GATE_TIMEOUT_S = 60.0  # a held call that is never released fails instead of hanging the suite


def phase_of(path: str) -> str:
    """The phase of a save that a call on ``path`` belongs to."""
    if path.startswith("packs/"):
        return "pack"
    if path.startswith("manifests/"):
        return "manifest"
    if path == "store.json":
        return "marker"
    if path.startswith("quarantine/"):
        return "quarantine"
    return "other"


@dataclass
class Fault:
    """One armed fault: calls of ``op`` in ``phase`` number ``nth`` .. ``nth + times - 1``
    (counted from when it was armed) fail; ``times=None`` fails every call from the Nth on (a
    disk that stays full)."""

    op: str
    phase: str
    nth: int = 1
    times: int | None = 1
    when: str = "before"
    errno: int = errnos.EIO
    translate: bool = True
    seen: int = 0  # matching calls since armed

    def fires(self) -> bool:
        """Count one matching call; True when this one must fail."""
        self.seen += 1
        if self.seen < self.nth:
            return False
        return self.times is None or self.seen < self.nth + self.times


class FaultyStorage(Storage):
    """Delegates to ``inner``; fails the calls an armed :class:`Fault` selects.

    Attributes:
        calls: calls per ``(op, phase)`` since construction (failed ones included).
        raised: every error this wrapper raised, in order.
        landed: paths whose bytes reached the inner storage although the caller saw an error.
    """

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: Counter[tuple[str, str]] = Counter()
        self.raised: list[BaseException] = []
        self.landed: list[str] = []
        self._faults: list[Fault] = []
        self._gates: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ arming

    def fail(
        self,
        phase: str,
        *,
        op: str = "put",
        nth: int = 1,
        times: int | None = 1,
        when: str = "before",
        errno: int = errnos.EIO,
        translate: bool = True,
    ) -> Fault:
        """Arm a fault (see :class:`Fault`). ``errno=errno.ENOSPC`` is a full disk."""
        if phase not in PHASES or op not in OPS or when not in WHEN:
            raise ValueError(f"bad fault: phase={phase!r} op={op!r} when={when!r}")
        if when != "before" and op != "put":
            raise ValueError("only a put can land before failing")
        if nth < 1 or (times is not None and times < 1):
            raise ValueError(f"nth and times must be >= 1, got {nth}, {times}")
        fault = Fault(op, phase, nth, times, when, errno, translate)
        with self._lock:
            self._faults.append(fault)
        return fault

    def hold(self, phase: str, *, op: str = "put") -> threading.Event:
        """Make calls of ``op`` in ``phase`` wait until the returned event is set (before any
        fault on them fires), so a test can order a background save against its own calls."""
        if phase not in PHASES or op not in OPS:
            raise ValueError(f"bad gate: phase={phase!r} op={op!r}")
        gate = threading.Event()
        with self._lock:
            self._gates[(op, phase)] = gate
        return gate

    def clear(self) -> None:
        """Disarm every fault and open every gate: the storage works again."""
        with self._lock:
            self._faults.clear()
            gates, self._gates = list(self._gates.values()), {}
        for gate in gates:
            gate.set()

    def count(self, op: str, phase: str) -> int:
        with self._lock:
            return self.calls[(op, phase)]

    # ------------------------------------------------------------------ internals

    def _check(self, op: str, path: str) -> Fault | None:
        """Count the call; the fault that fires on it, if any."""
        phase = phase_of(path)
        with self._lock:
            gate = self._gates.get((op, phase))
        if gate is not None and not gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"{op} of {path} was held and never released (test bug)")
        with self._lock:
            self.calls[(op, phase)] += 1
            firing = None
            for fault in self._faults:
                if fault.op == op and fault.phase == phase and fault.fires() and firing is None:
                    firing = fault
            return firing

    def _error(self, fault: Fault, op: str, path: str) -> OSError:
        exc = OSError(fault.errno, os.strerror(fault.errno), path)
        if fault.translate:
            try:
                with translate_errors(f"{op} of {path} (injected fault)"):
                    raise exc
            except StorageError as translated:
                exc = translated
        with self._lock:
            self.raised.append(exc)
        return exc

    def _guard(self, op: str, path: str) -> None:
        fault = self._check(op, path)
        if fault is not None:
            raise self._error(fault, op, path)

    # ------------------------------------------------------------------ Storage

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        fault = self._check("put", path)
        if fault is None:
            return self.inner.put(path, data, overwrite=overwrite)
        self._fail_put(fault, path, data, overwrite)

    def put_parts(
        self,
        path: str,
        parts: Sequence[bytes | memoryview],
        *,
        overwrite: bool = False,
        durable: bool = True,
    ) -> bool:
        """A put (its faults and gates) that passes ``durable`` on to the inner storage, so
        that the packs of a save reach it as they reach a real one (made durable later by
        :meth:`sync`). A subclass that overrides ``put`` sees these writes through it."""
        if type(self).put is not FaultyStorage.put:
            return super().put_parts(path, parts, overwrite=overwrite)
        fault = self._check("put", path)
        if fault is None:
            return self.inner.put_parts(path, parts, overwrite=overwrite, durable=durable)
        self._fail_put(fault, path, parts[0] if len(parts) == 1 else gather(parts), overwrite)

    def _fail_put(
        self, fault: Fault, path: str, data: bytes | memoryview, overwrite: bool
    ) -> NoReturn:
        """A put that ``fault`` fails: what lands first (``when``), then its error."""
        if fault.when == "after":
            self.inner.put(path, data, overwrite=overwrite)
        elif fault.when == "torn":
            self.inner.put(path, bytes(data)[: len(data) // 2], overwrite=overwrite)
        if fault.when != "before":
            with self._lock:
                self.landed.append(path)
        raise self._error(fault, "put", path)

    def sync(self, paths: Sequence[str]) -> None:
        """Faults and gates of op ``"sync"`` fire per path (the disk reports a write back
        error at the fsync); nothing is synced once one fires."""
        for path in paths:
            self._guard("sync", path)
        self.inner.sync(paths)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self._guard("get", path)
        return self.inner.get(path, start, end)

    def exists(self, path: str) -> bool:
        self._guard("exists", path)
        return self.inner.exists(path)

    def list(self, prefix: str) -> list[str]:
        self._guard("list", prefix.rstrip("/") + "/")
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self._guard("delete", path)
        self.inner.delete(path)

    def size(self, path: str) -> int:
        self._guard("size", path)
        return self.inner.size(path)

    def mtime(self, path: str) -> float | None:
        self._guard("mtime", path)
        return self.inner.mtime(path)


class SlowStorage(FaultyStorage):
    """Each ``put`` of a path under ``prefix`` (``"packs/"``, ``"manifests/"``) takes
    ``delay_s`` longer: a slow storage, or one slow part of it."""

    def __init__(self, inner: Storage, delay_s: float, prefix: str) -> None:
        super().__init__(inner)
        self.delay_s, self.prefix = delay_s, prefix

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        if path.startswith(self.prefix):
            time.sleep(self.delay_s)
        return super().put(path, data, overwrite=overwrite)


@contextmanager
def unreadable_directories(*directories: str, errno: int = errnos.EIO) -> Iterator[list[str]]:
    """Make reading the listed (absolute) local directories fail with ``errno`` meanwhile, as a
    failing disk or a stale NFS handle makes ``scandir`` fail: every backend over a local
    filesystem (``os.walk``, fsspec's ``LocalFileSystem.ls``) hits the real call's error.
    Running as root, permissions cannot make a directory unreadable; this can. Yields the list
    of directories whose reading failed (in order)."""
    real = os.scandir
    broken = {os.path.normpath(d) for d in directories}
    failed: list[str] = []

    def scandir(path: Any = ".") -> Any:
        where = os.path.normpath(os.fsdecode(path)) if isinstance(path, (str, bytes)) else None
        if where in broken:
            failed.append(where)
            raise OSError(errno, os.strerror(errno), where)
        return real(path)

    os.scandir = scandir
    try:
        yield failed
    finally:
        os.scandir = real


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@contextmanager
def read_only_directory(directory: str | os.PathLike[str]) -> Iterator[str]:
    """Make the local ``directory`` (and everything in it) read-only meanwhile, as truly as
    this process allows; yields how: ``"permissions"`` (mode bits without write: a non-root
    process gets ``EACCES``), ``"immutable"`` (running as root, where modes deny nothing:
    ``chattr -R +i``, the kernel's ``EPERM``), else ``"patched"`` (root without the capability
    to set that attribute: the writes ``os`` makes under the directory fail with ``EROFS``, as
    on a read-only mount — every backend over a local filesystem hits them). Reading works in
    every case."""
    root = os.path.abspath(directory)
    if os.geteuid() != 0:
        modes = {}
        for path in [root, *_tree(root)]:
            modes[path] = os.stat(path).st_mode
            os.chmod(path, modes[path] & ~0o222)
        try:
            yield "permissions"
        finally:
            for path, mode in modes.items():
                os.chmod(path, mode)
        return
    if _chattr("+i", root):
        try:
            yield "immutable"
        finally:
            _chattr("-i", root)
        return
    with _refused_writes(root):
        yield "patched"


def _tree(root: str) -> list[str]:
    found = []
    for where, dirs, files in os.walk(root):
        found.extend(os.path.join(where, name) for name in (*dirs, *files))
    return found


def _chattr(flag: str, root: str) -> bool:
    """``chattr -R flag root``, confirmed (for ``+i``) by a write that fails."""
    import shutil
    import subprocess

    if shutil.which("chattr") is None:
        return False
    done = subprocess.run(["chattr", "-R", flag, root], capture_output=True).returncode == 0
    if not done or flag != "+i":
        return done
    try:
        fd = os.open(os.path.join(root, f".probe-{os.getpid()}"), os.O_WRONLY | os.O_CREAT)
    except PermissionError:
        return True
    os.close(fd)  # the attribute did not hold (a filesystem without it): undo, refuse
    os.unlink(os.path.join(root, f".probe-{os.getpid()}"))
    subprocess.run(["chattr", "-R", "-i", root], capture_output=True)
    return False


@contextmanager
def _refused_writes(root: str) -> Iterator[None]:
    under = root + os.sep

    def inside(path: Any) -> bool:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False  # a file descriptor
        full = os.path.abspath(os.fsdecode(path))
        return full == root or full.startswith(under)

    def refuse(path: Any) -> NoReturn:
        raise OSError(errnos.EROFS, os.strerror(errnos.EROFS), os.fsdecode(path))

    real = {
        name: getattr(os, name)
        for name in ("open", "mkdir", "replace", "rename", "link", "unlink", "remove", "rmdir")
    }

    def opener(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & _WRITE_FLAGS and inside(path):
            refuse(path)
        return real["open"](path, flags, *args, **kwargs)  # type: ignore[no-any-return]

    def changer(name: str) -> Any:
        def change(*paths: Any, **kwargs: Any) -> Any:
            for path in paths[:2]:
                if inside(path):
                    refuse(path)
            return real[name](*paths, **kwargs)

        return change

    os.open = opener  # type: ignore[assignment]
    for name in real:
        if name != "open":
            setattr(os, name, changer(name))
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(os, name, function)
