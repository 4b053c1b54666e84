"""A save's packs are written without waiting for the disk one by one and made durable together
before the manifest that names them (``put_parts(durable=False)`` and ``Storage.sync``).

The real local backend runs; its system calls are only observed (``os.fsync``, ``os.link``,
``os.replace``), since a machine's crash cannot be staged in a test: what must hold is the
order in which the calls reach the kernel."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.errors import StorageError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.storage.local import TMP_PREFIX, LocalStorage
from tests.conftest import assert_state_equal, small_store

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads a descriptor's path from /proc"
)


def _state(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(6000, generator=g) for i in range(n)}


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class Calls:
    """The fsyncs (by path), links and renames the process makes, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

        def fsync(fd: int) -> None:
            self.events.append(("fsync", _fd_path(fd)))
            real_fsync(fd)

        def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real_link(src, dst, *args, **kwargs)
            self.events.append(("link", os.fspath(dst)))

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("replace", os.fspath(src)))
            real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "link", link)
        monkeypatch.setattr(os, "replace", replace)

    def index(self, kind: str, path_end: str) -> int:
        """The first event of ``kind`` on a path ending in ``path_end``."""
        for i, (k, path) in enumerate(self.events):
            if k == kind and path.endswith(path_end):
                return i
        raise AssertionError(f"no {kind} of {path_end}: {self.events}")

    def count(self, kind: str, path_end: str) -> int:
        return sum(1 for k, path in self.events if k == kind and path.endswith(path_end))


@pytest.mark.parametrize("pooled", [False, True])
def test_every_pack_is_durable_before_the_manifest_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pooled: bool
) -> None:
    """Each pack file is fsynced once, and its directory, before the manifest's name appears;
    no pack write waits for the disk on its own (fsyncs a file while it is written). A member of
    a shared pool writes its packs into the pool, and syncs them there."""
    options: dict[str, Any] = {"pool": tmp_path / "pool"} if pooled else {}
    with small_store(str(tmp_path / "store"), **options) as store:
        store.save(_state(0), step=1).wait()
        calls = Calls(monkeypatch)
        store.save(_state(1), step=2).wait()
        packs = {r.pack for r in store.manifest(2).chunks.values()}
        written = [p for p in packs if calls.count("link", p)]
    assert len(written) >= 3  # this save's own packs (some may be step 1's)
    committed = calls.index("link", mf.manifest_path(2))
    for pack in written:
        assert calls.count("fsync", pack) == 1, pack
        assert calls.index("fsync", pack) < committed
        assert calls.index("fsync", os.path.dirname(pack)) < committed
        assert calls.index("link", pack) < calls.index("fsync", pack)  # synced after written
    tmp_syncs = [p for k, p in calls.events if k == "fsync" and f"/{mf.PACK_DIR}/" in p]
    assert not [p for p in tmp_syncs if os.path.basename(p).startswith(TMP_PREFIX)]


