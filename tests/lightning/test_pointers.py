"""Pointer files through Storage: written, read, listed and removed by the backend of their
directory, on every backend a store works on (local disk, fsspec's memory://, S3 on moto, a
third-party backend), in the unchanged format whose first bytes stop ``torch.load``/pickle.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import StorageError
from lightning_incremental.core.storage import TMP_PREFIX, open_storage
from lightning_incremental.core.storage import local as local_backend
from lightning_incremental.lightning.pointers import (
    HEAD_BYTES,
    HEADER,
    MAX_POINTER_BYTES,
    CheckpointFile,
    NotATorchCheckpointError,
    Pointer,
    Writer,
)
from tests.conftest import assert_state_equal, backend_url


@pytest.fixture(params=["local", "memory", "s3", "plugin"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A directory for checkpoint files on each backend."""
    with backend_url(request.param, request, tmp_path) as url:
        yield f"{url}/ckpts"


def pointer(step: int, previous: int | None = None) -> Pointer:
    return Pointer(
        ".incremental",
        step,
        uuid.uuid4().hex,
        global_step=10 * step,
        epoch=1,
        previous=previous,
        previous_id=None if previous is None else uuid.uuid4().hex,
        writer=Writer.this_process(),
    )


def test_write_read_replace_remove(where: str) -> None:
    file = CheckpointFile.of(f"{where}/a.ckpt", None, resolve=False)
    assert file.head() is None and not file.isdir()
    with pytest.raises(FileNotFoundError):
        file.read()
    first, second = pointer(3), pointer(4, previous=3)
    file.write_atomic(first.dumps(), fsync=True)
    assert file.read() == first.dumps(), "the bytes are the format's, unchanged"
    assert file.head() == first.dumps()[:HEAD_BYTES]
    assert Pointer.parse(file.read(), file.display) == first
    file.write_atomic(second.dumps(), fsync=False)
    assert Pointer.parse(file.read(), file.display) == second
    assert open_storage(where, None).listdir("") == ["a.ckpt"], "no temporary object is left"
    file.remove()
    assert file.head() is None
    file.remove()  # removing a missing file is fine


def test_the_header_stops_unpickling(where: str) -> None:
    file = CheckpointFile.of(f"{where}/a.ckpt", None, resolve=False)
    file.write_atomic(pointer(0).dumps(), fsync=True)
    data = file.read()
    assert data.startswith(HEADER)
    with pytest.raises(NotATorchCheckpointError, match="lightning-incremental pointer file"):
        pickle.loads(data)  # the header only raises
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(io.BytesIO(data), weights_only=True)


def test_siblings_are_the_readable_pointer_files(where: str) -> None:
    a = CheckpointFile.of(f"{where}/a.ckpt", None, resolve=False)
    b = CheckpointFile.of(f"{where}/b.ckpt", None, resolve=False)
    pa, pb = pointer(1), pointer(2, previous=1)
    a.write_atomic(pa.dumps(), fsync=True)
    b.write_atomic(pb.dumps(), fsync=True)
    directory = open_storage(where, None)
    directory.put("plain.ckpt", b"PK\x03\x04" + bytes(MAX_POINTER_BYTES + 10))  # torch.save
    directory.put("notes.json", b'{"format": "something else"}')
    directory.put("broken.ckpt", HEADER[:20])
    stale = pointer(9).dumps()  # temporary files of interrupted writes name nothing
    directory.put(f".a.ckpt.{uuid.uuid4().hex}.li-tmp", stale)
    directory.put(f"{TMP_PREFIX}{uuid.uuid4().hex}", stale)
    store = open_storage(a.store_url(".incremental"), None)
    store.put("packs/ab/obj", stale)  # the store next to them: not listed
    assert sorted(p.step for p in a.siblings()) == [1, 2]
    assert a.sibling_pointers() == {(".incremental", 1), (".incremental", 2)}
    assert set(a.siblings()) == {pa, pb}


