"""The adapters' policy for failed saves (``max_consecutive_failures``).

A save that fails in the background commits nothing: the adapter warns (naming the step, the
store and the error, and the count of failed saves in a row) and training goes on from the
previous committed checkpoint; a committed save resets the count; the K-th failed save in a row
raises ``CheckpointError`` naming the failed saves, chained from the first one's error.

Faults are injected with :class:`tests.faulty.FaultyStorage` on the Nth manifest write (one per
save). Every store runs with ``max_in_flight=1`` (the engine default): a save waits for the one
before it, so each failure surfaces at the very next save, deterministically.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from lightning.pytorch.callbacks import ModelCheckpoint

from accelerate_incremental import IncrementalCheckpointer
from lightning_incremental import IncrementalCheckpoint, IncrementalCheckpointIO
from lightning_incremental.core import (
    CheckpointError,
    CheckpointStore,
    ConfigError,
    StorageError,
    StoreConfig,
)
from lightning_incremental.core.storage import open_storage
from tests.conftest import assert_state_equal
from tests.faulty import FaultyStorage
from tests.jobs.lightning_job import fit

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*weights_only.*:UserWarning"),
]

Faults = list[dict[str, Any]]


def _policy_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "failed (" in str(w.message)]


# ---------------------------------------------------------------------------- the callback


def _faulty_callback_store(monkeypatch: pytest.MonkeyPatch, faults: Faults) -> None:
    """IncrementalCheckpoint's stores (rank 0's writer) on FaultyStorage armed with ``faults``."""
    from lightning_incremental.lightning import callback as module

    def faulty_store(url: str, **kwargs: Any) -> CheckpointStore:
        storage = FaultyStorage(open_storage(url, None))
        for fault in faults:
            storage.fail("manifest", **fault)
        return CheckpointStore(storage, config=kwargs["config"])

    monkeypatch.setattr(module, "CheckpointStore", faulty_store)


def test_callback_warns_goes_on_and_resumes_from_committed_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves every 3 steps (3 .. 24): 6 and 9 fail, 12 commits (the count restarts), 15 fails,
    18 and 21 commit, and the last save (24, at the end of training) fails: training finishes
    with a warning for each, and a new run resumes from the newest committed step."""
    store = tmp_path / "store"
    _faulty_callback_store(monkeypatch, [{"nth": 2, "times": 2}, {"nth": 5}, {"nth": 8}])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, trainer, ckpt = fit(store, every_n_train_steps=3)
    assert trainer.state.finished and trainer.global_step == 24
    messages = _policy_warnings(record)
    assert len(messages) == 4, messages
    for message, step, count in zip(messages, (6, 9, 15, 24), (1, 2, 1, 1), strict=True):
        assert f"step {step}: StorageError" in message and str(store) in message
        assert "injected fault" in message
        assert f"({count} consecutive failed save" in message
        assert "max_consecutive_failures=3" in message
    assert [r.step for r, _ in ckpt.results] == [3, 12, 18, 21]
    monkeypatch.undo()
    assert CheckpointStore(store).steps() == [3, 12, 18, 21]
    _, trainer, ckpt = fit(store, every_n_train_steps=3)  # resumes from 21, saves 24
    assert ckpt.resumed_from == 21 and trainer.global_step == 24
    assert CheckpointStore(store).steps() == [3, 12, 18, 21, 24]


def test_callback_raises_at_the_kth_failure_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    _faulty_callback_store(monkeypatch, [{"nth": 2, "times": None}])  # from step 6 on
    with pytest.warns(UserWarning) as record:
        with pytest.raises(CheckpointError, match="failed 3 times in a row") as info:
            fit(store, every_n_train_steps=3)
    messages = _policy_warnings(list(record))
    assert len(messages) == 2 and "step 6: StorageError" in messages[0], messages
    assert "step 9: StorageError" in messages[1] and "(2 consecutive" in messages[1]
    message = str(info.value)
    assert all(f"step {s}: StorageError" in message for s in (6, 9, 12)) and str(store) in message
    assert isinstance(info.value.__cause__, StorageError)  # the first failure's error
    assert CheckpointStore(store).steps() == [3]


# ---------------------------------------------------------------------------- the plug-in


