"""Forks that outlive their source: a fork into another pool holds what it needs in its own pool
(copied when it is made: the source's pool forgets the fork once the source leaves it), a fork
of weights only loads its weights and builds on them from its own record of the step, and every
collection (the source's retention, either pool's collection) keeps what a fork needs — before
the fork saves and after, through forks of forks and removed pins. Where a fork's objects are
lost anyway (a plain source removed by hand), the error names where they were read from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import (
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    CorruptCheckpointError,
)
from lightning_incremental.core.commit.history import FORK_BASE
from lightning_incremental.core.maintain.pins import read_pins
from lightning_incremental.core.maintain.pool import fork, leave, unpin
from lightning_incremental.core.maintain.pool_gc import collect_pool
from lightning_incremental.core.storage import LocalStorage, register_scheme, unregister_scheme
from lightning_incremental.runtime.session.fork import forked_weights
from tests.conftest import assert_state_equal
from tests.engine.test_pool import OPTIONS, base_state, buckets, packs, train
from tests.faulty import FaultyStorage

BACKBONE_BYTES = 64 * 256 * 4


def source_in(root: Path, pool: Path, name: str = "src") -> dict[int, dict[str, Any]]:
    """Steps 1-3 of a member of ``pool`` (the head trained, the backbone frozen); returns them."""
    saved, state = {}, base_state()
    with CheckpointStore(root / name, pool=pool, **OPTIONS) as store:
        for step in (1, 2, 3):
            state = train(state, step)
            store.save(state, step).wait()
            saved[step] = state
    return saved


def collect_for_good(pool: Path) -> None:
    """Two collections with no minimum age: the first moves garbage to the trash, the second
    purges it."""
    collect_pool(pool, min_age_s=0.0)
    collect_pool(pool, min_age_s=0.0)


def remove_member(root: Path, name: str, pool: Path) -> None:
    """The member's location deleted for good, its record removed, its pool collected."""
    shutil.rmtree(root / name)
    leave(pool, root / name)
    collect_for_good(pool)


