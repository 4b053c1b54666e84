"""A write that could not be made durable fails, and what it belongs to is not committed.

The disk's errors are injected where the kernel reports them, ``os.fsync`` (and ``close``, and
the write-back a deferred write starts) as the local backend calls them: an I/O error cannot be
produced on purpose here. Everything else is real: the store, its files, its threads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import CheckpointStore, NotDurableError, StorageError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import LocalStorage, durable
from tests.conftest import assert_state_equal, small_store

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads a descriptor's path from /proc"
)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(6000, generator=g) for i in range(4)}


def _path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture(autouse=True)
def _unsaid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process: no filesystem said yet to fsync no directory."""
    monkeypatch.setattr(durable, "_said", set())


@pytest.fixture
def failing_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``arm(code, where)``: from now on, fsync of a directory whose path ends with ``where``
    fails with ``code`` (``where=""``: every directory)."""
    real = os.fsync
    armed: dict[str, object] = {}

    def fsync(fd: int) -> None:
        if armed and stat.S_ISDIR(os.fstat(fd).st_mode):
            path = _path(fd)
            if path.endswith(str(armed["where"])):
                code = int(armed["code"])  # type: ignore[call-overload]
                raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    def arm(code: int | None, where: str = "") -> None:
        armed.clear()
        if code is not None:
            armed.update(code=code, where=where)

    yield arm


@pytest.mark.parametrize("where", [f"/{mf.PACK_DIR}", f"/{mf.MANIFEST_DIR}"])
def test_a_failed_directory_fsync_fails_the_save_and_commits_nothing(
    tmp_path: Path, failing_fsync: Callable[..., None], where: str
) -> None:
    """EIO from the fsync of the packs' directory (before the manifest is written) or of the
    manifests' directory (after it was linked into place): the save fails naming the directory,
    the errno and what it means; no manifest of it is left, the previous step is the newest and
    loads without a warning, and the next save commits."""
    root = tmp_path / "store"
    with small_store(str(root)) as store:
        store.save(_state(1), step=1).wait()
        failing_fsync(errno.EIO, where)
        with pytest.raises(NotDurableError) as raised:
            store.save(_state(2), step=2).wait()
        message = str(raised.value)
        assert f"directory {root}{where}" in message and "EIO" in message, message
        assert "previous checkpoint is intact" in message and "not durable" in message
        assert isinstance(raised.value, StorageError) and raised.value.errno == errno.EIO
        assert store.steps() == [1]
        assert not (root / mf.manifest_path(2)).exists()
        failing_fsync(None)
    with CheckpointStore(str(root)) as fresh, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.steps() == [1]
        assert_state_equal(fresh.load(), _state(1))
        fresh.save(_state(2), step=2).wait()
        assert fresh.steps() == [1, 2] and fresh.verify(2).ok


def test_a_filesystem_that_cannot_fsync_a_directory_is_said_once(
    tmp_path: Path, failing_fsync: Callable[..., None]
) -> None:
    """EINVAL (and ENOTSUP) is what a filesystem answers that cannot fsync directories at all:
    saves go on (the files are fsynced), and one warning says so, not one per directory or
    save."""
    failing_fsync(errno.EINVAL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with small_store(str(tmp_path / "store")) as store:
            for step in (1, 2, 3):
                store.save(_state(step), step=step).wait()
            assert store.steps() == [1, 2, 3]
    said = [w for w in caught if "cannot fsync a directory" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "EINVAL" in str(said[0].message) and "said once" in str(said[0].message).lower()
    failing_fsync(errno.ENOTSUP)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        LocalStorage(str(tmp_path / "store")).put("other/x", b"x")
    assert not [w for w in again if "cannot fsync" in str(w.message)], "the same filesystem"


def test_a_record_written_durably_is_not_left_when_its_directory_fsync_fails(
    tmp_path: Path, failing_fsync: Callable[..., None]
) -> None:
    """A create-only write whose name could not be made durable did not happen: the name is
    removed again, and the same write succeeds once the disk does."""
    storage = LocalStorage(str(tmp_path))
    assert storage.put("records/a.json", b"{}")
    failing_fsync(errno.EIO, "/records")
    with pytest.raises(NotDurableError, match="records"):
        storage.put("records/b.json", b"{}")
    assert not storage.exists("records/b.json") and storage.exists("records/a.json")
    failing_fsync(None)
    assert storage.put("records/b.json", b"{}") and storage.get("records/b.json") == b"{}"


def test_a_failed_close_after_a_write_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A network filesystem reports a failed write-back at the close: a manifest whose close
    fails is not committed."""
    real = os.close
    failing = [False]

    def close(fd: int) -> None:
        path = _path(fd) if failing[0] else ""
        real(fd)
        if f"/{mf.MANIFEST_DIR}/" in path and not stat.S_ISDIR(os.stat(path).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "close", close)
    with small_store(str(tmp_path / "store")) as store:
        store.save(_state(1), step=1).wait()
        failing[0] = True
        with pytest.raises(NotDurableError, match="closing manifests/"):
            store.save(_state(2), step=2).wait()
        failing[0] = False
        assert store.steps() == [1]


def test_an_io_error_the_write_back_reports_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write-back a pack's deferred write starts (``sync_file_range``) reports EIO: the
    save fails then, naming the pack; an error that only says the call does not apply (EINVAL)
    leaves the write-back to the fsync."""
    codes = {"code": errno.EIO}

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
        ctypes.set_errno(codes["code"])
        return -1

    monkeypatch.setattr(durable, "_SYNC_FILE_RANGE", sync_file_range)
    with small_store(str(tmp_path / "store")) as store:
        with pytest.raises(NotDurableError, match="write-back of packs/"):
            store.save(_state(1), step=1).wait()
        assert store.steps() == []
        codes["code"] = errno.EINVAL
        store.save(_state(1), step=1).wait()
        assert store.steps() == [1]
