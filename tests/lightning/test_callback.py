"""IncrementalCheckpoint on real Trainers: exact resume, schedules, exceptions, figures, CLI.

Every exactness test compares an interrupted-then-restarted run, bit for bit, with an
uninterrupted run of the same configuration (``tests/jobs/lightning_job.py`` holds the model:
dropout, noise drawn from torch, numpy and Python at every read, SGD with momentum, a StepLR
schedule, validation every 4 batches, 8 batches per epoch, 3 epochs).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_incremental import IncrementalCheckpoint
from lightning_incremental.core import CheckpointError, CheckpointStore, ConfigError
from tests.jobs.lightning_job import (
    FEATURES,
    Interrupted,
    NoisyData,
    StatefulLoader,
    TinyModel,
    fit,
    weights,
)

JOB = Path(__file__).resolve().parents[1] / "jobs" / "lightning_job.py"
REPO = Path(__file__).resolve().parents[2]


def background_threads() -> list[threading.Thread]:
    """This library's threads still running. Stores that other tests dropped without closing
    (an Accelerator's checkpointer, say) end theirs when collected: collect them first."""
    gc.collect()
    return [t for t in threading.enumerate() if t.name.startswith("li-")]


# ---------------------------------------------------------------------------- data variants


class StreamData(IterableDataset):
    """An IterableDataset without state: the same stream on every iteration."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(7)
        for _ in range(64):
            yield torch.randn(FEATURES, generator=g), torch.randn(1, generator=g)


class VariantModel(TinyModel):
    def __init__(self, loader: str = "stateful", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loader = loader

    def train_dataloader(self) -> DataLoader:
        if self.loader == "iterable":
            return DataLoader(StreamData(), batch_size=8)
        g = torch.Generator().manual_seed(3)
        return StatefulLoader(NoisyData(), batch_size=8, shuffle=True, generator=g)


def fit_variant(dirpath: Path, loader: str, **kwargs: Any) -> tuple[Any, L.Trainer, Any]:
    """``fit`` with a :class:`VariantModel` in place of TinyModel."""
    import tests.jobs.lightning_job as job

    original = job.TinyModel
    job.TinyModel = lambda **kw: VariantModel(loader, **kw)  # type: ignore[assignment,misc]
    try:
        return fit(dirpath, **kwargs)
    finally:
        job.TinyModel = original  # type: ignore[misc]


def final_state(module: nn.Module, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The weights and the optimizer's momentum buffers."""
    state = weights(module)
    for index, entry in trainer.optimizers[0].state_dict()["state"].items():
        state[f"momentum.{index}"] = entry["momentum_buffer"].clone()
    return state


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert actual.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differ, f"not bit-identical: {differ}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, torch.Tensor]]:
    """The final state of an uninterrupted run per configuration (the callback attached, saving
    nothing: saving must not change training either)."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(model: dict[str, Any], trainer: dict[str, Any], loader: str | None = None):
        key = repr((sorted(model.items()), sorted(trainer.items()), loader))
        if key not in cache:
            where = tmp_path_factory.mktemp("reference") / "store"
            run = fit_variant if loader else (lambda d, _, **kw: fit(d, **kw))
            module, t, _ = run(
                where,
                loader,
                model=model,
                trainer=trainer,
                every_n_epochs=0,
                save_on_train_end=False,
            )
            cache[key] = final_state(module, t)
        return cache[key]

    return get


# ---------------------------------------------------------------------------- exactness

SCENARIOS = {
    # id: (model, trainer, checkpoint args, crash steps, steps resumed from)
    "mid-epoch": ({}, {}, {"every_n_train_steps": 3}, [10], [9]),
    "first-epoch-then-after-validation": (
        {"shuffle": "global"},
        {},
        {"every_n_train_steps": 3},
        [7, 14],
        [6, 12],  # step 12 ends batch 4 of epoch 1: saved after that batch's validation
    ),
    "epoch-boundary": ({}, {}, {"every_n_epochs": 1}, [12], [8]),
    "worker-processes": ({"num_workers": 2}, {}, {"every_n_train_steps": 3}, [10], [9]),
    "time-interval-sequential": (
        {"shuffle": "none"},
        {},
        {"train_time_interval": timedelta(microseconds=1)},
        [10],
        [9],
    ),
    "gradient-accumulation": (
        {},
        {"accumulate_grad_batches": 2},
        {"every_n_train_steps": 3},
        [5],
        [3],  # step 3 is batch 6 of epoch 0
    ),
    "on-exception": ({}, {}, {"every_n_epochs": 0, "save_on_exception": True}, [10], [10]),
    # a resumed epoch interrupted again (8 batches an epoch: steps 3 and 5 are both in epoch 0)
    "twice-in-one-epoch": ({}, {}, {"every_n_train_steps": 2}, [3, 5], [2, 4]),
    "twice-in-one-epoch-global-rng": (
        {"shuffle": "global"},
        {},
        {"every_n_train_steps": 2},
        [11, 13],
        [10, 12],
    ),
    "max-steps-epoch-boundary": (
        {},
        {"max_steps": 20, "max_epochs": -1},
        {"every_n_epochs": 1},
        [18],
        [16],  # iteration-based: Lightning ends the saved epoch again, then starts the next
    ),
}


#: Scenarios that start processes of their own (DataLoader workers): the slow subset.
SLOW_SCENARIOS = {"worker-processes"}


@pytest.mark.parametrize(
    "scenario",
    [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SCENARIOS else s for s in SCENARIOS],
)
def test_interrupted_run_resumes_bit_identical(scenario: str, tmp_path: Path, reference) -> None:
    model, trainer, args, crashes, resumed = SCENARIOS[scenario]
    args = {"save_on_exception": False, **args}
    store = tmp_path / "store"
    for crash_at, expected in zip(crashes, resumed):
        _, t, _ = fit(store, crash_at=crash_at, model=model, trainer=trainer, **args)
        assert t.state.status == "interrupted"
        assert expected in CheckpointStore(store).steps()
    module, t, ckpt = fit(store, model=model, trainer=trainer, **args)
    assert ckpt.resumed_from == resumed[-1]
    assert t.global_step == trainer.get(
        "max_steps", 24 // trainer.get("accumulate_grad_batches", 1)
    )
    assert_bit_identical(final_state(module, t), reference(model, trainer))


@pytest.mark.parametrize(
    ("loader", "warning"),
    [("stateful", None), ("iterable", "IterableDataset without state_dict")],
)
def test_stateful_and_iterable_loaders_resume_bit_identical(
    loader: str, warning: str | None, tmp_path: Path, reference
) -> None:
    store = tmp_path / "store"
    kwargs: dict[str, Any] = {"every_n_train_steps": 3, "save_on_exception": False}
    fit_variant(store, loader, crash_at=10, **kwargs)
    if warning:
        with pytest.warns(UserWarning, match=warning):
            module, t, ckpt = fit_variant(store, loader, **kwargs)
    else:
        module, t, ckpt = fit_variant(store, loader, **kwargs)
    assert ckpt.resumed_from == 9
    assert_bit_identical(final_state(module, t), reference({}, {}, loader))


def test_persistent_workers_resume_warns_what_is_not_exact(tmp_path: Path) -> None:
    model = {"num_workers": 2, "persistent_workers": True}
    fit(tmp_path / "store", crash_at=10, model=model, every_n_train_steps=3)
    with pytest.warns(UserWarning, match="persistent_workers=True: its worker processes start"):
        _, _, ckpt = fit(tmp_path / "store", model=model, every_n_train_steps=3)
    assert ckpt.resumed_from == 10


@pytest.mark.slow  # two Python processes of their own
def test_sigkilled_process_rerun_with_same_command_is_bit_identical(tmp_path: Path) -> None:
    command = [sys.executable, str(JOB), "single", "--dir", str(tmp_path / "d")]
    command += ["--out", str(tmp_path / "out")]
    killed = subprocess.run([*command, "--kill-at", "10"], cwd=REPO, capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result == {"resumed_from": 9, "equal": True}


@pytest.mark.slow
def test_ddp_two_ranks_resume_bit_identical(tmp_path: Path) -> None:
    """Real processes: Lightning's DDP launcher starts rank 1 by re-running the job script."""
    out = tmp_path / "out"
    command = [sys.executable, str(JOB), "ddp", "--dir", str(tmp_path / "d"), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = {"mid": 9, "epoch": 4, "epoch_steps": 8, "stateful": 9}
    assert json.loads((out / "result.json").read_text()) == {"resumed_from": resumed}
    assert "resumed mid-epoch 2: skipped the 1 batches" in done.stderr
    for rank in (0, 1):  # each rank's own buffers (broadcast_buffers=False) restored too
        expected = torch.load(out / f"ref_rank{rank}.pt")
        for name in ("mid", "epoch", "epoch_steps"):
            assert_bit_identical(torch.load(out / f"{name}_rank{rank}.pt"), expected)
        # stateful loaders, each rank its own order: each rank's own loader state came back
        expected = torch.load(out / f"stateful_ref_rank{rank}.pt")
        assert_bit_identical(torch.load(out / f"stateful_rank{rank}.pt"), expected)
    for name in ("ref", "stateful_ref"):
        reference = [torch.load(out / f"{name}_rank{rank}.pt") for rank in (0, 1)]
        assert not torch.equal(reference[0]["seen"], reference[1]["seen"])  # they differ


# ---------------------------------------------------------------------------- behaviour


def test_automatic_resume_is_logged_with_step_and_location(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    fit(store, crash_at=10, every_n_train_steps=3, save_on_exception=False)
    with caplog.at_level(logging.INFO):
        _, t, ckpt = fit(store, every_n_train_steps=3)
    assert f"IncrementalCheckpoint: resuming from step 9 (epoch 1) of {store}" in caplog.text
    assert "resumed mid-epoch 1: skipped the 1 batches already trained on" in caplog.text
    assert t.ckpt_path == f"{store} (step 9)"
    assert ckpt.resumed_from == 9


def test_corrupt_newest_checkpoint_falls_back_and_stays_exact(tmp_path: Path, reference) -> None:
    store = tmp_path / "store"
    args: dict[str, Any] = {"every_n_train_steps": 3, "save_on_exception": False}
    fit(store, crash_at=10, **args)
    engine = CheckpointStore(store)
    only_9 = set(engine.manifest(9).packs) - set(engine.manifest(6).packs)
    for name in only_9:  # flip one byte in every object that only step 9 uses
        data = bytearray((store / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (store / name).write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checkpoint step 9 .* is unusable"):
        module, t, ckpt = fit(store, **args)
    assert ckpt.resumed_from == 6
    assert 9 in CheckpointStore(store).steps()  # saved again by the resumed run
    assert_bit_identical(final_state(module, t), reference({}, {}))


def test_finished_run_rerun_resumes_at_the_end_and_trains_no_more(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first, _, _ = fit(store, every_n_epochs=1)
    assert CheckpointStore(store).steps() == [8, 16, 24]
    again, t, ckpt = fit(store, every_n_epochs=1)
    assert ckpt.resumed_from == 24 and t.global_step == 24
    assert_bit_identical(weights(again), weights(first))
    assert CheckpointStore(store).steps() == [8, 16, 24]


def test_explicit_ckpt_path_is_honoured(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ckpt"

    class SaveAt(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(plain)

    fit(tmp_path / "first", callbacks=[SaveAt()], every_n_epochs=0)
    with pytest.warns(UserWarning, match="not written by IncrementalCheckpoint"):
        _, t, ckpt = fit(tmp_path / "second", ckpt_path=str(plain), every_n_epochs=1)
    assert ckpt.resumed_from is None
    assert t.ckpt_path == str(plain)
    assert CheckpointStore(tmp_path / "second").steps() == [16, 24]


def test_save_on_exception_skips_an_interrupted_training_step(tmp_path: Path) -> None:
    class FailingStep(TinyModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 5:
                raise Interrupted("in the middle of a step")
            return super().training_step(batch, batch_idx)

    store = tmp_path / "store"
    ckpt = IncrementalCheckpoint(store, every_n_train_steps=3)
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt],
    )
    with (
        pytest.warns(UserWarning, match="it interrupted a training step"),
        pytest.raises(Interrupted),
    ):
        trainer.fit(FailingStep())
    assert CheckpointStore(store).steps() == [3]
    assert not background_threads()


def test_exception_after_a_step_saves_then_stops_background_work(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _, t, ckpt = fit(store, crash_at=10, every_n_train_steps=4)
    assert t.state.status == "interrupted"
    assert CheckpointStore(store).steps() == [4, 8, 10]
    assert ckpt.last_saved_step == 10
    assert not background_threads()


class RecordingLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))


def test_figures_reach_the_loggers_and_state_dict(tmp_path: Path) -> None:
    recorder = RecordingLogger()
    _, _, ckpt = fit(tmp_path / "store", trainer={"logger": recorder}, every_n_epochs=1)
    figures = {s: m for s, m in recorder.metrics if "incremental_checkpoint/bytes_written" in m}
    assert sorted(figures) == [8, 16, 24]
    for metrics in figures.values():
        assert set(metrics) == {
            f"incremental_checkpoint/{k}"
            for k in ("bytes_written", "bytes_logical", "ratio", "blocked_s", "save_s")
        }
        logical = metrics["incremental_checkpoint/bytes_logical"]
        written = metrics["incremental_checkpoint/bytes_written"]
        assert logical > 0 and written > 0
        assert metrics["incremental_checkpoint/ratio"] == pytest.approx(logical / written)
        assert metrics["incremental_checkpoint/blocked_s"] >= 0
    assert [r.step for r, _ in ckpt.results] == [8, 16, 24]
    assert all(
        r.bytes_written == figures[r.step]["incremental_checkpoint/bytes_written"]
        for r, _ in ckpt.results
    )
    state = ckpt.state_dict()
    assert state["last_saved_step"] == 24 and state["saves"] == 3
    assert state["bytes_written"] == sum(
        m["incremental_checkpoint/bytes_written"] for m in figures.values()
    )
    other = IncrementalCheckpoint(tmp_path / "store")
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_saved_checkpoint_is_what_trainer_save_checkpoint_writes(tmp_path: Path) -> None:
    _, t, _ = fit(tmp_path / "store", every_n_epochs=0)
    saved = CheckpointStore(tmp_path / "store").load(24)
    dumped = t._checkpoint_connector.dump_checkpoint(weights_only=False)
    rank_state = saved.pop("lightning_incremental")
    assert rank_state["world_size"] == 1 and len(rank_state["ranks"]) == 1
    assert saved.keys() == dumped.keys()
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "hyper_parameters"):
        assert repr(saved[key]) == repr(dumped[key]), key
    assert saved["epoch"] == dumped["epoch"] and saved["global_step"] == 24


def test_failed_background_save_surfaces_at_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_incremental.core.storage import open_storage
    from lightning_incremental.lightning import callback as module
    from tests.faulty import FaultyStorage

    storages: list[FaultyStorage] = []

    def faulty_store(url: str, **kwargs: Any) -> CheckpointStore:
        storage = FaultyStorage(open_storage(url, None))
        storage.fail("manifest", nth=2)  # the second checkpoint never commits
        storages.append(storage)
        return CheckpointStore(storage, config=kwargs["config"])

    monkeypatch.setattr(module, "CheckpointStore", faulty_store)
    with pytest.raises(CheckpointError, match="step 6"):  # stop at the first failure
        fit(tmp_path / "store", every_n_train_steps=3, max_chain=0, max_consecutive_failures=1)
    assert CheckpointStore(tmp_path / "store").steps() == [3]


def test_fast_dev_run_saves_nothing(tmp_path: Path) -> None:
    fit(tmp_path / "store", trainer={"fast_dev_run": True}, every_n_train_steps=1)
    assert not (tmp_path / "store").exists()


# ---------------------------------------------------------------------------- bad input


def test_checkpoint_of_a_different_model_names_the_keys(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fit(store, every_n_epochs=1, trainer={"max_epochs": 1})
    with pytest.raises(RuntimeError, match=r"size mismatch for net\.0\.weight"):
        fit(store, model={"hidden": 32}, every_n_epochs=1, trainer={"max_epochs": 2})

    class Extra(TinyModel):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.head = nn.Linear(1, 1)

    ckpt = IncrementalCheckpoint(store)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, callbacks=[ckpt])
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head\.weight"'):
        trainer.fit(Extra())


def test_values_that_need_pickle_are_refused_unless_allowed(tmp_path: Path) -> None:
    class WithPath(TinyModel):
        def __init__(self, where: Path = tmp_path) -> None:
            super().__init__()
            self.save_hyperparameters()

    def run(**args: Any) -> L.Trainer:
        ckpt = IncrementalCheckpoint(tmp_path / "store", every_n_train_steps=4, **args)
        trainer = L.Trainer(max_steps=4, logger=False, enable_progress_bar=False, callbacks=[ckpt])
        trainer.fit(WithPath())
        return trainer

    with pytest.raises(TypeError, match=r"\['hyper_parameters'\]\['where'\].*allow_pickle=True"):
        run()
    run(allow_pickle=True)
    assert CheckpointStore(tmp_path / "store").steps() == [4]


def test_dirpath_shared_with_model_checkpoint_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    shared = ModelCheckpoint(dirpath=store)
    with pytest.raises(ConfigError, match="share the directory"):
        fit(store, callbacks=[shared])
    separate = ModelCheckpoint(dirpath=tmp_path / "plain")
    _, t, ckpt = fit(store, callbacks=[separate], trainer={"max_epochs": 1})
    assert t.checkpoint_callback is separate  # IncrementalCheckpoint runs last
    assert t.callbacks[-1] is ckpt


def test_resume_false_refuses_a_store_that_already_has_checkpoints(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fit(store, trainer={"max_epochs": 1})
    with pytest.raises(ConfigError, match=r"resume=False.*newest: step 8"):
        fit(store, resume=False)


def test_ckpt_path_behind_the_store_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ckpt"

    class SaveAt(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(plain)

    store = tmp_path / "store"
    fit(store, callbacks=[SaveAt()], every_n_epochs=1)
    with pytest.raises(ConfigError, match=r"up to step 24, but training continues from step 8"):
        fit(store, ckpt_path=str(plain))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, ConfigError, "conflict"),
        (
            {"every_n_train_steps": 5, "train_time_interval": timedelta(minutes=1)},
            ConfigError,
            "conflict",
        ),
        ({"every_n_train_steps": -1}, ConfigError, "every_n_train_steps must be >= 0"),
        ({"every_n_epochs": 1.5}, TypeError, "every_n_epochs must be an int"),
        ({"every_n_epochs": True}, TypeError, "every_n_epochs must be an int"),
        ({"train_time_interval": 30}, TypeError, "datetime.timedelta"),
        ({"train_time_interval": timedelta(0)}, ConfigError, "must be positive"),
        ({"resume": "yes"}, TypeError, "resume must be True or False"),
        ({"keep_last": 0}, ConfigError, "keep_last must be >= 1"),
        ({"full_every": 0}, ConfigError, "full_every must be >= 1"),
        ({"max_chain": -1}, ConfigError, "max_chain must be >= 0"),
        ({"storage_options": "key=1"}, TypeError, "storage_options must be a dict"),
        ({"store_options": {"chunk_size": 24}}, ConfigError, "multiple of 16"),
        ({"store_options": {"colour": 1}}, ConfigError, "unknown store option"),
        ({"store_options": {"keep_last": 2}, "keep_last": 3}, ConfigError, "repeats keep_last"),
        ({"dirpath": 3}, TypeError, "dirpath must be a path"),
        ({"dirpath": ""}, ConfigError, "must not be empty"),
        ({"max_consecutive_failures": 0}, ConfigError, "max_consecutive_failures must be >= 1"),
        ({"max_consecutive_failures": True}, TypeError, "max_consecutive_failures must be an int"),
        ({"watchdog": "yes"}, TypeError, "watchdog must be True, False or None"),
        ({"heartbeat_interval": 0}, ConfigError, "heartbeat_interval must be a positive"),
        ({"heartbeat_timeout": 5.0}, ConfigError, "at least 3 heartbeat intervals"),
        ({"progress_timeout": 30.0}, ConfigError, "must be longer than heartbeat_timeout"),
        ({"replica_check": "fix"}, ConfigError, "replica_check must be one of"),
        ({"replica_check": None}, TypeError, "replica_check must be one of"),
    ],
)
def test_invalid_arguments_are_refused_on_construction(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        IncrementalCheckpoint(**kwargs)


def test_strategies_that_shard_or_save_their_own_state_are_refused(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class ShardedLike(SingleDeviceStrategy):  # restores after setup, like FSDP and DeepSpeed
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    with pytest.raises(
        ConfigError, match=r"does not support ShardedLike.*Supported: single-device"
    ):
        fit(tmp_path / "store", trainer={"strategy": ShardedLike(device="cpu")})


def test_ckpt_path_best_asks_for_a_model_checkpoint(tmp_path: Path) -> None:
    _, t, _ = fit(tmp_path / "store", trainer={"max_epochs": 1})
    with pytest.raises(ValueError, match="`ModelCheckpoint` is not configured to save the best"):
        t.validate()


def test_default_schedule_and_location(tmp_path: Path) -> None:
    ckpt = IncrementalCheckpoint()
    assert (ckpt.every_n_epochs, ckpt.every_n_train_steps, ckpt.train_time_interval) == (1, 0, None)
    trainer = L.Trainer(
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ckpt],
    )
    trainer.fit(TinyModel())
    assert ckpt.url == str(tmp_path / "incremental_checkpoints")
    assert CheckpointStore(ckpt.url).steps() == [8]


# ---------------------------------------------------------------------------- LightningCLI


def test_lightning_cli_builds_the_callback_from_yaml(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    store = tmp_path / "store"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  max_epochs: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: lightning_incremental.IncrementalCheckpoint
      init_args:
        dirpath: {store}
        every_n_train_steps: 3
        keep_last: 2
        save_on_exception: false
        store_options:
          chunk_size: 4096
model:
  shuffle: none
"""
    )
    cli = LightningCLI(TinyModel, args=["fit", "--config", str(config)], save_config_callback=None)
    (ckpt,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, IncrementalCheckpoint)]
    assert ckpt.every_n_train_steps == 3 and ckpt.save_on_exception is False
    assert ckpt.store_config.keep_last == 2 and ckpt.store_config.chunk_size == 4096
    assert CheckpointStore(store).steps() == [6, 8]  # 3 and 6, then 8 at the end; keep_last=2

    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callback", type=L.Callback)
    spec = {
        "class_path": "lightning_incremental.IncrementalCheckpoint",
        "init_args": {"dirpath": str(store), "train_time_interval": "0:30:00"},
    }
    parsed = parser.instantiate_classes(parser.parse_args([f"--callback={json.dumps(spec)}"]))
    assert parsed.callback.train_time_interval == timedelta(minutes=30)


def test_example_script_runs_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import lightning_example
    finally:
        sys.path.remove(str(REPO / "examples"))
    args = ["--dir", str(tmp_path), "--steps", "40", "--every", "15"]
    lightning_example.main(args)
    assert "checkpoints kept: [15, 30, 40]" in capsys.readouterr().out
    lightning_example.main([*args, "--steps", "50"])  # the same run, trained longer
    out = capsys.readouterr().out
    assert "resumed from step 40" in out and "checkpoints kept: [40, 45, 50]" in out


def test_late_module_hooks_are_warned_about(tmp_path) -> None:
    """A LightningModule's on_train_batch_end runs after the checkpoint of that step: warned."""
    import lightning.pytorch as L

    from lightning_incremental import IncrementalCheckpoint

    class WithEma(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.layer(batch[0]).sum()

        def on_train_batch_end(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            data = torch.utils.data.TensorDataset(torch.randn(4, 2))
            return torch.utils.data.DataLoader(data, batch_size=2)

    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[IncrementalCheckpoint(tmp_path / "store")],
    )
    with pytest.warns(UserWarning, match="overrides on_train_batch_end"):
        trainer.fit(WithEma())


def test_under_torchrun_each_start_claims_a_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun (here: its environment, one process) every start of fit claims a fencing
    generation at least the restart count; a run that refuses the store claims nothing."""
    from lightning_incremental.core.commit import fencing

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    store = tmp_path / "store"
    _, _, ckpt = fit(store, every_n_train_steps=4, trainer={"max_epochs": 1})
    assert ckpt.generation == 3
    with CheckpointStore(store) as reader:
        assert {reader.manifest(s).generation for s in reader.steps()} == {3}
        assert fencing.generations(reader.storage) == [3]
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        fit(store, every_n_train_steps=4, resume=False, trainer={"max_epochs": 1})
    with CheckpointStore(store) as reader:  # the refused run did not fence off the first one
        assert fencing.generations(reader.storage) == [3]
    _, _, ckpt = fit(store, every_n_train_steps=4, trainer={"max_epochs": 2})
    assert ckpt.generation == 4 and ckpt.resumed_from == 8