def links(store: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((store / "links.json").read_bytes())
    return doc


@pytest.mark.parametrize("saves", [0, 3])
def test_a_fork_into_another_pool_outlives_its_source_and_its_pool(
    tmp_path: Path, saves: int
) -> None:
    p1, p2, src, dst = tmp_path / "p1", tmp_path / "p2", tmp_path / "src", tmp_path / "fork"
    saved = source_in(tmp_path, p1)
    assert fork(src, dst, 2, pool=p2, min_age_s=0.0) == 2
    expected = {2: saved[2]}
    with CheckpointStore(dst, **OPTIONS) as forked:
        state = forked.load()
        for step in range(3, 3 + saves):  # deltas against the copied objects
            state = train(state, step)
            result = forked.save(state, step).wait()
            assert result.bytes_written < BACKBONE_BYTES / 4
            expected[step] = state

    def still_loads() -> None:
        with CheckpointStore(dst) as again:
            assert again.steps() == sorted(expected)
            for step, state in expected.items():
                assert again.verify(step).ok
                assert_state_equal(again.load(step), state)

    with CheckpointStore(src, **OPTIONS) as store:  # the source keeps only its newest
        store.save(train(saved[3], 4), 4).wait()
        store.gc(keep_last=1)
    collect_for_good(p1)
    still_loads()
    with CheckpointStore(src, **OPTIONS) as store:  # ... deletes every step
        for step in store.steps():
            store.delete(step)
    collect_for_good(p1)
    collect_for_good(p2)
    still_loads()
    remove_member(tmp_path, "src", p1)  # ... is deleted and leaves its pool
    still_loads()
    shutil.rmtree(p1)  # and its pool goes too
    still_loads()
    assert links(dst)["pool"] == str(p2) and links(dst)["sources"] == []
    with CheckpointStore(dst) as forked:
        assert set(forked.manifest(2).packs) <= packs(p2), "copied into its pool"


def test_a_fork_of_a_fork_across_three_pools_outlives_both_sources(tmp_path: Path) -> None:
    p1, p2, p3 = (tmp_path / n for n in ("p1", "p2", "p3"))
    source_in(tmp_path, p1)
    fork(tmp_path / "src", tmp_path / "f1", 3, pool=p2, min_age_s=0.0)
    with CheckpointStore(tmp_path / "f1", **OPTIONS) as f1:
        at4 = train(f1.load(), 4)
        f1.save(at4, 4).wait()
    fork(tmp_path / "f1", tmp_path / "f2", 4, pool=p3, min_age_s=0.0)

    def loads(name: str) -> None:
        with CheckpointStore(tmp_path / name) as store:
            assert store.verify(4).ok
            assert_state_equal(store.load(4), at4)

    remove_member(tmp_path, "src", p1)
    loads("f2")
    unpin(tmp_path / "f1", tmp_path / "f2")  # f2 holds what it needs: no force needed
    remove_member(tmp_path, "f1", p2)
    shutil.rmtree(p2)
    loads("f2")
    fork(tmp_path / "f2", tmp_path / "back", 4, pool=p1, min_age_s=0.0)  # into the first pool
    remove_member(tmp_path, "f2", p3)
    shutil.rmtree(p3)
    loads("back")


@pytest.mark.parametrize("into", ["same pool", "other pool", "plain"])
def test_a_weights_only_fork_before_its_first_save_outlives_its_source(
    tmp_path: Path, into: str
) -> None:
    """The source deletes the step, runs retention, and (when it is a pool member) is deleted,
    leaves its pool and the pool is collected: the fork still loads the step's weights, and its
    first save references them."""
    p1, p2, src, dst = tmp_path / "p1", tmp_path / "p2", tmp_path / "src", tmp_path / "ft"
    if into == "plain":
        saved, state = {}, base_state()
        with CheckpointStore(src, **OPTIONS) as store:
            for step in (1, 2, 3):
                state = train(state, step)
                store.save(state, step).wait()
                saved[step] = state
    else:
        saved = source_in(tmp_path, p1)
    fork(src, dst, 2, pool=p2 if into == "other pool" else None, min_age_s=0.0, as_base=True)
    with CheckpointStore(src, **OPTIONS) as store:
        store.delete(2)  # the manifest goes, the pin keeps the objects
        store.gc(keep_last=1)
        assert store.steps() == [3]
    if into != "plain":
        collect_for_good(p1)
        remove_member(tmp_path, "src", p1)
    assert_state_equal(forked_weights(str(dst), "model"), saved[2]["model"])
    with CheckpointStore(dst, **OPTIONS) as forked:
        assert forked.steps() == []
        assert_state_equal(forked.load_fork_base(keys="model")["model"], saved[2]["model"])
        first = {"model": saved[2]["model"], "optim": {"lr": torch.tensor(0.1)}, "step": 0}
        result = forked.save(first, 0).wait()
        assert not result.full_base and result.bytes_written < BACKBONE_BYTES / 4
    if into != "plain":
        collect_for_good(p2 if into == "other pool" else p1)
    with CheckpointStore(dst) as forked:
        assert forked.verify(0).ok
        assert_state_equal(forked.load(0), first)


def test_unpin_of_a_fork_that_holds_its_objects_keeps_its_fork_base(tmp_path: Path) -> None:
    p1, p2, src, dst = tmp_path / "p1", tmp_path / "p2", tmp_path / "src", tmp_path / "ft"
    saved = source_in(tmp_path, p1)
    fork(src, dst, 3, pool=p2, min_age_s=0.0, as_base=True)
    unpin(src, dst)  # before its first save: the fork's pool holds what its base names
    assert read_pins(LocalStorage(str(src))) == [] and (dst / FORK_BASE).exists()
    with CheckpointStore(src, **OPTIONS) as store:
        store.gc(keep_last=1)
    remove_member(tmp_path, "src", p1)
    collect_for_good(p2)
    assert_state_equal(forked_weights(str(dst), "model"), saved[3]["model"])
    # A fork in the source's pool holds its objects there as well.
    saved = source_in(tmp_path, p1, "src2")
    fork(tmp_path / "src2", tmp_path / "ft2", 3, min_age_s=0.0, as_base=True)
    unpin(tmp_path / "src2", tmp_path / "ft2")
    remove_member(tmp_path, "src2", p1)
    assert_state_equal(forked_weights(str(tmp_path / "ft2"), "model"), saved[3]["model"])


def test_a_fork_base_unpinned_with_force_reads_the_source_or_says_why_not(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "ft"
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(base_state(), 1).wait()
        store.save(train(base_state(), 2), 2).wait()
    fork(src, dst, 1, min_age_s=0.0, as_base=True)
    unpin(src, dst, force=True)
    assert not (dst / FORK_BASE).exists()
    assert_state_equal(forked_weights(str(dst), "model"), base_state()["model"])
    with CheckpointStore(src, **OPTIONS) as store:
        store.gc(keep_last=1)
    with pytest.raises(CheckpointNotFoundError, match="holds no fork base any more"):
        forked_weights(str(dst), "model")


def test_pool_gc_racing_a_fork_into_another_pool(tmp_path: Path) -> None:
    """Collections of both pools run while the fork copies: the source's pool reads the pin
    (written before the copy), the fork's pool removes copied objects it does not know yet
    (no minimum age) and the fork copies them again before it commits."""
    stores: dict[str, FaultyStorage] = {}
    racing: list[Any] = []

    class Racing(FaultyStorage):
        def exists(self, path: str) -> bool:
            if racing and path.startswith("packs/") and self.calls["put", "pack"]:
                try:
                    hook = racing.pop()  # the first check after the copy wrote objects
                except IndexError:
                    pass  # another thread's
                else:
                    hook()
            return super().exists(path)

    def factory(url: str, options: dict[str, Any]) -> Any:
        if url not in stores:
            stores[url] = Racing(LocalStorage(url.partition("://")[2]))
            stores[url].url = url
        return stores[url]

    register_scheme("lirace", factory)
    try:
        p1, src, dst = tmp_path / "p1", tmp_path / "src", tmp_path / "fork"
        p2 = f"lirace://{tmp_path / 'p2'}"
        saved = source_in(tmp_path, p1)
        with CheckpointStore(tmp_path / "other", pool=p2, **OPTIONS) as other:  # p2 has a member
            other.save({"w": torch.ones(8)}, 1).wait()

        def collections() -> None:
            with CheckpointStore(src, **OPTIONS) as store:
                store.delete(2)  # the pin holds its objects
            collect_for_good(p1)
            collect_pool(p2, min_age_s=0.0)  # the fork's copies are garbage to its pool yet
            collect_pool(p2, min_age_s=0.0)

        racing.append(collections)
        stores[p2].calls.clear()  # the fork's writes from here on
        fork(src, dst, 2, pool=p2, min_age_s=0.0)
        assert not racing
        copies = stores[p2].calls["put", "pack"]
        remove_member(tmp_path, "src", p1)
        collect_pool(p2, min_age_s=0.0)
        with CheckpointStore(dst) as forked:
            assert forked.verify(2).ok
            assert_state_equal(forked.load(2), saved[2])
            assert copies == 2 * len(forked.manifest(2).packs)  # copied, collected, copied again
    finally:
        unregister_scheme("lirace")


def test_a_fork_that_cannot_copy_leaves_nothing_pinned(tmp_path: Path) -> None:
    p1, p2, src, dst = tmp_path / "p1", tmp_path / "p2", tmp_path / "src", tmp_path / "fork"
    saved = source_in(tmp_path, p1)
    with CheckpointStore(src) as store:
        [victim] = sorted(store.manifest(1).packs)[:1]
    original = (p1 / victim).read_bytes()
    (p1 / victim).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # rotten in the pool
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        fork(src, dst, 1, pool=p2, min_age_s=0.0)
    assert read_pins(LocalStorage(str(src))) == []
    assert not dst.exists() or not any(dst.iterdir()), "the fork's location is left empty"
    (p1 / victim).write_bytes(original)
    with pytest.raises(ConfigError, match="its own pool"):
        fork(src, dst, 1, pool=dst, min_age_s=0.0)
    assert read_pins(LocalStorage(str(src))) == []
    fork(src, dst, 1, pool=p2, min_age_s=0.0)  # nothing left behind stands in the way
    with CheckpointStore(dst) as forked:
        assert_state_equal(forked.load(1), saved[1])


def test_a_fork_whose_plain_source_was_removed_says_where_it_read(tmp_path: Path) -> None:
    src, dst, p2 = tmp_path / "src", tmp_path / "fork", tmp_path / "p2"
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(base_state(), 1).wait()
    fork(src, dst, 1, pool=p2, min_age_s=0.0)  # a plain source's retention honours the pin
    assert links(dst)["sources"] == [str(src)]
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(train(base_state(), 2), 2).wait()
        store.gc(keep_last=1)
    with CheckpointStore(dst) as forked:
        assert_state_equal(forked.load(1), base_state())
    shutil.rmtree(src)  # by hand: no deleter of the library does this while pins are there
    with CheckpointStore(dst) as forked:
        with pytest.raises(CorruptCheckpointError, match=f"{src}.*must be kept"):
            forked.load(1, strict=True)


def test_the_command_forks_into_another_pool_and_unpins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_incremental.cli import main

    p1, p2, src, dst = tmp_path / "p1", tmp_path / "p2", tmp_path / "src", tmp_path / "fork"
    saved = source_in(tmp_path, p1)
    assert main(["fork", f"{src}@2", str(dst), "--pool", str(p2)]) == 0
    assert main(["unpin", str(src), str(dst)]) == 0  # nothing of the source is needed any more
    capsys.readouterr()
    assert main(["ls", str(dst), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["objects_in"] == str(p2) and "reads_from" not in listed
    remove_member(tmp_path, "src", p1)
    with CheckpointStore(dst) as forked:
        assert_state_equal(forked.load(2), saved[2])


@pytest.mark.parametrize("middle", ["plain", "pooled"])
def test_a_fork_of_a_fork_holds_its_own_pin_in_the_grandparent(tmp_path: Path, middle: str) -> None:
    """a (plain) -> b -> c: c reads a's objects through b. b is removed by hand, and its pin in
    a with it (nothing of b is left to need it): a's retention still keeps what c needs."""
    a, b, c, pool = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "pool"
    with CheckpointStore(a, **OPTIONS) as store:
        store.save(base_state(), 1).wait()
    fork(a, b, 1, pool=pool if middle == "pooled" else None, min_age_s=0.0)
    fork(b, c, 1, min_age_s=0.0)
    shutil.rmtree(b)
    if middle == "pooled":
        leave(pool, b)
    unpin(a, b)  # the fork at b is gone: its pin goes without a check
    with CheckpointStore(a, **OPTIONS) as store:
        store.save({"other": torch.randn(64, 256)}, 2).wait()  # shares no object
        store.gc(keep_last=1)
        assert store.steps() == [2], "a pin of a fork of a fork keeps objects, not steps"
    if middle == "pooled":
        collect_for_good(pool)
    with CheckpointStore(c) as forked:
        assert forked.verify(1).ok
        assert_state_equal(forked.load(1), base_state())
    assert [(p.by, p.via) for p in read_pins(LocalStorage(str(a)))] == [(str(c), str(b))]


def test_a_fork_into_another_pool_opens_without_access_to_the_source() -> None:
    """The source's bucket unreachable (no credentials for it) while the fork opens: a fork into
    another pool reads nothing there."""
    both, only_b = {"buckets": ["a", "b"]}, {"buckets": ["b"]}
    src, pool_a = "liacl://a/src", "liacl://a/pool"
    dst, pool_b = "liacl://b/fork", "liacl://b/pool"
    with buckets():
        with CheckpointStore(
            src, pool=pool_a, storage_options=both, pool_storage_options=both, **OPTIONS
        ) as store:
            store.save(base_state(), 1).wait()
        opened = {"storage_options": both, "src_storage_options": both}
        fork(src, dst, pool=pool_b, pool_storage_options=both, min_age_s=0.0, **opened)
        with CheckpointStore(dst, storage_options=only_b) as forked:
            assert forked.verify(1).ok
            assert_state_equal(forked.load(1), base_state())
