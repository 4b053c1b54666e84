"""The two-phase commit: parts are written first and are invisible until one manifest names
them; a commit with a missing or inconsistent part is refused. And retention runs after a
commit, never inside it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.commit.committer import Part, assemble
from lightning_incremental.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
)
from lightning_incremental.core.save.snapshot import flatten
from tests.conftest import assert_state_equal, small_store


def _part(store: CheckpointStore, state: dict, step: int) -> tuple[Part, object, list[str]]:
    tree, leaves, pickled = flatten(state)
    store._lease.acquire(store.generation)
    store._history.write_marker()
    return store._committer.write_part(step, leaves), tree, pickled


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3000, generator=g), "b": {"c": torch.randn(500, generator=g)}}


def test_a_written_part_is_invisible_until_committed(local_url: str) -> None:
    with small_store(local_url) as store:
        part, tree, pickled = _part(store, _state(0), 1)
        assert part.written and all(os.path.exists(f"{local_url}/{p}") for p in part.written)
        assert store.steps() == []
        with pytest.raises(CheckpointNotFoundError):
            store.load()
        committed = store._committer.commit(
            1, [part], generation=store.generation, audit={}, tree=tree, pickled=pickled
        )
        assert store.steps() == [1] and committed.manifest.step == 1
        assert_state_equal(store.load(1), _state(0))


def test_parts_of_different_processes_commit_as_one_manifest(local_url: str) -> None:
    """Two parts (as two ranks would write them) make one checkpoint."""
    state = _state(1)
    with small_store(local_url) as store:
        tree, leaves, _ = flatten(state)
        store._lease.acquire(store.generation)
        first = store._committer.write_part(5, leaves[:1])
        second = store._committer.write_part(5, leaves[1:])
        store._committer.commit(
            5, [first, second], generation=store.generation, audit={}, tree=tree
        )
        manifest = store.manifest(5)
        assert [t.path for t in manifest.tensors] == [
            t.path for t in first.tensors + second.tensors
        ]
        assert set(manifest.packs) == set(first.packs) | set(second.packs)
        assert_state_equal(store.load(5), state)


def test_a_commit_with_a_missing_part_object_is_refused(local_url: str) -> None:
    with small_store(local_url) as store:
        part, tree, _ = _part(store, _state(2), 1)
        os.remove(f"{local_url}/{sorted(part.written)[0]}")
        with pytest.raises(CorruptCheckpointError, match="missing"):
            store._committer.commit(1, [part], generation=store.generation, audit={}, tree=tree)
        assert store.steps() == []


def test_a_commit_with_a_truncated_part_object_is_refused(local_url: str) -> None:
    with small_store(local_url) as store:
        part, tree, _ = _part(store, _state(3), 1)
        path = f"{local_url}/{sorted(part.written)[0]}"
        with open(path, "r+b") as fh:
            fh.truncate(3)
        with pytest.raises(CorruptCheckpointError, match="3 bytes"):
            store._committer.commit(1, [part], generation=store.generation, audit={}, tree=tree)
        assert store.steps() == []


def test_a_commit_with_an_inconsistent_part_is_refused(local_url: str) -> None:
    with small_store(local_url) as store:
        part, tree, _ = _part(store, _state(4), 1)
        lost = dataclasses.replace(part, packs={})  # chunks naming objects the part lacks
        with pytest.raises(ManifestError, match="unlisted pack"):
            store._committer.commit(1, [lost], generation=store.generation, audit={}, tree=tree)
        other = dataclasses.replace(part, step=2)
        with pytest.raises(ManifestError, match="does not belong"):
            store._committer.commit(1, [part, other], generation=0, audit={}, tree=tree)
        with pytest.raises(ManifestError, match="at least one part"):
            assemble(1, [], generation=0, chunk_size=4096, audit={}, tree=tree)
        assert store.steps() == []


def test_retention_runs_after_the_commit_and_its_failure_is_a_warning(local_url: str) -> None:
    with small_store(local_url, keep_last=1, full_every=1) as store:
        store.save(_state(0), 1).wait()
        calls: list[list[int]] = []
        original = store._retention.collector.run

        def failing(plan):  # type: ignore[no-untyped-def]
            calls.append(store.steps())  # the new step is committed when retention runs
            raise OSError("disk gone")

        store._retention.collector.run = failing  # type: ignore[method-assign]
        with pytest.warns(UserWarning, match="retention after step 2 failed"):
            result = store.save(_state(1), 2).wait()
        assert calls == [[1, 2]]
        assert any("disk gone" in w for w in result.warnings)
        store._retention.collector.run = original  # type: ignore[method-assign]
        store.save(_state(2), 3).wait()
        assert store.steps() == [3]
