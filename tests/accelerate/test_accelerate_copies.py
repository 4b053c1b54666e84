"""A taken-over ``Accelerator`` beside the rest of a script: it and its prepared DataLoaders pickle
and deep-copy as Accelerate's own do (a copy is a plain one), and ``load_state``'s arguments are
checked as Accelerate checks them, ``map_location`` honoured."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_incremental import IncrementalCheckpointer, enable
from accelerate_incremental._takeover import installed
from accelerate_incremental._tracking import is_tracked
from lightning_incremental.core import CheckpointStore
from tests.accelerate.test_accelerate import _fresh_state, make_run  # noqa: F401


def test_taken_over_accelerator_and_loaders_pickle(tmp_path: Path) -> None:
    run = make_run()
    pickle.dumps(run.acc), pickle.dumps(run.loader)  # Accelerate's own pickle
    ckpt = enable(run.acc, str(tmp_path / "s"))
    assert ckpt is not None and is_tracked(run.loader)
    loader = pickle.loads(pickle.dumps(run.loader))
    assert type(loader) is type(run.loader).__bases__[0] and not is_tracked(loader)
    assert [len(b[0]) for b in loader] == [2] * 6
    assert copy.deepcopy([run.acc])[0] is run.acc  # Accelerate's deep copy: the same object
    for clone in (pickle.loads(pickle.dumps(run.acc)), pickle.loads(pickle.dumps([run.acc]))[0]):
        # a copy is a plain Accelerator: Accelerate's own methods, its loaders untracked
        assert installed(clone) is None
        for name in ("save_state", "load_state", "skip_first_batches"):
            method = getattr(clone, name)
            assert method.__func__ is getattr(type(clone), name) and method.__self__ is clone
        assert not any(is_tracked(d) for d in clone._dataloaders)
    # the original stays taken over
    assert run.acc.save_state() == ckpt.store.url and ckpt.steps() == [0]
    assert is_tracked(run.loader) and copy.deepcopy(run.loader) is not run.loader
    ckpt.release()


def test_taken_over_methods_pickle_alone(tmp_path: Path) -> None:
    run = make_run()
    assert enable(run.acc, str(tmp_path / "s")) is not None
    method = pickle.loads(pickle.dumps(run.acc.save_state))
    assert method.__func__ is type(run.acc).save_state  # of a plain copy


def _recorded_map_locations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    original = CheckpointStore.load

    def load(self: CheckpointStore, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("map_location"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "load", load)
    return seen


def test_load_state_checks_and_honours_map_location(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run()
    ckpt = enable(run.acc, str(tmp_path / "s"))
    assert ckpt is not None
    run.acc.save_state()
    with pytest.raises(TypeError, match="map location"):  # as Accelerate
        run.acc.load_state(map_location="invalid")
    with pytest.raises(TypeError, match="map location"):
        run.acc.load_state(map_location=torch.device("cpu"))
    seen = _recorded_map_locations(monkeypatch)
    assert run.acc.load_state(map_location="cpu") == 0
    assert run.acc.load_state(map_location="on_device") == 0
    assert run.acc.load_state() == 0
    assert seen == ["cpu", run.acc.device, "cpu"]
    ckpt.release()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"load_kwargs": {"weights_only": False}},
        {"strict": False},
        {"assign": True},
    ],
)
def test_load_state_refuses_arguments_it_cannot_honour(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    run = make_run()
    ckpt = enable(run.acc, str(tmp_path / "s"))
    assert ckpt is not None
    run.acc.save_state()
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=f"{name}.*incremental"):
        run.acc.load_state(**kwargs)
    # what Accelerate's defaults amount to is accepted
    assert run.acc.load_state(load_kwargs=None) == 0
    assert run.acc.load_state(load_kwargs={}, strict=True) == 0
    ckpt.release()


def test_checkpointer_load_honours_map_location(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(tmp_path / "s")) as ckpt:
        ckpt.save(1)
        seen = _recorded_map_locations(monkeypatch)
        assert ckpt.load(map_location="on_device") == 1
        assert ckpt.load() == 1
        with pytest.raises(TypeError, match="map location"):
            ckpt.load(map_location="gpu")
    assert seen == [run.acc.device, "cpu"]
