"""A Trainer's ``train()`` is its start as a writer (``enable_trainer``): a second Trainer on the
store of a live run, or on a store it cannot write, is refused there — before it resumes or
takes a step — naming the live writer (or the location and the error), and the live run is left
alone; ``evaluate`` only reads, beside a live writer too."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from accelerate_incremental import enable_trainer
from lightning_incremental.core import CheckpointStore, StoreNotWritableError, WriterLeaseError
from tests.faulty import read_only_directory
from tests.hf.trainers import tiny_trainer, weights
from tests.live_writer import JOB, live_writer, store_files


def live_run(tmp_path: Path) -> Path:
    """A run that saved steps 5 and 10 to ``tmp_path/store``."""
    store = tmp_path / "store"
    first = tiny_trainer(tmp_path / "first")
    checkpointer = enable_trainer(first, str(store))
    first.train()
    checkpointer.close()  # the run ends: its process lets go of the lease
    assert CheckpointStore(store).steps() == [5, 10]
    return store


def second_trainer(tmp_path: Path, store: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """A second Trainer into ``store``: resumed from step 10 it would train to 20, saving every 2
    steps. Its initial weights."""
    second = tiny_trainer(tmp_path / "second", max_steps=20, save_steps=2)
    enable_trainer(second, str(store))
    return second, weights(second)


def assert_not_started(trainer: object, initial: dict[str, torch.Tensor], root: Path) -> None:
    assert trainer.state.global_step == 0  # type: ignore[attr-defined]
    now = weights(trainer)
    assert all(torch.equal(now[k], initial[k]) for k in initial), "weights changed"
    assert not list(root.glob("checkpoint-*")), "a checkpoint folder was written"


def test_train_into_a_live_runs_store_is_refused_before_it_resumes(tmp_path: Path) -> None:
    store = live_run(tmp_path)
    with live_writer(store) as live:
        before = store_files(store)
        second, initial = second_trainer(tmp_path, store)
        with pytest.raises(WriterLeaseError) as raised:
            second.train()  # type: ignore[attr-defined]
        message = str(raised.value)
        for named in (f"host {socket.gethostname()}", f"pid {live.pid}", f"job {JOB}"):
            assert named in message
        assert "wait for that writer to finish" in message and "another dirpath" in message
        assert_not_started(second, initial, tmp_path / "second")
        assert store_files(store) == before
    assert live.still_writer


def test_train_on_a_store_that_cannot_be_written_is_refused_before_it_resumes(
    tmp_path: Path,
) -> None:
    store = live_run(tmp_path)
    before = store_files(store)
    with read_only_directory(store):
        second, initial = second_trainer(tmp_path, store)
        with pytest.raises(
            StoreNotWritableError, match=f"cannot write the checkpoint store {store}"
        ):
            second.train()  # type: ignore[attr-defined]
        assert_not_started(second, initial, tmp_path / "second")
    assert store_files(store) == before


def test_evaluate_beside_a_live_writer_works(tmp_path: Path) -> None:
    store = live_run(tmp_path)
    with live_writer(store) as live:
        data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64}] * 4
        evaluator = tiny_trainer(tmp_path / "eval", eval_dataset=data)
        enable_trainer(evaluator, str(store))
        assert "eval_loss" in evaluator.evaluate()
    assert live.still_writer