def test_an_object_replaced_is_replaced_only_by_a_durable_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack written again over one of the same name (the old one may be a committed
    checkpoint's) is fsynced before it takes the name, deferred or not."""
    storage = LocalStorage(str(tmp_path))
    path = mf.pack_path("ab" * 16)
    assert storage.put_parts(path, [b"one"], durable=False)
    calls = Calls(monkeypatch)
    assert storage.put_parts(path, [b"one"], overwrite=True, durable=False)
    renamed = calls.index("replace", "")
    tmp = calls.events[renamed][1]
    assert calls.index("fsync", tmp) < renamed
    assert storage.get(path) == b"one"
    assert not storage.put_parts(path, [b"one"], durable=False)  # create-only as ever
    storage.sync([path])
    assert calls.count("fsync", path) == 1


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failed_sync_fails_the_save_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The disk reports the error of a write back at the sync (EIO; ENOSPC on a thin volume):
    the save fails with an error that says so, is not committed, and the next one works."""
    real_fsync = os.fsync
    failing = [False]

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        if failing[0] and path.endswith(".pack") and f"/{mf.PACK_DIR}/" in path:
            raise OSError(code, os.strerror(code), path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with small_store(str(tmp_path / "store")) as store:
        store.save(_state(0), step=1).wait()
        failing[0] = True
        with pytest.raises(StorageError) as raised:
            store.save(_state(1), step=2).wait()
        said = "disk full" if code == errno.ENOSPC else "failed (EIO"
        assert said in str(raised.value) and "fsync of packs/" in str(raised.value)
        assert "previous checkpoint is intact" in str(raised.value)
        assert store.steps() == [1]
        failing[0] = False
        store.save(_state(1), step=2).wait()
    with CheckpointStore(str(tmp_path / "store")) as fresh:
        assert fresh.steps() == [1, 2]
        assert_state_equal(fresh.load(1), _state(0))
        assert_state_equal(fresh.load(2), _state(1))
        assert fresh.verify(2).ok


class _SlowSync(LocalStorage):
    """A disk that takes its time to make written files durable (the writes return at once)."""

    def __init__(self, root: str, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.synced = 0

    def sync(self, paths: Any) -> None:
        time.sleep(self.delay_s)
        self.synced += len(paths)
        super().sync(paths)


def test_the_pacer_learns_the_writers_rate_to_durable_not_to_the_page_cache(
    tmp_path: Path,
) -> None:
    """The writers' rate that paces a save counts each pack's share of the sync: a disk that
    takes the writes at once and is slow to make them durable is slow."""
    storage = _SlowSync(str(tmp_path / "store"), delay_s=0.5)
    with small_store(storage, codec_effort="auto", workers=2) as store:
        result = store.save(_state(0, n=12), step=1).wait()
        pacer = store._committer.pacer
        assert pacer is not None and pacer.write_bps is not None
        assert storage.synced == result.objects_written
        # two writers, each 0.5 s asleep in its share of the sync
        assert pacer.write_bps <= result.bytes_written / 0.5
        assert result.write_s >= 0.5


def test_a_save_held_in_its_sync_is_not_committed_until_the_sync_ends(tmp_path: Path) -> None:
    """The packs' sync holds the commit: while it waits, every pack is written and the step is
    not visible; a sync that then fails fails the save (the fault fires at the sync, through a
    wrapper storage as through the local one)."""
    import threading

    from lightning_incremental.core.storage import open_storage
    from tests.faulty import FaultyStorage

    class Watched(FaultyStorage):
        syncing = threading.Event()

        def sync(self, paths: Any) -> None:
            self.syncing.set()
            super().sync(paths)  # held by the gate

    url = str(tmp_path / "store")
    faulty = Watched(open_storage(url, None))
    with small_store(faulty) as store:
        store.save(_state(0), step=1).wait()
        gate = faulty.hold("pack", op="sync")
        faulty.syncing.clear()
        handle = store.save(_state(1), step=2)
        assert faulty.syncing.wait(30)  # the writes ended; the sync waits
        time.sleep(0.2)
        assert not os.path.exists(os.path.join(url, mf.manifest_path(2)))
        assert not handle.done()
        gate.set()
        assert handle.wait().step == 2
        faulty.clear()
        faulty.fail("pack", op="sync", nth=2)
        with pytest.raises(StorageError, match="injected fault"):
            store.save(_state(2), step=3).wait()
        assert store.steps() == [1, 2]
        faulty.clear()
        store.save(_state(2), step=3).wait()
        assert_state_equal(store.load(3), _state(2))


def test_the_directories_a_first_save_creates_are_made_durable_once_before_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new store's first save creates ``packs/`` and a directory in it per pack prefix: the
    names are made durable by a few fsyncs of ``packs/`` (one per writer's share of the sync),
    not one per directory created, and before the manifest's name appears."""
    root = str(tmp_path / "store")
    calls = Calls(monkeypatch)
    with small_store(root) as store:
        store.save(_state(0, n=24), step=1).wait()
        packs = {r.pack for r in store.manifest(1).chunks.values()}
    created = {os.path.dirname(p) for p in packs}
    assert len(created) >= 10
    packs_dir = os.path.join(root, mf.PACK_DIR)
    syncs = [i for i, (k, p) in enumerate(calls.events) if k == "fsync" and p == packs_dir]
    assert 1 <= len(syncs) <= 3
    committed = calls.index("link", mf.manifest_path(1))
    assert syncs[0] < committed
    root_syncs = [i for i, (k, p) in enumerate(calls.events) if k == "fsync" and p == root]
    assert any(i < committed for i in root_syncs)  # packs/ itself, in the store's root


def test_a_new_stores_location_is_made_durable_up_to_what_existed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write into a location that does not exist yet creates it: the name of every
    level it created is made durable (the parent of the store's root too)."""
    root = str(tmp_path / "new" / "store")
    storage = LocalStorage(root)
    calls = Calls(monkeypatch)
    assert storage.put("store.json", b"{}")
    synced = {p for k, p in calls.events if k == "fsync"}
    assert {str(tmp_path), str(tmp_path / "new"), root} <= synced


def test_a_sync_makes_durable_the_directories_another_writer_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers on one location (the members of a shared pool): the second writes into a
    directory the first made with a write not synced yet. Its sync makes that directory's
    name durable (and the names above it), not only its own file and directory."""
    root = str(tmp_path / "pool")
    first, second = LocalStorage(root), LocalStorage(root)
    assert first.put_parts("packs/ab/one.pack", [b"1"], durable=False)  # never synced
    calls = Calls(monkeypatch)
    assert second.put_parts("packs/ab/two.pack", [b"2"], durable=False)
    second.sync(["packs/ab/two.pack"])
    synced = [p for k, p in calls.events if k == "fsync"]
    for directory in ("packs/ab", "packs", ""):
        assert os.path.join(root, directory).rstrip("/") in synced, directory


def test_a_pack_that_vanishes_before_its_sync_fails_the_save_naming_it(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    assert storage.put_parts("packs/ab/x.pack", [b"1"], durable=False)
    storage.delete("packs/ab/x.pack")
    with pytest.raises(StorageError, match=r"packs/ab/x.pack .* vanished .* grace"):
        storage.sync(["packs/ab/x.pack"])


def test_a_backend_that_cannot_sync_gets_every_pack_durable(tmp_path: Path) -> None:
    """A backend of its own whose ``put_parts`` predates ``durable`` (and has no ``sync``)
    saves as it did: its packs are written durable, never with an argument it does not take."""

    class Older(LocalStorage):
        def put_parts(self, path: str, parts: Any, *, overwrite: bool = False) -> bool:
            return super().put_parts(path, parts, overwrite=overwrite)

        sync = Storage.sync  # type: ignore[assignment]

    storage = Older(str(tmp_path / "store"))
    with small_store(storage) as store:
        store.save(_state(0), step=1).wait()
        assert_state_equal(store.load(1), _state(0))


def test_a_durable_write_waits_for_the_directories_another_thread_is_making_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one thread fsyncs the parents of directories deferred writes created, a durable
    write on another thread does not return (as if those names were durable already) before
    that fsync ends: the manifest's write must not overtake the packs' directories."""
    import threading

    root = str(tmp_path / "store")
    storage = LocalStorage(root)
    assert storage.put_parts("packs/ab/x.pack", [b"1"], durable=False)  # packs/ab: pending
    packs_dir = os.path.join(root, mf.PACK_DIR)
    entered, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if _fd_path(fd) == packs_dir and not release.is_set():
            entered.set()
            assert release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    first = threading.Thread(target=storage.put, args=("manifests/a.json", b"a"))
    first.start()
    assert entered.wait(30)  # its write is in the fsync of packs/ (the name of packs/ab)
    second = threading.Thread(target=storage.put, args=("manifests/b.json", b"b"))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "returned before packs/ab's name was durable"
    release.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert storage.get("manifests/b.json") == b"b"
