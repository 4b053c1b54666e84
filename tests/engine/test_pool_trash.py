"""The pool's collection through its trash: an object a member writes again while the collection
moves it stays readable, is put back by the next collection and never purged while named;
unreferenced trash is purged after the minimum age; a collection stopped between the steps of a
move or a restore loses nothing; a trash that cannot be listed stops the collection."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from lightning_incremental.core import CheckpointStore, StorageError
from lightning_incremental.core.maintain.pool import open_location
from lightning_incremental.core.maintain.pool_gc import MOVED, collect_pool
from lightning_incremental.core.storage import (
    LocalStorage,
    Storage,
    register_scheme,
    unregister_scheme,
)
from lightning_incremental.core.storage.linked import TRASH_DIR, LinkedStorage, trash_path
from tests.conftest import assert_state_equal
from tests.faulty import FaultyStorage, unreadable_directories

OPTIONS: dict[str, Any] = {"chunk_size": 4096, "fsync": False, "min_object_age_s": 0.0}
LONG_AGO = 1e9
SCHEME = "litrash"  # the pool through a wrapper: no rename, so moves copy then delete


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    # every tensor differs by seed: a seed's objects are its own (no pack shared with another)
    return {
        "model": {"w": torch.randn(64, 256, generator=g), "b": torch.full((16,), float(seed))},
        "step": 0,
    }


def files(root: Path, under: str) -> set[str]:
    base = root / under
    if not base.exists():
        return set()
    return {str(p.relative_to(root)).replace(os.sep, "/") for p in base.rglob("*") if p.is_file()}


def age(root: Path) -> None:
    """Time passes: every file of the pool is older than any minimum age."""
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (LONG_AGO, LONG_AGO))


class Wrapped(FaultyStorage):
    """The pool's storage through a wrapper (no rename); ``hooks`` run once, by (op, path)."""

    hooks: ClassVar[dict[tuple[str, str], Callable[[], None]]] = {}

    def put(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> bool:
        self._hook("put", path)
        return super().put(path, data, overwrite=overwrite)

    def delete(self, path: str) -> None:
        self._hook("delete", path)
        super().delete(path)

    def _hook(self, op: str, path: str) -> None:
        hook = Wrapped.hooks.pop((op, path), None)
        if hook is not None:
            hook()


@pytest.fixture
def wrapped() -> Iterator[None]:
    def factory(url: str, options: dict[str, Any]) -> Storage:
        storage = Wrapped(LocalStorage(url.partition("://")[2], fsync=False))
        storage.url = url
        return storage

    register_scheme(SCHEME, factory)
    Wrapped.hooks = {}
    try:
        yield
    finally:
        Wrapped.hooks = {}
        unregister_scheme(SCHEME)


def pool_url(tmp_path: Path, how: str) -> str:
    return f"{SCHEME}://{tmp_path / 'pool'}" if how == "copy" else str(tmp_path / "pool")


def garbage(tmp_path: Path, url: str, seed: int = 0) -> set[str]:
    """A member saves ``state(seed)`` and deletes it: its objects are unreferenced."""
    with CheckpointStore(tmp_path / f"gone{seed}", pool=url, **OPTIONS) as store:
        store.save(state(seed), 1).wait()
        named = set(store.manifest(1).packs)
        store.delete(1)
    return named


@contextmanager
def after_age_check(target: str, hook: Callable[[], None]) -> Iterator[None]:
    """Run ``hook`` once, right after the collection reads the age of ``target`` (before it
    removes it), on the collection's thread."""
    real = LocalStorage.mtime
    armed = [True]

    def mtime(self: LocalStorage, path: str) -> float | None:
        found = real(self, path)
        if path == target and armed:
            armed.clear()
            hook()
        return found

    LocalStorage.mtime = mtime  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStorage.mtime = real  # type: ignore[method-assign]


@pytest.mark.parametrize("how", ["rename", "copy"])
def test_a_save_between_the_age_check_and_the_removal_keeps_its_object(
    how: str, tmp_path: Path, wrapped: None, caplog: pytest.LogCaptureFixture
) -> None:
    pool, url = tmp_path / "pool", pool_url(tmp_path, how)
    objects = garbage(tmp_path, url)
    age(pool)
    target = sorted(objects)[0]
    checked, go = threading.Event(), threading.Event()
    reports: list[Any] = []
    errors: list[BaseException] = []

    def pause() -> None:  # the collection has found the object old; it waits to remove it
        checked.set()
        assert go.wait(60)

    def collect() -> None:
        try:
            reports.append(collect_pool(url, min_age_s=900.0))
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    with after_age_check(target, pause):
        collector = threading.Thread(target=collect, name="pool-gc")
        collector.start()
        assert checked.wait(60)
        with CheckpointStore(tmp_path / "b", pool=url, **OPTIONS) as b:  # the same bytes again
            b.save(state(), 7).wait()
            assert target in b.manifest(7).packs
        go.set()
        collector.join(60)
    assert not errors and reports
    assert reports[0].removed_objects == [target]  # the others were young: written again
    with CheckpointStore(tmp_path / "b") as b, caplog.at_level(logging.WARNING):
        assert_state_equal(b.load(7), state())
        assert b.verify(7).ok
        assert isinstance(b.storage, LinkedStorage) and target in b.storage.in_trash
    assert f"object {target} is intact in the trash" in caplog.text
    assert not (pool / target).exists() and (pool / trash_path(target)).exists()

    age(pool)  # past the minimum age: the entry would be purged if nothing named it
    report = collect_pool(url, min_age_s=900.0)
    assert report.restored_objects == [target] and report.purged_objects == []
    assert (pool / target).exists() and files(pool, TRASH_DIR) == set()
    with CheckpointStore(tmp_path / "b") as b:
        assert b.verify(7).ok
        assert_state_equal(b.load(7), state())


def test_unreferenced_trash_is_purged_after_the_minimum_age(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    with CheckpointStore(tmp_path / "keep", pool=pool, **OPTIONS) as keep:
        keep.save(state(1), 1).wait()
    objects = garbage(tmp_path, str(pool))
    sizes = {p: (pool / p).stat().st_size for p in objects}
    age(pool)
    first = collect_pool(pool, min_age_s=900.0)
    assert set(first.removed_objects) == objects and first.bytes_moved == sum(sizes.values())
    assert first.purged_objects == [] and first.bytes_freed == 0
    assert {trash_path(p) for p in objects} | {trash_path(p) + MOVED for p in objects} == files(
        pool, TRASH_DIR
    )
    again = collect_pool(pool, min_age_s=900.0)  # the entries are young: nothing purged
    assert again.purged_objects == [] and again.removed_objects == []
    age(pool)
    dry = collect_pool(pool, min_age_s=900.0, dry_run=True)
    assert set(dry.purged_objects) == objects and dry.bytes_freed == sum(sizes.values())
    assert len(files(pool, TRASH_DIR)) == 2 * len(objects), "a dry run purged"
    last = collect_pool(pool, min_age_s=900.0)
    assert set(last.purged_objects) == objects and last.bytes_freed == sum(sizes.values())
    assert files(pool, TRASH_DIR) == set()
    with CheckpointStore(tmp_path / "keep") as keep:
        assert keep.verify(1).ok


def test_a_named_trash_entry_is_put_back_and_an_unmarked_one_is_marked(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as a:
        a.save(state(1), 1).wait()
        named = sorted(a.manifest(1).packs)
    loose = sorted(garbage(tmp_path, str(pool)))
    for path in (named[0], loose[0]):  # moved by a collection that stopped before its marker
        (pool / trash_path(path)).parent.mkdir(parents=True, exist_ok=True)
        os.replace(pool / path, pool / trash_path(path))
    age(pool)
    with CheckpointStore(tmp_path / "a") as a:  # loads meanwhile, from the trash
        assert_state_equal(a.load(1), state(1))
        assert a.storage.where(named[0]) == f"{pool}/{TRASH_DIR}"  # type: ignore[attr-defined]
    dry = collect_pool(pool, min_age_s=900.0, dry_run=True)
    assert dry.restored_objects == [named[0]] and dry.purged_objects == []
    assert not (pool / named[0]).exists(), "a dry run restored"
    report = collect_pool(pool, min_age_s=900.0)
    assert report.restored_objects == [named[0]] and report.purged_objects == []
    assert (pool / named[0]).exists() and not (pool / trash_path(named[0])).exists()
    # The unnamed one left packs/ at some time before: it is marked now, purged an age later.
    assert (pool / (trash_path(loose[0]) + MOVED)).exists()
    assert loose[0] not in report.purged_objects
    age(pool)
    assert loose[0] in collect_pool(pool, min_age_s=900.0).purged_objects
    with CheckpointStore(tmp_path / "a") as a:
        assert a.verify(1).ok


def test_a_collection_stopped_between_copy_and_delete_loses_nothing(
    tmp_path: Path, wrapped: None
) -> None:
    pool, url = tmp_path / "pool", pool_url(tmp_path, "copy")
    objects = garbage(tmp_path, url)
    target = sorted(objects)[0]
    age(pool)

    def crash() -> None:
        raise StorageError(5, "injected: the collection stopped between copy and delete")

    def resave() -> None:  # a member writes the object again, and commits
        with CheckpointStore(tmp_path / "b", pool=url, **OPTIONS) as b:
            b.save(state(), 7).wait()

    Wrapped.hooks[("delete", target)] = crash
    with after_age_check(target, resave), pytest.raises(StorageError, match="injected"):
        collect_pool(url, min_age_s=900.0)
    assert (pool / target).exists() and (pool / trash_path(target)).exists()
    with CheckpointStore(tmp_path / "b") as b:
        assert b.verify(7).ok
    age(pool)
    report = collect_pool(url, min_age_s=900.0)  # the copy without a marker stays, unharmed
    assert report.purged_objects == [] and report.removed_objects == []
    with CheckpointStore(tmp_path / "b") as b:
        b.delete(7)  # now nothing names it: it is moved over the entry, then purged
    age(pool)
    assert target in collect_pool(url, min_age_s=900.0).removed_objects
    assert not (pool / target).exists()
    age(pool)
    assert target in collect_pool(url, min_age_s=900.0).purged_objects
    assert not (pool / trash_path(target)).exists()


@pytest.mark.parametrize("stop", ["marker", "restore"])
def test_a_collection_stopped_after_a_move_or_in_a_restore_loses_nothing(
    stop: str, tmp_path: Path, wrapped: None
) -> None:
    pool, url = tmp_path / "pool", pool_url(tmp_path, "copy")
    target = sorted(garbage(tmp_path, url))[0]
    age(pool)

    def crash() -> None:
        raise StorageError(5, f"injected: the collection stopped at the {stop}")

    def resave() -> None:
        with CheckpointStore(tmp_path / "b", pool=url, **OPTIONS) as b:
            b.save(state(), 7).wait()

    if stop == "marker":  # moved, its marker never written
        Wrapped.hooks[("put", trash_path(target) + MOVED)] = crash
        with after_age_check(target, resave), pytest.raises(StorageError, match="injected"):
            collect_pool(url, min_age_s=900.0)
    else:  # the next collection writes packs/ back, then stops before dropping the entry
        with after_age_check(target, resave):
            collect_pool(url, min_age_s=900.0)
        Wrapped.hooks[("delete", trash_path(target))] = crash
        age(pool)
        with pytest.raises(StorageError, match="injected"):
            collect_pool(url, min_age_s=900.0)
        assert (pool / target).exists()
    assert (pool / trash_path(target)).exists()
    with CheckpointStore(tmp_path / "b") as b:
        assert b.verify(7).ok
        assert_state_equal(b.load(7), state())
    age(pool)
    report = collect_pool(url, min_age_s=900.0)
    assert report.restored_objects == [target] and report.purged_objects == []
    assert (pool / target).exists() and files(pool, TRASH_DIR) == set()
    with CheckpointStore(tmp_path / "b") as b:
        assert b.verify(7).ok


def test_a_trash_that_cannot_be_listed_stops_the_collection(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    garbage(tmp_path, str(pool), seed=1)
    age(pool)
    collect_pool(pool, min_age_s=900.0)  # into the trash
    garbage(tmp_path, str(pool), seed=2)
    age(pool)  # old garbage in packs/ and old entries in the trash
    before = files(pool, "packs") | files(pool, TRASH_DIR)
    with unreadable_directories(str(pool / TRASH_DIR)) as failed:
        with pytest.raises(OSError):
            collect_pool(pool, min_age_s=900.0)
    assert failed
    assert files(pool, "packs") | files(pool, TRASH_DIR) == before


def test_member_gc_leaves_the_trash_alone(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    garbage(tmp_path, str(pool))
    age(pool)
    collect_pool(pool, min_age_s=900.0)
    trash = files(pool, TRASH_DIR)
    assert trash
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as a:
        a.save(state(3), 1).wait()
        a.save(state(4), 2).wait()
        a.gc(keep_last=1)
    assert files(pool, TRASH_DIR) == trash
    assert isinstance(open_location(str(pool), None), LocalStorage)


def test_a_save_racing_the_collection_keeps_its_object_on_s3(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The same race with the pool in S3 (no rename: copy, then delete); S3 ages cannot be set,
    so the objects of the deleted step read as old while unchanged."""
    from tests.conftest import backend_url

    s3 = pytest.importorskip("lightning_incremental.core.storage.s3")
    with backend_url("s3", request, tmp_path) as root:
        url = f"{root}/pool"
        pool = open_location(url, None)
        objects = garbage(tmp_path, url)
        written = {path: pool.mtime(path) for path in objects}
        target = sorted(objects)[0]
        real = s3.S3Storage.mtime
        armed = [True]

        def mtime(self: Any, path: str) -> float | None:
            found = real(self, path)
            if path == target and armed:
                armed.clear()  # found old; a member writes it again and commits, then it goes
                with CheckpointStore(tmp_path / "b", pool=url, **OPTIONS) as b:
                    b.save(state(), 7).wait()
            unchanged = found is not None and written.get(path) == found
            return found - 10_000 if unchanged and found is not None else found

        s3.S3Storage.mtime = mtime
        try:
            first = collect_pool(url, min_age_s=900.0)
            assert target in first.removed_objects
            with CheckpointStore(tmp_path / "b") as b:
                assert_state_equal(b.load(7), state())
                assert b.verify(7).ok
            assert not pool.exists(target) and pool.exists(trash_path(target))
            second = collect_pool(url, min_age_s=900.0)
            assert set(second.restored_objects) == set(first.removed_objects)
            assert second.purged_objects == [] and pool.list(TRASH_DIR) == []
        finally:
            s3.S3Storage.mtime = real  # type: ignore[method-assign]
        with CheckpointStore(tmp_path / "b") as b:
            assert b.verify(7).ok
