"""A shared object pool and forks: objects written once across stores, membership recorded in
the store, member gc that never deletes the pool's objects, a pool gc that marks from every
member and refuses when one cannot be read, and forks that reference their source's objects
under a pin the source's retention honours."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError, CorruptCheckpointError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.pins import read_pins
from lightning_incremental.core.maintain.pool import leave, unpin
from lightning_incremental.core.maintain.pool_gc import PoolMemberError, collect_pool
from lightning_incremental.core.storage import LocalStorage, register_scheme, unregister_scheme
from lightning_incremental.core.storage.linked import OBJECT_DIR
from tests.conftest import assert_state_equal
from tests.faulty import unreadable_directories

OPTIONS: dict[str, Any] = {"chunk_size": 4096, "fsync": False, "min_object_age_s": 0.0}


def packs(root: Path) -> set[str]:
    base = root / "packs"
    if not base.exists():
        return set()
    return {str(p.relative_to(root)).replace(os.sep, "/") for p in base.rglob("*.pack")}


def base_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"backbone": torch.randn(64, 256, generator=g), "head": torch.zeros(16)},
        "step": 0,
    }


def train(state: dict[str, Any], step: int) -> dict[str, Any]:
    """A deterministic update of the head only (the backbone is frozen), plus an optimizer."""
    head = state["model"]["head"] + torch.arange(16, dtype=torch.float32) * 0.01 * (step + 1)
    return {
        "model": {"backbone": state["model"]["backbone"], "head": head},
        "optim": {"m": head * 0.9},
        "step": step,
    }


def test_layout_constant_matches() -> None:
    assert OBJECT_DIR == mf.PACK_DIR


def test_members_write_shared_objects_once_and_reopen_without_the_pool(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    state = base_state()
    for name in ("a", "b"):
        with CheckpointStore(tmp_path / name, pool=pool, **OPTIONS) as store:
            store.save(state, 1).wait()
    assert packs(tmp_path / "a") == packs(tmp_path / "b") == set()
    written = packs(pool)
    assert written, "the objects are in the pool"
    # Both saved the same bytes: one copy.
    size = sum((pool / p).stat().st_size for p in written)
    assert size < 1.2 * state["model"]["backbone"].nbytes
    with CheckpointStore(tmp_path / "b") as again:  # no pool argument: recorded in the store
        assert_state_equal(again.load(), state)
        assert again.verify().ok
    with pytest.raises(ConfigError, match="not in the pool"):
        CheckpointStore(tmp_path / "a", pool=tmp_path / "other")
    with CheckpointStore(tmp_path / "plain", **OPTIONS) as plain:
        plain.save(state, 1).wait()
    with pytest.raises(ConfigError, match="cannot join the pool"):
        CheckpointStore(tmp_path / "plain", pool=pool)


def test_member_gc_never_deletes_pool_objects_pool_gc_does(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    state = base_state()
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as a:
        for step in range(1, 4):
            state = train(state, step)
            a.save(state, step).wait()
        before = packs(pool)
        a.gc(keep_last=1)
        assert a.steps() == [3]
        assert packs(pool) == before, "a member's gc leaves the pool alone"
    with CheckpointStore(tmp_path / "b", pool=pool, **OPTIONS) as b:
        b.save(base_state(), 1).wait()
    report = collect_pool(pool, min_age_s=0.0)
    assert sorted(report.members) == sorted(str(tmp_path / n) for n in ("a", "b"))
    assert report.removed_objects and set(report.removed_objects) < before
    for name, step in (("a", 3), ("b", 1)):
        with CheckpointStore(tmp_path / name) as store:
            assert store.verify(step).ok
    with CheckpointStore(tmp_path / "a") as a:
        assert_state_equal(a.load(), state)


def test_pool_gc_is_refused_while_a_member_cannot_be_read(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    state = base_state()
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as a:
        a.save(state, 1).wait()
    with CheckpointStore(tmp_path / "b", pool=pool, **OPTIONS) as b:
        b.save(train(state, 2), 2).wait()
    before = packs(pool)
    with unreadable_directories(str(tmp_path / "b" / "manifests")) as failed:
        with pytest.raises(PoolMemberError, match="deleted nothing"):
            collect_pool(pool, min_age_s=0.0)
    assert failed
    assert packs(pool) == before
    shutil.rmtree(tmp_path / "b")  # a member deleted without leaving: its references unknown
    with pytest.raises(PoolMemberError, match="cannot be read"):
        collect_pool(pool, min_age_s=0.0)
    assert packs(pool) == before


def test_fork_references_the_source_and_survives_its_gc(tmp_path: Path) -> None:
    src, dst, twin = tmp_path / "src", tmp_path / "fork", tmp_path / "twin"
    state = base_state()
    with CheckpointStore(src, **OPTIONS) as store:
        for step in range(1, 4):
            state = train(state, step)
            store.save(state, step).wait()
        at2 = store.load(2)
    assert CheckpointStore.fork(str(src), str(dst), 2) == 2
    assert packs(dst) == set(), "the fork copies no object"
    [pin] = read_pins(LocalStorage(str(src)))
    assert (pin.step, pin.by) == (2, str(dst))
    # The fork resumes from step 2 as the source itself would.
    with CheckpointStore(dst, **OPTIONS) as fork:
        assert fork.steps() == [2]
        resumed = fork.load()
        assert_state_equal(resumed, at2)
        result = fork.save(train(resumed, 3), 3).wait()
        assert result.bytes_written < at2["model"]["backbone"].nbytes // 4
    with CheckpointStore(twin, **OPTIONS) as reference:
        reference.save(train(at2, 3), 3).wait()
        expected = reference.load(3)
    # The source moves on, compacts and collects everything it can.
    with CheckpointStore(src, **OPTIONS) as store:
        for step in range(4, 6):
            state = train(state, step)
            store.save(state, step).wait()
        store.compact()
        store.gc(keep_last=1)
        assert 2 in store.steps(), "the pinned step is kept"
    with CheckpointStore(dst) as fork:
        assert fork.verify(2).ok and fork.verify(3).ok
        assert_state_equal(fork.load(3), expected)
        assert_state_equal(fork.load(2), at2)
    # The pin goes only once the fork no longer needs the source.
    with pytest.raises(ConfigError, match="still names objects"):
        unpin(str(src), str(dst))
    unpin(str(src), str(dst), force=True)
    assert read_pins(LocalStorage(str(src))) == []
    with CheckpointStore(src, **OPTIONS) as store:
        store.gc(keep_last=1)
        assert store.steps() == [5]
    with CheckpointStore(dst) as fork:
        assert not fork.verify(2).ok, "without the pin the source's gc removed what it needed"


def test_fork_of_a_pool_member_joins_the_pool_and_pool_gc_keeps_it(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    state = base_state()
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as a:
        a.save(state, 1).wait()
        a.save(train(state, 2), 2).wait()
    CheckpointStore.fork(str(tmp_path / "a"), str(tmp_path / "f"), 1)
    with CheckpointStore(tmp_path / "f", **OPTIONS) as f:
        assert f.load(1)["model"]["head"].sum() == 0
        f.save(train(state, 7), 7).wait()
    with CheckpointStore(tmp_path / "a", **OPTIONS) as a:
        a.save(train(state, 3), 3).wait()
        a.gc(keep_last=1)
        assert a.steps() == [1, 3]  # 1 is pinned
    with CheckpointStore(tmp_path / "a", **OPTIONS) as a:
        a.delete(1)  # the source drops its manifest; the pin still holds the objects
    report = collect_pool(pool, min_age_s=0.0)
    assert str(tmp_path / "f") in report.members
    with CheckpointStore(tmp_path / "f") as f:
        assert f.verify(1).ok and f.verify(7).ok
        assert_state_equal(f.load(7), train(state, 7))
    assert packs(tmp_path / "f") == set()


def test_fork_of_a_plain_store_into_a_pool(tmp_path: Path) -> None:
    state = base_state()
    with CheckpointStore(tmp_path / "src", **OPTIONS) as store:
        store.save(state, 5).wait()
    CheckpointStore.fork(str(tmp_path / "src"), str(tmp_path / "f"), pool=str(tmp_path / "p"))
    with CheckpointStore(tmp_path / "f", **OPTIONS) as f:
        f.save(train(f.load(), 6), 6).wait()
        assert f.verify(5).ok
    assert packs(tmp_path / "f") == set() and packs(tmp_path / "p")
    with pytest.raises(ConfigError, match="already holds a store"):
        CheckpointStore.fork(str(tmp_path / "src"), str(tmp_path / "f"))


def test_unpin_is_refused_while_a_fork_of_the_fork_needs_the_source(tmp_path: Path) -> None:
    a, b, c = (str(tmp_path / n) for n in "abc")
    state = base_state()
    with CheckpointStore(a, **OPTIONS) as store:
        store.save(state, 1).wait()
    CheckpointStore.fork(a, b)
    CheckpointStore.fork(b, c)
    with CheckpointStore(b, **OPTIONS) as fork:  # b stops naming a's objects
        fork.save(train(state, 2), 2).wait()
        fork.compact()
        fork.delete(1)
    with pytest.raises(ConfigError, match="the pin of its fork"):
        unpin(a, b)
    with CheckpointStore(c) as grandchild:
        assert grandchild.verify(1).ok


def test_a_deleted_member_leaves_the_pool(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as a:
        a.save(base_state(), 1).wait()
    with pytest.raises(ConfigError, match="still holds checkpoints"):
        leave(str(pool), str(tmp_path / "a"))
    shutil.rmtree(tmp_path / "a")
    leave(str(pool), str(tmp_path / "a"))
    report = collect_pool(pool, min_age_s=0.0)
    assert report.members == [] and report.removed_objects


def test_pool_gc_costs_grow_linearly_in_members_and_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}

    def counted(name: str) -> None:
        real = getattr(LocalStorage, name)

        def wrapper(self: LocalStorage, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(LocalStorage, name, wrapper)

    def cost(members: int) -> int:
        pool = tmp_path / f"pool{members}"
        for i in range(members):
            with CheckpointStore(tmp_path / f"m{members}-{i}", pool=pool, **OPTIONS) as store:
                state = base_state()
                for step in (1, 2, 3):
                    state = train(state, step + i)
                    store.save(state, step).wait()
                store.gc(keep_last=1)  # leaves garbage in the pool
        calls["n"] = 0
        collect_pool(pool, min_age_s=0.0)
        return calls["n"]

    for name in ("list", "get", "exists", "size", "mtime", "delete", "put"):
        counted(name)
    small, large = cost(2), cost(8)
    assert large <= 4 * small + 10, (small, large)  # 4x the members and objects: 4x the calls


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_pool_and_fork_on_other_backends(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from tests.conftest import backend_url

    with backend_url(kind, request, tmp_path) as root:
        pool, a, b, f = (f"{root}/{n}" for n in ("pool", "a", "b", "f"))
        state = base_state()
        for url in (a, b):
            with CheckpointStore(url, pool=pool, **OPTIONS) as store:
                store.save(state, 1).wait()
                store.save(train(state, 2), 2).wait()
        CheckpointStore.fork(a, f, 1)
        with CheckpointStore(a, **OPTIONS) as store:
            store.gc(keep_last=1)
            assert store.steps() == [1, 2]  # 1 is pinned
        with CheckpointStore(b, **OPTIONS) as store:
            store.gc(keep_last=1)
            assert store.steps() == [2]
        report = collect_pool(pool, min_age_s=0.0)
        assert len(report.members) == 3
        for url, step, expected in ((f, 1, state), (b, 2, train(state, 2))):
            with CheckpointStore(url) as store:
                assert store.verify(step).ok
                assert_state_equal(store.load(step), expected)


def test_unreadable_manifests_and_pins_stop_every_deletion(tmp_path: Path) -> None:
    pool, a = tmp_path / "pool", tmp_path / "a"
    state = base_state()
    with CheckpointStore(a, pool=pool, **OPTIONS) as store:
        store.save(state, 1).wait()
        store.save(train(state, 2), 2).wait()
        store.gc(keep_last=1)  # leaves step 1's objects unreferenced in the pool
    before = packs(pool)
    torn = a / "manifests" / f"{3:020d}.json"
    torn.write_bytes(b"{not a manifest")
    with pytest.raises(PoolMemberError, match="deleted nothing"):
        collect_pool(pool, min_age_s=0.0)
    assert packs(pool) == before
    torn.unlink()
    # A source whose pin cannot be read deletes nothing: what the pin protects is unknown.
    src = tmp_path / "src"
    with CheckpointStore(src, **OPTIONS) as store:
        for step in (1, 2, 3):
            store.save(train(state, step), step).wait()
    CheckpointStore.fork(str(src), str(tmp_path / "f"), 1)
    [pin] = list((src / "pins").iterdir())
    pin.write_bytes(b"garbage")
    owned = packs(src)
    with CheckpointStore(src, **OPTIONS) as store:
        with pytest.raises(CorruptCheckpointError, match="pin"):
            store.gc(keep_last=1)
        assert store.steps() == [1, 2, 3]
    assert packs(src) == owned


def test_credentials_per_url(tmp_path: Path) -> None:
    """A fork in one bucket reads a source in another, each with its own credentials."""
    from lightning_incremental.core.storage import register_scheme, unregister_scheme
    from tests import storage_plugin

    def factory(url: str, options: dict[str, Any]) -> Any:
        space = url.partition("://")[2].partition("/")[0]
        if options != {"token": f"secret-{space}"}:
            raise PermissionError(f"access denied to {space}")
        storage = storage_plugin.open_dict_storage(url.replace("licred", "dictmem", 1), {})
        storage.url = url  # the URL a store records is the one it was opened with
        return storage

    register_scheme("licred", factory)
    try:
        src, dst = "licred://bucket-a/src", "licred://bucket-b/fork"
        a, b = {"token": "secret-bucket-a"}, {"token": "secret-bucket-b"}
        with CheckpointStore(src, storage_options=a, **OPTIONS) as store:
            store.save(base_state(), 1).wait()
        CheckpointStore.fork(src, dst, storage_options=b, src_storage_options=a)
        with pytest.raises(PermissionError, match="bucket-a"):
            CheckpointStore(dst, storage_options=b)
        urls = {src: a}
        with CheckpointStore(dst, storage_options=b, location_options=urls) as fork:
            assert_state_equal(fork.load(), base_state())
    finally:
        unregister_scheme("licred")
        storage_plugin.forget("dictmem://bucket-a")
        storage_plugin.forget("dictmem://bucket-b")


def test_a_pool_is_not_opened_as_a_store(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as store:
        store.save(base_state(), 1).wait()
    before = packs(pool)
    with pytest.raises(ConfigError, match="is a shared object pool"):
        CheckpointStore(pool, **OPTIONS)  # its gc would see no manifest and delete every object
    from lightning_incremental.cli import main

    assert main(["gc", str(pool), "--grace", "0", "--min-age", "0"]) == 2
    assert packs(pool) == before


def test_a_store_is_not_used_as_a_pool(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    with CheckpointStore(plain, **OPTIONS) as store:
        store.save(base_state(), 1).wait()
    with pytest.raises(ConfigError, match="not a shared object pool"):
        CheckpointStore(tmp_path / "m", pool=plain, **OPTIONS)
    with pytest.raises(ConfigError, match="its own pool"):
        CheckpointStore(tmp_path / "n", pool=tmp_path / "n", **OPTIONS)
    with pytest.raises(ConfigError, match="not a shared object pool"):
        CheckpointStore.fork(str(plain), str(tmp_path / "f"), pool=str(plain))
    assert not (tmp_path / "m" / "links.json").exists()


def test_pool_gc_of_a_location_that_is_no_pool_deletes_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    with CheckpointStore(plain, **OPTIONS) as store:
        store.save(base_state(), 1).wait()
    before = packs(plain)
    with pytest.raises(ConfigError, match="not a shared object pool"):
        collect_pool(plain, min_age_s=0.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no pool\.json"):
        collect_pool(tmp_path / "empty", min_age_s=0.0)
    assert packs(plain) == before


def test_pool_gc_reads_the_commit_that_replaced_a_manifest_it_listed(tmp_path: Path) -> None:
    """A member commits a step and its retention removes the step the collection listed but had
    not read yet: the new step names the old objects, and the next mark pass reads it."""
    from lightning_incremental.core.storage import register_scheme, unregister_scheme
    from tests.faulty import FaultyStorage

    hooks: list[Any] = []

    class Hooked(FaultyStorage):
        def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
            if hooks and path == f"manifests/{1:020d}.json":
                hooks.pop()()
            return super().get(path, start, end)

    def factory(url: str, options: dict[str, Any]) -> Any:
        storage = Hooked(LocalStorage(url.partition("://")[2]))
        storage.url = url
        return storage

    register_scheme("lihook", factory)
    try:
        pool, member = tmp_path / "pool", f"lihook://{tmp_path / 'a'}"
        state = base_state()
        with CheckpointStore(member, pool=pool, **OPTIONS) as store:
            store.save(state, 1).wait()
        then = 1_000_000_000.0  # long ago: older than any minimum age
        for path in (pool / "packs").rglob("*.pack"):
            os.utime(path, (then, then))

        def commit_and_retain() -> None:
            with CheckpointStore(member, **OPTIONS) as store:
                store.load()
                store.save(train(state, 2), 2).wait()  # references step 1's old objects
                store.gc(keep_last=1)  # and step 1 goes

        hooks.append(commit_and_retain)
        collect_pool(pool, min_age_s=900.0)
        assert not hooks
        with CheckpointStore(member) as store:
            assert store.steps() == [2]
            assert store.verify(2).ok
            assert_state_equal(store.load(2), train(state, 2))
    finally:
        unregister_scheme("lihook")


def test_the_pool_records_a_members_largest_minimum_age(tmp_path: Path) -> None:
    from lightning_incremental.core.maintain.pool import members

    pool = tmp_path / "pool"
    for age in (0.0, 1200.0, 60.0):
        CheckpointStore(tmp_path / "a", pool=pool, fsync=False, min_object_age_s=age).close()
    [record] = members(LocalStorage(str(pool)))
    assert record["min_object_age_s"] == 1200.0


@contextlib.contextmanager
def buckets() -> Iterator[None]:
    """``liacl://<bucket>/...``: in-memory buckets that open only with storage options naming
    them (``{"buckets": [...]}``)."""
    from tests import storage_plugin

    def factory(url: str, options: dict[str, Any]) -> Any:
        space = url.partition("://")[2].partition("/")[0]
        if space not in (options or {}).get("buckets", ()):
            raise PermissionError(f"access denied to {space}")
        storage = storage_plugin.open_dict_storage(url.replace("liacl", "dictmem", 1), {})
        storage.url = url
        return storage

    register_scheme("liacl", factory)
    try:
        yield
    finally:
        unregister_scheme("liacl")
        storage_plugin.forget("dictmem://a")
        storage_plugin.forget("dictmem://b")


def test_the_pool_opens_with_the_stores_storage_options_by_default() -> None:
    """Without ``pool_storage_options`` a store opens its pool with its own options, joining it
    or reopening."""
    with buckets():
        creds = {"buckets": ["a"]}
        with CheckpointStore("liacl://a/m", pool="liacl://a/pool", storage_options=creds) as store:
            store.save(base_state(), 1).wait()
        with CheckpointStore("liacl://a/m", storage_options=creds) as store:
            assert_state_equal(store.load(1), base_state())