def test_store_next_to_the_file(where: str) -> None:
    file = CheckpointFile.of(f"{where}/a.ckpt", None, resolve=False)
    url = file.store_url(".incremental")
    assert url.rstrip("/").endswith("/ckpts/.incremental")
    assert CheckpointFile.of(f"{where}/a.ckpt", None, resolve=False).key == file.key
    assert ".incremental" not in file.parts and "ckpts" in file.parts
    open_storage(url, None).put("manifests/0.json", b"{}")
    assert open_storage(where, None).list(".incremental") == [".incremental/manifests/0.json"]
    store_dir = CheckpointFile.of(f"{where}/.incremental", None, resolve=True)
    assert store_dir.isdir() and store_dir.head() is None
    assert not file.isdir() and not CheckpointFile.of(f"{where}/none", None, resolve=True).isdir()
    file.write_atomic(pointer(0).dumps(), fsync=True)
    assert not file.isdir()


def test_a_path_must_name_a_file(where: str) -> None:
    with pytest.raises(ValueError, match="must name a file"):
        CheckpointFile.of(f"{where}/", None, resolve=False)


# ------------------------------------------------------------------------------ local disks


def test_local_write_is_fsynced_with_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    file = CheckpointFile.of(str(tmp_path / "a.ckpt"), None, resolve=False)
    file.write_atomic(pointer(0).dumps(), fsync=True)
    assert len(synced) >= 2, "the file and its directory"
    synced.clear()
    file.write_atomic(pointer(1).dumps(), fsync=False)
    assert synced == []


def test_a_failed_local_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = CheckpointFile.of(str(tmp_path / "a.ckpt"), None, resolve=False)
    old = pointer(0).dumps()
    file.write_atomic(old, fsync=True)

    def fail(src: str, dst: str) -> None:
        raise PermissionError(13, "simulated", dst)

    monkeypatch.setattr(local_backend.os, "replace", fail)
    with pytest.raises(StorageError, match="simulated"):
        file.write_atomic(pointer(1).dumps(), fsync=True)
    monkeypatch.undo()
    assert file.read() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


def test_local_links(tmp_path: Path) -> None:
    target = CheckpointFile.of(str(tmp_path / "epoch=1.ckpt"), None, resolve=False)
    target.write_atomic(pointer(1).dumps(), fsync=True)
    os.symlink(tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt")
    link = CheckpointFile.of(str(tmp_path / "last.ckpt"), None, resolve=False)
    assert link.islink() and not target.islink()
    assert Pointer.parse(link.read(), link.display).step == 1
    assert CheckpointFile.of(str(tmp_path / "last.ckpt"), None, resolve=True).key == target.key
    assert len(link.siblings()) == 2  # the link reads as the file it names
    link.remove()
    assert not (tmp_path / "last.ckpt").exists() and target.head() is not None
    dangling = tmp_path / "gone.ckpt"
    os.symlink(tmp_path / "nothing", dangling)
    assert [p.step for p in target.siblings()] == [1]


# ------------------------------------------------------------------------------ the plug-in


def test_the_lightning_plugin_on_a_third_party_backend(tmp_path: Path, request) -> None:
    """IncrementalCheckpointIO saves, overwrites, loads and removes checkpoint files on a
    backend that is none of this library's own (tests/storage_plugin.py)."""
    from lightning_incremental.core import CheckpointStore
    from lightning_incremental.lightning.checkpoint_io import IncrementalCheckpointIO

    def state(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {
            "epoch": 0,
            "global_step": seed,
            "state_dict": {"w": torch.randn(32, 32, generator=g)},
        }

    with backend_url("plugin", request, tmp_path) as root:
        plugin = IncrementalCheckpointIO()
        plugin.save_checkpoint(state(0), f"{root}/a.ckpt")
        plugin.save_checkpoint(state(1), f"{root}/a.ckpt")
        plugin.save_checkpoint(state(2), f"{root}/b.ckpt")
        plugin.remove_checkpoint(f"{root}/b.ckpt")
        plugin.wait()
        assert open_storage(root, None).listdir("") == ["a.ckpt"]
        with CheckpointStore(f"{root}/.incremental") as store:
            assert store.steps() == [1]
        assert_state_equal(plugin.load_checkpoint(f"{root}/a.ckpt"), state(1))
        plugin.teardown()
