"""Making local writes durable: fsync of files and directories, the close after a write, and
the write-back a deferred write starts (:class:`~lightning_incremental.core.storage.local.
LocalStorage`'s, and the pool's moves to its trash).

Every failure is a :class:`~lightning_incremental.core.errors.NotDurableError` naming the file
or directory, the errno and what it means: nothing written is reported durable that an fsync
did not make so. The one exception is a filesystem that cannot fsync a directory at all
(:data:`NO_DIRECTORY_SYNC`), which is said once per filesystem and tolerated: the files are
fsynced, and the names are as durable as that filesystem makes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading
import warnings

from lightning_incremental.core.errors import NotDurableError


def _sync_file_range() -> object | None:
    """libc's ``sync_file_range`` (Linux), or None. A ctypes call releases the GIL."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writing back the range's dirty pages


# errno values of sync_file_range that say the data did not reach the disk (or cannot): the write
# fails at once. Any other failure (EINVAL, ESPIPE: a file it does not apply to; ENOMEM) leaves
# the write-back to the fsync, which reports its errors.
_LOST = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT})


def start_writeback(fd: int, what: str) -> None:
    """Ask the kernel to start writing the file's dirty pages (``what`` names it) to the disk
    now, without waiting for them (it may wait for room in the disk's queue). Advisory: a
    no-op where there is no such call; an I/O error or a full disk it reports fails the write,
    any other error is the fsync's to report.

    Raises:
        NotDurableError: EIO, ENOSPC or EDQUOT.
    """
    if _SYNC_FILE_RANGE is None:
        return
    if _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:  # type: ignore[operator]
        code = ctypes.get_errno()
        if code in _LOST:
            failed = OSError(code, os.strerror(code))
            lost = "its data may not be on the disk"
            raise _not_durable(failed, f"the write-back of {what}", lost)


def fsync_file(fd: int, what: str) -> None:
    """fsync the written file ``fd`` (``what`` names it).

    Raises:
        NotDurableError: the fsync failed (EIO, ENOSPC, ...): the file's data may not be on the
            disk.
    """
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _not_durable(exc, f"fsync of {what}", "its data may not be on the disk") from exc


def close_written(fd: int, what: str) -> None:
    """Close a descriptor written to: a network filesystem (NFS) reports a failed write-back
    at the close, so that is an error of the write like any other.

    Raises:
        NotDurableError: the close failed.
    """
    try:
        os.close(fd)
    except OSError as exc:
        raise _not_durable(exc, f"closing {what}", "its data may not be on the disk") from exc


# errno values with which a filesystem says it cannot fsync a directory at all, rather than that
# an fsync failed: Linux answers EINVAL (some FUSE and network filesystems), other systems
# ENOTSUP / EOPNOTSUPP, or EBADF / EISDIR for a directory opened read-only.
NO_DIRECTORY_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})
NO_DIRECTORY_SYNC |= {errno.EISDIR}
_said: set[object] = set()  # filesystems warned about (their device), once a process
_said_lock = threading.Lock()


def fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` durable. On a filesystem that cannot fsync a directory
    at all (see :data:`NO_DIRECTORY_SYNC`; Windows opens none) this is a no-op, said once per
    filesystem: its files are fsynced, the names stay as durable as that filesystem makes them.

    Raises:
        NotDurableError: the directory could not be opened (it vanished, no permission, no
            descriptor left) or its fsync failed (EIO, ...): names written there may not
            survive a crash of the machine.
    """
    consequence = "the names written there may not survive a crash of the machine"
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        if os.name == "nt" and isinstance(exc, PermissionError):
            _cannot_sync(directory, exc)  # Windows opens no directory: nothing to fsync
            return
        what = f"opening the directory {directory} to fsync it"
        raise _not_durable(exc, what, consequence) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in NO_DIRECTORY_SYNC:
            with contextlib.suppress(OSError):  # the fsync's error is the one that matters
                os.close(fd)
            raise _not_durable(exc, f"fsync of the directory {directory}", consequence) from exc
        _cannot_sync(directory, exc)
    try:
        os.close(fd)
    except OSError as exc:
        raise _not_durable(exc, f"closing the directory {directory}", consequence) from exc


def _cannot_sync(directory: str, exc: OSError) -> None:
    try:
        where: object = os.stat(directory).st_dev
    except OSError:
        where = directory
    with _said_lock:
        if where in _said:
            return
        _said.add(where)
    warnings.warn(
        f"the filesystem of {directory} cannot fsync a directory ({_name(exc)}): files written "
        "there are fsynced, but their names are as durable as the filesystem makes them — a "
        "checkpoint committed just before a crash of the machine may be missing after it. "
        "Said once for this filesystem.",
        RuntimeWarning,
        stacklevel=2,
    )


def _name(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{code}: {exc.strerror or exc}"


def _not_durable(exc: OSError, what: str, consequence: str) -> NotDurableError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        cause, fix = "disk full", "free space or point the store at a larger volume"
    else:
        cause, fix = "failed", "check the disk (the kernel log) and save again"
    return NotDurableError(
        exc.errno,
        f"{what} {cause} ({_name(exc)}): {consequence}, so the write is not durable and is not "
        f"reported done (a save it belongs to does not commit: the previous checkpoint is "
        f"intact and stays the newest); {fix}",
    )


def make_name_durable(directory: str, target: str, *, created: bool) -> None:
    """fsync ``directory`` so that ``target``'s new name survives a crash. When that fails, a
    name this write created is removed again (the write did not happen), then the error is
    raised; a name it replaced holds the new, fsynced file either way.

    Raises:
        NotDurableError: see :func:`fsync_dir`.
    """
    try:
        fsync_dir(directory)
    except NotDurableError as exc:
        if not created:
            raise
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        except OSError as also:
            raise NotDurableError(
                exc.errno, f"{exc}. Removing {target} again failed too ({also}): it is there"
            ) from exc
        raise