class FaultyIO(IncrementalCheckpointIO):
    """Stores on FaultyStorage; ``faults`` armed on each store when it opens."""

    def __init__(self, faults: Faults | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.faults = faults or []
        self.storages: list[FaultyStorage] = []

    def _open_store(self, url: str, config: StoreConfig) -> CheckpointStore:
        storage = FaultyStorage(open_storage(url, None))
        for fault in self.faults:
            storage.fail("manifest", **fault)
        self.storages.append(storage)
        return CheckpointStore(storage, config=config)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"epoch": 0, "global_step": seed, "state_dict": {"w": torch.randn(32, 32)}}


def test_plugin_warns_and_the_path_keeps_its_previous_checkpoint(tmp_path: Path) -> None:
    plugin = FaultyIO([{"nth": 2}])  # the second save fails
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    plugin.save_checkpoint(_state(0), a)
    plugin.save_checkpoint(_state(1), a)  # fails in the background
    with pytest.warns(UserWarning, match=r"a\.ckpt \(step 1 of .*injected fault.*\(1 consecutive"):
        plugin.save_checkpoint(_state(2), b)
    plugin.wait()
    assert_state_equal(plugin.load_checkpoint(a), _state(0))  # the old pointer is back
    assert_state_equal(plugin.load_checkpoint(b), _state(2))
    plugin.teardown()


def test_plugin_raises_at_the_kth_failure_in_a_row_and_a_commit_resets(tmp_path: Path) -> None:
    # saves 0 and 2 fail, 1 commits in between: never 2 in a row
    plugin = FaultyIO([{"nth": 1}, {"nth": 3}], max_consecutive_failures=2)
    with pytest.warns(UserWarning) as record:
        for i in range(4):
            plugin.save_checkpoint(_state(i), tmp_path / f"{i}.ckpt")
        plugin.teardown()
    messages = _policy_warnings(list(record))
    assert len(messages) == 2 and all("(1 consecutive" in m for m in messages), messages
    assert [Path(p).name for p in sorted(map(str, tmp_path.glob("*.ckpt")))] == ["1.ckpt", "3.ckpt"]

    other = tmp_path / "other"
    other.mkdir()
    plugin = FaultyIO([{"nth": 1, "times": None}], max_consecutive_failures=2)
    with pytest.warns(UserWarning, match=r"0\.ckpt \(step 0"):
        plugin.save_checkpoint(_state(0), other / "x0.ckpt")
        plugin.save_checkpoint(_state(1), other / "x1.ckpt")
    with pytest.raises(CheckpointError, match="failed 2 times in a row") as info:
        plugin.save_checkpoint(_state(2), other / "x2.ckpt")
    assert "x0.ckpt (step 0" in str(info.value) and "x1.ckpt (step 1" in str(info.value)
    assert isinstance(info.value.__cause__, StorageError)
    plugin.teardown()  # nothing left to raise
    assert not (other / "x2.ckpt").exists()


def test_plugin_under_a_trainer_goes_on_and_resumes(tmp_path: Path) -> None:
    from tests.lightning.test_checkpoint_io import data, net, trainer

    plugin = FaultyIO([{"nth": 1}])  # the first ModelCheckpoint save (step 2) fails
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    with pytest.warns(UserWarning, match=r"step=2\.ckpt \(step 0 of .*\(1 consecutive"):
        trainer(tmp_path, plugin, [mc], max_steps=6).fit(net(), data())
    names = sorted(p.name for p in (tmp_path / "ckpts").glob("*.ckpt"))
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    loaded = plugin.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=6.ckpt")
    assert loaded["global_step"] == 6
    plugin.teardown()  # the load reopened the store: stop its threads
    resumed = trainer(tmp_path, IncrementalCheckpointIO(), [], max_steps=8)
    resumed.fit(net(), data(), ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"))
    assert resumed.global_step == 8


# ---------------------------------------------------------------------------- Accelerate


@pytest.fixture
def faulty_accelerate_store(monkeypatch: pytest.MonkeyPatch):
    """Arm faults on the store an IncrementalCheckpointer opens next."""
    from accelerate_incremental import checkpointer as module

    faults: Faults = []

    def faulty_store(url: str, *, storage_options: Any = None, **kwargs: Any) -> CheckpointStore:
        storage = FaultyStorage(open_storage(url, None))
        for fault in faults:
            storage.fail("manifest", **fault)
        return CheckpointStore(storage, **kwargs)

    monkeypatch.setattr(module, "CheckpointStore", faulty_store)
    yield faults
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_warns_goes_on_and_resumes(tmp_path: Path, faulty_accelerate_store) -> None:
    from tests.accelerate.test_accelerate import make_run, same, weights

    faulty_accelerate_store.extend([{"nth": 2, "times": 2}, {"nth": 5}])  # 2, 3 and 5 fail
    url = str(tmp_path / "store")
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, url)
    with pytest.warns(UserWarning) as record:
        for step in range(1, 7):
            run.counter.value = step
            ckpt.save(step)
        ckpt.close()
    messages = _policy_warnings(list(record))
    assert len(messages) == 3, messages
    for message, step, count in zip(messages, (2, 3, 5), (1, 2, 1), strict=True):
        assert f"step {step}: StorageError" in message and url in message
        assert f"({count} consecutive failed save" in message
    assert CheckpointStore(url).steps() == [1, 4, 6]
    expected = weights(run)
    faulty_accelerate_store.clear()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    other = make_run(hidden=16)
    with torch.no_grad():
        for p in other.acc.unwrap_model(other.model).parameters():
            p.add_(1.0)
    with IncrementalCheckpointer(other.acc, url) as again:
        assert again.load() == 6
    assert other.counter.value == 6 and same(weights(other), expected)


