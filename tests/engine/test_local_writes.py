"""The local backend's writes: many parts in few system calls, every byte in place whatever the
kernel takes per call, and a failed write that leaves nothing behind."""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np
import pytest

from lightning_incremental.core.errors import StorageError
from lightning_incremental.core.storage import local
from lightning_incremental.core.storage.local import IOV_MAX, LocalStorage, write_parts


def _parts(n: int) -> list[Any]:
    rng = np.random.default_rng(n)
    parts: list[Any] = []
    for i in range(n):
        if i % 7 == 3:
            parts.append(b"")  # empty parts are legal and skipped
        elif i % 5 == 0:
            parts.append(memoryview(rng.standard_normal(i % 9 + 1).astype(np.float32)))
        else:
            parts.append(rng.bytes(i % 4097 + 1))
    return parts


def _joined(parts: list[Any]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def test_a_pack_of_thousands_of_parts_takes_few_system_calls(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``writev`` per :data:`IOV_MAX` parts, not one ``write`` per part (a pack of
    thousands of small tensors: 6 ms of calls in place of 1.2)."""
    calls: list[int] = []
    real_writev, real_write = os.writev, os.write

    def writev(fd: int, buffers: Any) -> int:
        calls.append(len(buffers))
        return real_writev(fd, buffers)

    def write(fd: int, data: Any) -> int:
        calls.append(1)
        return real_write(fd, data)

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "write", write)
    parts = _parts(3 * IOV_MAX)
    LocalStorage(str(tmp_path)).put_parts("packs/aa/x.pack", parts)
    monkeypatch.undo()
    assert len(calls) <= 3, calls
    assert (tmp_path / "packs/aa/x.pack").read_bytes() == _joined(parts)


@pytest.mark.parametrize("most", [1, 7, 4096, 100_000])
def test_short_writes_go_on_from_the_first_byte_not_written(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, most: int
) -> None:
    """The kernel may take fewer bytes than asked (a signal; 2 GiB at most a call): the rest,
    from inside a part, goes in the next call."""
    real_writev = os.writev

    def short(fd: int, buffers: Any) -> int:
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:most]
        return real_writev(fd, [data])

    monkeypatch.setattr(os, "writev", short)
    parts = _parts(300)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        write_parts(fd, parts)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == _joined(parts)


def test_a_call_that_takes_nothing_is_an_error_not_a_loop(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "writev", lambda fd, buffers: 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="no byte"):
            write_parts(fd, [b"abc"])
    finally:
        os.close(fd)


def test_a_full_disk_during_the_writes_leaves_no_temporary_and_names_the_problem(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev
    seen = []

    def full(fd: int, buffers: Any) -> int:
        if seen:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        seen.append(1)
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", full)
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(StorageError, match="disk full") as raised:
        storage.put_parts("packs/ab/y.pack", _parts(2 * IOV_MAX + 5))
    assert raised.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path / "packs/ab") == []
    monkeypatch.undo()
    assert storage.put_parts("packs/ab/y.pack", [b"x"])  # works again


def test_without_writev_each_part_is_written_whole(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "writev")
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:3]))
    parts = _parts(40)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        local.write_parts(fd, parts)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == _joined(parts)


def test_a_system_without_a_stated_iov_limit_writes_sixteen_parts_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sysconf", lambda name: -1)  # "no limit stated"
    assert local._iov_max() == 16


def test_an_empty_part_of_any_shape_is_skipped_without_writev(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "writev")
    parts = [b"ab", memoryview(np.empty((0, 5), dtype=np.float32)), b"cd"]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        local.write_parts(fd, parts)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"abcd"
