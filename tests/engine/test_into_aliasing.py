"""``load(into=...)`` with destinations that share memory.

Two checkpoint tensors decoded into overlapping memory of ``into`` (tied weights in the model,
views of one storage) would be written concurrently: a load that mixes both. Such a load is
refused with a ConfigError naming both keys before anything is read — ``into`` untouched, nothing
quarantined. A checkpoint that stored one tensor under both keys (tied when saved) loads into
tied destinations, and disjoint views of one storage load as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.core.load import loader as loader_module
from tests.conftest import small_store


def _no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a load gets as far as reading any object."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("objects were read")

    monkeypatch.setattr(loader_module, "restore_arrays", refuse)


def _refused(
    store: CheckpointStore, into: dict, monkeypatch: pytest.MonkeyPatch, *keys: str
) -> str:
    with monkeypatch.context() as patch:
        _no_reads(patch)
        with pytest.raises(ConfigError) as info:
            store.load(1, into=into)
    message = str(info.value)
    for key in keys:
        assert key in message
    assert "into" in message
    return message


def test_tied_destinations_for_an_untied_checkpoint_are_refused_before_any_read(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = torch.randn(3000), torch.randn(3000)
    with small_store(local_url) as store:
        store.save({"a": a, "b": b}, 1).wait()
        tied = torch.full((3000,), 7.0)
        _refused(store, {"a": tied, "b": tied}, monkeypatch, "state['a']", "state['b']")
        assert torch.equal(tied, torch.full((3000,), 7.0))  # untouched
        assert store.steps() == [1] and not store._history.quarantined  # nothing quarantined
        back = store.load(1)  # the checkpoint is intact
        assert torch.equal(back["a"], a) and torch.equal(back["b"], b)
        untied = {"a": torch.zeros(3000), "b": torch.zeros(3000)}
        store.load(1, into=untied)
        assert torch.equal(untied["a"], a) and torch.equal(untied["b"], b)


def test_partially_overlapping_views_are_refused(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with small_store(local_url) as store:
        store.save({"x": {"a": torch.randn(10), "b": torch.randn(10)}}, 1).wait()
        base = torch.zeros(20)
        into = {"x": {"a": base[0:10], "b": base[5:15]}}
        _refused(store, into, monkeypatch, "state['x']['a']", "state['x']['b']")
        assert torch.equal(base, torch.zeros(20))
        # A partial load that leaves one of them out is fine.
        back = store.load(1, into={"x": {"a": into["x"]["a"]}})
        assert back["x"]["a"] is into["x"]["a"] and torch.equal(base[10:], torch.zeros(10))


def test_overlap_is_found_in_memory_not_by_storage_object(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tensors over overlapping parts of one numpy buffer have storages of their own."""
    with small_store(local_url) as store:
        store.save({"a": torch.randn(8, 4), "b": torch.randn(8, 4)}, 1).wait()
        buffer = np.zeros(64, np.float32)
        a = torch.from_numpy(buffer[:32]).view(8, 4)
        b = torch.from_numpy(buffer[31:63]).view(8, 4)
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        _refused(store, {"a": a, "b": b}, monkeypatch, "state['a']", "state['b']")
        # Different dtypes over the same bytes overlap too.
        store.save({"a": torch.randn(32), "b": torch.arange(32, dtype=torch.int32)}, 2).wait()
        w = torch.zeros(32)
        with pytest.raises(ConfigError, match="overlap"):
            store.load(2, into={"a": w, "b": w.view(torch.int32)})


def test_one_overlap_among_many_destinations_is_found(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 2000
    flat = torch.zeros(4 * n)
    with small_store(local_url, chunk_size=1 << 20) as store:
        store.save({f"t{i}": torch.full((4,), float(i)) for i in range(n)}, 1).wait()
        views = {f"t{i}": flat[4 * i : 4 * i + 4] for i in range(n)}
        store.load(1, into=views)  # adjacent, disjoint: fine
        assert torch.equal(flat, torch.arange(n).repeat_interleave(4).float())
        views["t1234"] = flat[4 * 777 + 3 : 4 * 777 + 7]  # over the end of t777 and t778
        _refused(store, views, monkeypatch, "state['t1234']")


def test_a_tied_checkpoint_loads_into_tied_destinations(local_url: str) -> None:
    w = torch.randn(64, 32)
    with small_store(local_url) as store:
        store.save({"embed": w, "head": w, "other": torch.randn(5)}, 1).wait()
        assert len(store.manifest(1).tensors) == 2  # stored once
        tied = torch.zeros(64, 32)
        back = store.load(1, into={"embed": tied, "head": tied})
        assert back["embed"] is tied and back["head"] is tied
        assert torch.equal(tied, w)
        assert tied.view(torch.int32).equal(w.view(torch.int32))  # bit-exact


def test_equal_tensors_saved_apart_load_into_tied_destinations(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two entries of the same bytes (a tied model saved from copies) restore into one tensor:
    each chunk is decoded once. Into two overlapping views they are still refused."""
    w = torch.randn(3000)
    with small_store(local_url) as store:
        store.save({"embed": w, "head": w.clone()}, 1).wait()
        assert len(store.manifest(1).tensors) == 2
        tied = torch.zeros(3000)
        back = store.load(1, into={"embed": tied, "head": tied})
        assert back["embed"] is tied and back["head"] is tied and torch.equal(tied, w)
        base = torch.zeros(3001)
        _refused(store, {"embed": base[:3000], "head": base[1:]}, monkeypatch, "state['head']")


def test_disjoint_views_of_one_storage_load(local_url: str) -> None:
    w = torch.randn(10)
    matrix = torch.randn(6, 4)
    with small_store(local_url) as store:
        store.save({"a": w[:5], "b": w[5:], "top": matrix[:3], "bottom": matrix[3:]}, 1).wait()
        assert len(store.manifest(1).tensors) == 4
        flat, rows = torch.zeros(10), torch.zeros(6, 4)
        into = {"a": flat[:5], "b": flat[5:], "top": rows[:3], "bottom": rows[3:]}
        back = store.load(1, into=into)
        assert torch.equal(flat, w) and torch.equal(rows, matrix)
        assert back["a"] is into["a"] and back["bottom"] is into["bottom"]


def test_empty_destinations_share_nothing(local_url: str) -> None:
    with small_store(local_url) as store:
        store.save({"a": torch.zeros(0), "b": torch.zeros(0, 3)}, 1).wait()
        base = torch.zeros(4)
        back = store.load(1, into={"a": base[:0], "b": base[:0].view(0, 3)})
        assert back["a"].numel() == 0 and back["b"].shape == (0, 3)