def test_accelerate_raises_at_the_kth_failure_in_a_row(
    tmp_path: Path, faulty_accelerate_store
) -> None:
    from tests.accelerate.test_accelerate import make_run

    faulty_accelerate_store.append({"nth": 2, "times": None})  # from the second save on
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "store"), max_consecutive_failures=2)
    ckpt.save(1)
    ckpt.save(2)  # fails in the background
    with pytest.warns(UserWarning, match=r"step 2: StorageError.*\(1 consecutive"):
        ckpt.save(3)  # fails too
    with pytest.raises(CheckpointError, match="failed 2 times in a row") as info:
        ckpt.save(4)
    assert "step 2: StorageError" in str(info.value) and "step 3: StorageError" in str(info.value)
    assert isinstance(info.value.__cause__, StorageError)
    ckpt.close()  # nothing left to raise
    assert CheckpointStore(str(tmp_path / "store")).steps() == [1]


def test_accelerate_wait_applies_the_policy(tmp_path: Path, faulty_accelerate_store) -> None:
    from tests.accelerate.test_accelerate import make_run

    faulty_accelerate_store.append({"nth": 1})
    run = make_run()
    ckpt = IncrementalCheckpointer(run.acc, str(tmp_path / "store"), max_consecutive_failures=1)
    ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"failed 1 times in a row.*step 1: StorageError"):
        ckpt.wait()
    ckpt.save(2)
    ckpt.close()
    assert CheckpointStore(str(tmp_path / "store")).steps() == [2]


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ConfigError, "max_consecutive_failures must be >= 1"),
        (-2, ConfigError, "max_consecutive_failures must be >= 1"),
        (True, TypeError, "max_consecutive_failures must be an int"),
        (2.0, TypeError, "max_consecutive_failures must be an int"),
        ("3", TypeError, "max_consecutive_failures must be an int"),
        (None, TypeError, "max_consecutive_failures must be an int"),
    ],
)
def test_invalid_max_consecutive_failures_is_refused(
    tmp_path: Path, value: Any, error: type[Exception], match: str
) -> None:
    from accelerate import Accelerator

    with pytest.raises(error, match=match):
        IncrementalCheckpoint(tmp_path / "a", max_consecutive_failures=value)
    with pytest.raises(error, match=match):
        IncrementalCheckpointIO(max_consecutive_failures=value)
    try:
        acc = Accelerator(cpu=True)
        with pytest.raises(error, match=match):
            IncrementalCheckpointer(acc, str(tmp_path / "b"), max_consecutive_failures=value)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert not (tmp_path / "b").exists()


def test_accelerate_config_file_forwards_max_consecutive_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from accelerate_incremental._flag import settings

    config = tmp_path / "incremental.json"
    config.write_text(json.dumps({"dirpath": "ckpts", "max_consecutive_failures": 1}))
    assert settings({"ACCELERATE_INCREMENTAL_CONFIG": str(config)}) == {
        "dirpath": "ckpts",
        "max_consecutive_failures": 1,
    }
