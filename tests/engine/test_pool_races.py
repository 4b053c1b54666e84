"""Forks and retention racing: a gc that read the pins before a fork pinned a step it deletes,
a compaction that replaced the manifest version a fork read, a pin and the rule that keeps the
newest intact checkpoint, and a pool member that leaves while its store is open."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointNotFoundError, CheckpointStore, ConfigError
from lightning_incremental.core.maintain import pool as pool_module
from lightning_incremental.core.maintain import retention
from lightning_incremental.core.maintain.pins import read_pins
from lightning_incremental.core.maintain.pool import fork, leave
from lightning_incremental.core.maintain.pool_gc import collect_pool
from lightning_incremental.core.storage import LocalStorage
from tests.conftest import assert_state_equal

OPTIONS: dict[str, Any] = {"chunk_size": 4096, "fsync": False, "min_object_age_s": 0.0}


def weights(step: int) -> dict[str, torch.Tensor]:
    """The same weights with row 0 changed per step: each save after the first is a delta."""
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    w[0] += step
    return {"w": w}


def two_steps(src: Path, *, delta: bool = True) -> dict[str, torch.Tensor]:
    """Steps 1 and 2 in ``src``; step 2 shares no object with step 1 unless ``delta``."""
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(weights(1), 1).wait()
        other = {"w": torch.randn(128, 128, generator=torch.Generator().manual_seed(9))}
        store.save(weights(2) if delta else other, 2).wait()
        return store.load(1)


def test_a_fork_pinned_after_gc_read_the_pins_keeps_its_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "src", tmp_path / "fork"
    at1 = two_steps(src, delta=False)
    real = retention.read_pins
    forked: list[int] = []

    def racing(storage: Any) -> Any:
        pins = real(storage)  # the gc's first read: no pin yet
        monkeypatch.setattr(retention, "read_pins", real)
        forked.append(fork(src, dst, 1, min_age_s=0.0))  # pins step 1, finds it there
        return pins

    monkeypatch.setattr(retention, "read_pins", racing)
    with CheckpointStore(src, **OPTIONS) as store:
        assert store.gc(keep_last=1).removed_steps == [1]
    assert forked == [1]
    with CheckpointStore(dst, **OPTIONS) as forked_store:
        assert_state_equal(forked_store.load(1), at1)


def test_a_fork_pinned_while_another_process_removed_the_step_keeps_its_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "src", tmp_path / "fork"
    two_steps(src, delta=False)
    real = retention.read_pins
    with CheckpointStore(dst.parent / "ref", **OPTIONS) as ref:
        ref.save({"w": torch.randn(128, 128, generator=torch.Generator().manual_seed(9))}, 2).wait()
        at2 = ref.load(2)

    def racing(storage: Any) -> Any:
        pins = real(storage)  # the gc's first read: no pin yet
        monkeypatch.setattr(retention, "read_pins", real)
        fork(src, dst, 2, min_age_s=0.0)  # pins step 2, finds it there
        (src / "manifests" / f"{2:020d}.json").unlink()  # then another process removes it
        return pins

    monkeypatch.setattr(retention, "read_pins", racing)
    with CheckpointStore(src, **OPTIONS) as store:
        store.gc(keep_last=1)  # deletes no manifest itself
    with CheckpointStore(dst, **OPTIONS) as forked_store:
        assert_state_equal(forked_store.load(2), at2)


def test_a_fork_refuses_a_manifest_version_replaced_while_it_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "src", tmp_path / "fork"
    two_steps(src)
    real = pool_module.new_pin

    def compacting(step: int, by: str, packs: list[str]) -> Any:
        with CheckpointStore(src, **OPTIONS) as store:  # replaces the version the fork read
            store.compact()
        return real(step, by, packs)

    monkeypatch.setattr(pool_module, "new_pin", compacting)
    with pytest.raises(CheckpointNotFoundError, match="removed while it was being forked"):
        fork(src, dst, 2, min_age_s=0.0)
    assert read_pins(LocalStorage(str(src))) == []


def test_a_pinned_step_does_not_stand_in_for_the_newest_intact_one(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with CheckpointStore(src, **OPTIONS) as store:
        for step in (1, 2):
            store.save(
                {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(step))}, step
            ).wait()
        before = set((src / "packs").rglob("*.pack"))
        store.save({"w": torch.randn(64, 64)}, 3).wait()
    fork(src, tmp_path / "fork", 1, min_age_s=0.0)
    sorted(set((src / "packs").rglob("*.pack")) - before)[0].unlink()  # step 3 damaged
    with CheckpointStore(src, **OPTIONS) as store:
        report = store.gc(keep_last=1)
        assert report.removed_steps == [] and report.kept_intact == 2
        assert store.steps() == [1, 2, 3]


def test_a_member_open_before_its_first_commit_cannot_leave(tmp_path: Path) -> None:
    pool, member = tmp_path / "pool", tmp_path / "a"
    with CheckpointStore(member, pool=pool, **OPTIONS) as store:  # joined, nothing committed
        with pytest.raises(ConfigError, match="only a member whose location was deleted"):
            leave(pool, member)
        store.save(weights(1), 1).wait()
        collect_pool(pool, min_age_s=0.0)
        assert_state_equal(store.load(1), weights(1))


def test_pool_gc_finishes_while_a_member_commits_during_every_pass(tmp_path: Path) -> None:
    from lightning_incremental.core.storage import register_scheme, unregister_scheme
    from tests.faulty import FaultyStorage

    commits: list[int] = []
    armed: list[bool] = []
    member = f"liboth://{tmp_path / 'a'}"

    class Busy(FaultyStorage):
        def list(self, prefix: str = "") -> Any:
            listed = super().list(prefix)
            if armed and prefix == "manifests" and len(commits) < 12:
                armed.clear()  # a commit after each listing the collection makes
                step = 2 + len(commits)
                commits.append(step)
                with CheckpointStore(member, **OPTIONS) as store:
                    store.save(weights(step), step).wait()
                armed.append(True)
            return listed

    def factory(url: str, options: dict[str, Any]) -> Any:
        storage = Busy(LocalStorage(url.partition("://")[2]))
        storage.url = url
        return storage

    register_scheme("liboth", factory)
    try:
        pool = tmp_path / "pool"
        with CheckpointStore(member, pool=pool, **OPTIONS) as store:
            store.save(weights(1), 1).wait()
        for path in (pool / "packs").rglob("*.pack"):  # long ago: the later steps' deltas
            os.utime(path, (1e9, 1e9))  # name these old objects
        armed.append(True)
        collect_pool(pool, min_age_s=900.0)
        armed.clear()
        assert commits  # it committed while the collection marked, which finished
        with CheckpointStore(member, **OPTIONS) as store:
            assert all(store.verify(step).ok for step in store.steps())
    finally:
        unregister_scheme("liboth")
