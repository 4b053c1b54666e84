"""A Lightning run's start as a writer, on real Trainers: a second run into the store of a live
one, and a run on a store it cannot write, are refused when they start — the callback's before
it resumes or trains, the plug-in's at its first save, before it writes — and the live run is
left alone; what only reads (validate, predict, loading) works beside a live writer; a dead
writer's lease and a restarted job's previous incarnation are taken over."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_incremental import IncrementalCheckpoint, IncrementalCheckpointIO
from lightning_incremental.core import (
    CheckpointStore,
    StoreNotWritableError,
    WriterLeaseError,
)
from lightning_incremental.core.commit import fencing, owner
from tests.conftest import dead_pid
from tests.engine.test_lease import launched, plant, records
from tests.faulty import read_only_directory
from tests.jobs.lightning_job import TinyModel, fit, weights
from tests.lightning.test_checkpoint_io import ckpt_files, data, net
from tests.lightning.test_checkpoint_io import trainer as plugin_trainer
from tests.live_writer import JOB, live_writer, store_files

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*:DeprecationWarning"),
]


def live_run(store: Path) -> None:
    """A run that saved checkpoints up to step 8 (the end of its one epoch)."""
    fit(store, every_n_train_steps=2, trainer={"max_epochs": 1})


def second_run(store: Path, **options: Any) -> tuple[TinyModel, L.Trainer, dict[str, Any]]:
    """A second run into ``store``, two epochs: resumed from step 8 it would train 8 steps more
    and save at each; its model and trainer, and its initial weights."""
    L.seed_everything(1, verbose=False)
    module = TinyModel()
    ckpt = IncrementalCheckpoint(store, every_n_train_steps=1, **options)
    run = L.Trainer(
        callbacks=[ckpt],
        max_epochs=2,
        val_check_interval=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(store.parent / "second"),
    )
    return module, run, weights(module)


def assert_not_started(module: TinyModel, run: L.Trainer, initial: dict[str, Any]) -> None:
    """Nothing was resumed (the weights are the new model's own) and nothing trained."""
    assert run.global_step == 0
    now = weights(module)
    assert all(torch.equal(now[k], initial[k]) for k in initial), "weights changed"


def assert_names_the_live_writer(error: BaseException, pid: int) -> None:
    message = str(error)
    for named in (f"host {socket.gethostname()}", f"pid {pid}", f"job {JOB}"):
        assert named in message, message
    assert "wait for that writer to finish" in message and "another dirpath" in message


# ---------------------------------------------------------------------------- the callback


def test_a_second_run_into_a_live_runs_store_is_refused_before_it_resumes(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    live_run(store)
    with live_writer(store) as live:
        before = store_files(store)
        module, run, initial = second_run(store)
        with pytest.raises(WriterLeaseError) as raised:
            run.fit(module)
        assert_names_the_live_writer(raised.value, live.pid)
        assert_not_started(module, run, initial)
        assert store_files(store) == before, "the live run's store changed"
    assert live.still_writer, "the live run lost its lease"
    assert fencing.generations(CheckpointStore(store).storage) == []


@pytest.mark.parametrize("checkpoints", [True, False], ids=["with-checkpoints", "empty"])
def test_a_store_that_cannot_be_written_is_refused_before_it_resumes(
    tmp_path: Path, checkpoints: bool
) -> None:
    store = tmp_path / "store"
    if checkpoints:
        live_run(store)
    store.mkdir(exist_ok=True)
    before = store_files(store)
    with read_only_directory(store):
        module, run, initial = second_run(store)
        with pytest.raises(
            StoreNotWritableError, match=f"cannot write the checkpoint store {store}"
        ):
            run.fit(module)
        assert_not_started(module, run, initial)
    assert store_files(store) == before


def test_reading_beside_a_live_writer_and_from_a_read_only_store_works(tmp_path: Path) -> None:
    """validate (test, predict alike) with the callback attached only reads: no lease, no
    probe."""
    store = tmp_path / "store"
    live_run(store)
    with live_writer(store) as live:
        module, run, _ = second_run(store)
        assert run.validate(module, verbose=False)
        with CheckpointStore(store) as reader:
            assert reader.load()["global_step"] == 8
    assert live.still_writer
    with read_only_directory(store):
        module, run, _ = second_run(store)
        assert run.validate(module, verbose=False)


def test_a_dead_writers_lease_is_taken_over_at_the_start(tmp_path: Path) -> None:
    store = tmp_path / "store"
    live_run(store)
    sequence = max(records(str(store))) + 1
    here = {"host": socket.gethostname(), "boot": owner.boot_id(), "pidns": owner.pid_namespace()}
    plant(str(store), sequence, pid=dead_pid(), job="crashed-job", **here)
    module, run, _ = second_run(store)
    run.fit(module)
    assert run.global_step == 16
    with CheckpointStore(store) as reader:
        assert reader.steps()[-1] == 16


def test_a_restarted_job_takes_over_from_its_previous_incarnation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun --max-restarts on another node: the previous incarnation's lease is still fresh;
    the restart claims a newer generation and takes it over at its start."""
    store = tmp_path / "store"
    live_run(store)
    launched(monkeypatch, TORCHELASTIC_RUN_ID="job-a", TORCHELASTIC_RESTART_COUNT="1")
    plant(str(store), max(records(str(store))) + 1, job="job-a", generation=0)
    module, run, _ = second_run(store)
    run.fit(module)
    assert run.global_step == 16 and run.callbacks[-1].generation == 1


def test_a_requeued_slurm_run_takes_over_from_its_earlier_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single process requeued by SLURM onto another node while its earlier run's lease is
    still fresh: it claims a generation at its start and takes that lease over, instead of
    being refused (or, before, failing its saves until that lease went stale)."""
    store = tmp_path / "store"
    live_run(store)
    launched(monkeypatch, SLURM_JOB_ID="4711", SLURM_RESTART_COUNT="1")
    earlier = {"job": "slurm:4711", "requeue": ["slurm:4711", 0], "generation": 0}
    plant(str(store), max(records(str(store))) + 1, **earlier)
    module, run, _ = second_run(store)
    run.fit(module)
    assert run.global_step == 16
    with CheckpointStore(store) as reader:
        assert reader.steps()[-1] == 16 and reader.manifest().generation == 1


# ---------------------------------------------------------------------------- the plug-in


def plugin_run(root: Path) -> tuple[L.LightningModule, L.Trainer, Path]:
    """A fit saving through the plug-in into ``root/ckpts`` after every step."""
    ckpts = root / "ckpts"
    mc = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=-1)
    run = plugin_trainer(root, IncrementalCheckpointIO(fsync=False), [mc], max_steps=6)
    return net(), run, ckpts


def test_the_plugin_refuses_a_live_writers_directory_at_its_first_save(tmp_path: Path) -> None:
    module, run, ckpts = plugin_run(tmp_path)
    store = ckpts / ".incremental"
    with CheckpointStore(store) as first:
        first.save({"w": torch.ones(4)}, 0).wait()
    with live_writer(store) as live:
        before = store_files(store)
        with pytest.raises(WriterLeaseError) as raised:
            run.fit(module, data())
        assert_names_the_live_writer(raised.value, live.pid)
        assert run.global_step == 1, "not at the first save"
        assert not ckpt_files(ckpts), "a pointer file was written"
        assert store_files(store) == before
    assert live.still_writer


def test_the_plugin_refuses_a_read_only_directory_at_its_first_save(tmp_path: Path) -> None:
    module, run, ckpts = plugin_run(tmp_path)
    ckpts.mkdir()
    with read_only_directory(ckpts):
        with pytest.raises(StoreNotWritableError, match="cannot write the checkpoint store"):
            run.fit(module, data())
        assert run.global_step == 1
    assert not list(ckpts.iterdir())


def test_the_plugin_loads_beside_a_live_writer(tmp_path: Path) -> None:
    module, run, ckpts = plugin_run(tmp_path)
    run.fit(module, data())
    last = sorted(ckpt_files(ckpts))[-1]
    with live_writer(ckpts / ".incremental") as live:
        evaluator = plugin_trainer(tmp_path / "eval", IncrementalCheckpointIO())
        assert evaluator.validate(net(1), data(), ckpt_path=last, verbose=False)
    assert live.still_writer
