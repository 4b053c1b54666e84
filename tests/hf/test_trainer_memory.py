"""The memory tier under a real ``transformers.Trainer`` (one process; the two-process launch is
in ``test_trainer_launch.py``): a run that fails resumes from the newest memory step, ends
bit-identical to an uninterrupted run and keeps the step's logs and evaluations; a memory step
older than the store's newest, or ``auto_resume=False``, leaves the store to decide; a finished
run leaves no memory behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from accelerate_incremental import enable_trainer
from accelerate_incremental.trainer import enable as _trainer_enable
from lightning_incremental.core import CheckpointStore
from lightning_incremental.runtime.memory.steps import job_of
from lightning_incremental.runtime.memory.tier import MemoryTier
from tests.hf.trainers import tiny_trainer, weights

STEPS, SAVE = 12, 5  # 8 batches an epoch (32 samples of 4): step 8 ends the first epoch


class Failure(Exception):
    pass


def _fail_at(trainer: Any, step: int) -> None:
    """Make ``trainer`` raise at ``on_step_end`` of ``step``: after its optimizer step, before
    the step's logging, evaluation and saving (the newest memory step is then ``step - 1``)."""
    from transformers import TrainerCallback

    class Fail(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == step:
                raise Failure(f"failed at step {step}")

    trainer.add_callback(Fail())


def _eval_data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _run(tmp: Path, name: str, fail_at: int | None = None, **kw: Any) -> tuple[Any, Any]:
    """A Trainer of the run ``name`` (its own output folder; the store and memory of ``tmp``),
    trained, failing at ``fail_at``; returns it and its checkpointer."""
    memory = kw.pop("memory", {"memory_every_n_steps": 1})
    auto_resume = kw.pop("auto_resume", True)
    arguments = {"max_steps": STEPS, "save_steps": SAVE, **kw}
    evaluate = "eval_strategy" in arguments
    if evaluate:
        arguments.setdefault("per_device_eval_batch_size", 4)
    trainer = tiny_trainer(tmp / name, _eval_data() if evaluate else None, **arguments)
    ckpt = enable_trainer(
        trainer, str(tmp / "store"), memory_dir=str(tmp / "mem"), auto_resume=auto_resume, **memory
    )
    if fail_at is not None:
        _fail_at(trainer, fail_at)
        with pytest.raises(Failure):
            trainer.train()
        ckpt.wait()  # the store's saves in flight commit (the memory tier's were closed)
    else:
        trainer.train()
    return trainer, ckpt


def _steps_in_memory(tmp: Path) -> list[int]:
    """The steps of the complete parts in the run's memory directory (headers read)."""
    job = job_of(str(CheckpointStore(tmp / "store").url))
    held = MemoryTier(tmp / "mem", job=job, generation=0, world_size=1).inventory()
    return sorted({h.step for h in held})


def _evaluations(trainer: Any) -> list[tuple[int, float]]:
    return [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]


def _same_training(a: Any, b: Any) -> None:
    assert a.state.global_step == b.state.global_step == STEPS
    for key, value in weights(a).items():
        assert torch.equal(value, weights(b)[key]), key
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name, value in sa[k].items():
            assert torch.equal(value, sb[k][name]), (k, name)
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The run without a failure (memory every step: taking steps does not change training)."""
    tmp = tmp_path_factory.mktemp("whole")
    trainer, ckpt = _run(tmp, "out")
    assert ckpt.resumed_from is None
    assert CheckpointStore(tmp / "store").steps() == [5, 10, 12]
    assert _steps_in_memory(tmp) == []  # finished, the store holds the last step: memory freed
    return trainer


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("evaluated")
    trainer, _ = _run(tmp, "out", eval_strategy="steps", eval_steps=3, logging_steps=3)
    return trainer


def test_a_failed_run_resumes_from_its_newest_memory_step_bit_identical(
    tmp_path: Path, uninterrupted: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, "out", fail_at=8)
    assert CheckpointStore(tmp_path / "store").steps() == [5]
    assert _steps_in_memory(tmp_path) == [7]
    with caplog.at_level("INFO"):
        trainer, ckpt = _run(tmp_path, "out2")
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (7, "memory")
    assert "RESUMING the Trainer from step 7 of the memory tier (own node's memory)" in caplog.text
    _same_training(trainer, uninterrupted)
    assert _steps_in_memory(tmp_path) == []
    assert not list(Path(ckpt.memory.opts.directory).rglob("trainer_state.json"))


def test_the_memory_step_holds_the_steps_logs_and_evaluations(
    tmp_path: Path, evaluated: Any
) -> None:
    """Step 9 evaluates and logs; a failure at step 10 resumes from memory step 9, whose
    trainer_state already holds that evaluation: each evaluation is in the log once, with the
    uninterrupted run's values (an on_step_end snapshot would lose step 9's)."""
    _run(tmp_path, "out", fail_at=10, eval_strategy="steps", eval_steps=3, logging_steps=3)
    trainer, ckpt = _run(tmp_path, "out2", eval_strategy="steps", eval_steps=3, logging_steps=3)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (9, "memory")
    assert _evaluations(trainer) == _evaluations(evaluated)
    assert [s for s, _ in _evaluations(trainer)] == [3, 6, 9, 12]
    _same_training(trainer, evaluated)


def test_the_last_step_of_an_epoch_is_taken_after_the_epochs_end_work(tmp_path: Path) -> None:
    """With epoch evaluation, step 8 (the end of the first epoch) is taken after on_epoch_end
    and its evaluation: a failure at step 9 resumes from it with that evaluation logged once."""
    kw: dict[str, Any] = {"eval_strategy": "epoch", "logging_strategy": "epoch"}
    reference, _ = _run(tmp_path / "ref", "out", **kw)
    _run(tmp_path, "out", fail_at=9, **kw)
    assert _steps_in_memory(tmp_path) == [8]
    trainer, ckpt = _run(tmp_path, "out2", **kw)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (8, "memory")
    assert [s for s, _ in _evaluations(trainer)] == [8, 12]
    assert _evaluations(trainer) == _evaluations(reference)
    _same_training(trainer, reference)


def test_a_memory_step_older_than_the_stores_newest_leaves_the_store(
    tmp_path: Path, uninterrupted: Any
) -> None:
    """Memory every 4 steps, the store every 5: a failure at step 7 leaves memory step 4 and
    store step 5; the store's is the newer, so the resume reads it."""
    memory = {"memory_every_n_steps": 4}
    _run(tmp_path, "out", fail_at=7, memory=memory)
    assert _steps_in_memory(tmp_path) == [4]
    trainer, ckpt = _run(tmp_path, "out2", memory=memory)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (5, "store")
    _same_training(trainer, uninterrupted)


def test_auto_resume_off_starts_afresh_whatever_memory_holds(
    tmp_path: Path, uninterrupted: Any
) -> None:
    _run(tmp_path, "out", fail_at=8)
    assert _steps_in_memory(tmp_path) == [7]
    trainer, ckpt = _run(tmp_path / "again", "out", auto_resume=False)
    assert ckpt.resumed_from is None
    _same_training(trainer, uninterrupted)


def test_the_launch_flags_memory_keys_start_the_memory_tier(tmp_path: Path) -> None:
    """The launch flag's JSON config (the same keys as for Accelerate scripts) gives a Trainer
    its memory tier; off without them."""
    trainer = tiny_trainer(tmp_path / "out")
    config = {
        "dirpath": str(tmp_path / "s"),
        "memory_every_n_steps": 2,
        "memory_replicas": 1,
        "memory_dir": str(tmp_path / "mem"),
    }
    ckpt = _trainer_enable.from_flag(trainer, config)
    assert ckpt is not None and ckpt.memory is not None
    assert ckpt.memory.opts.every_n_train_steps == 2
    other = tiny_trainer(tmp_path / "other")
    plain = _trainer_enable.from_flag(other, {"dirpath": str(tmp_path / "t")})
    assert plain is not None and plain.memory is None


def test_a_bad_memory_interval_is_refused(tmp_path: Path) -> None:
    from lightning_incremental.core import ConfigError

    with pytest.raises(ConfigError, match="memory_every_n_steps must be None or >= 1"):
        enable_trainer(tiny_trainer(tmp_path / "out"), str(tmp_path / "s"), memory_every_n_steps=0)


def test_a_memory_steps_trainer_state_is_the_one_the_trainer_writes(tmp_path: Path) -> None:
    """Step 10 is saved by the Trainer (save_steps=5) and taken into memory: the memory part's
    trainer_state is the folder's trainer_state.json, field for field (logs, evaluations, the
    stored flos included), but for the TrainerControl's flags: the folder's were recorded while
    the step saved (should_save), the memory step's once the step's work was done."""
    _run(tmp_path, "out", fail_at=11, eval_strategy="steps", eval_steps=5, logging_steps=2)
    job = job_of(str(CheckpointStore(tmp_path / "store").url))
    tier = MemoryTier(tmp_path / "mem", job=job, generation=0, world_size=1)
    (held,) = tier.inventory()
    assert held.step == 10
    part = tier.load(0, 10, held.generation)
    written = (tmp_path / "out" / "checkpoint-10" / "trainer_state.json").read_text()
    ours, theirs = json.loads(part["state"]["trainer_state"]), json.loads(written)
    assert ours["stateful_callbacks"].pop("TrainerControl")["args"]["should_save"] is False
    assert theirs["stateful_callbacks"].pop("TrainerControl")["args"]["should_save"] is True
    assert ours == theirs
    assert [e["step"] for e in ours["log_history"]] == [2, 4, 5, 6, 8, 10, 10]


def test_a_stop_mid_epoch_is_taken_after_the_epochs_end_work(tmp_path: Path) -> None:
    """max_steps=12 ends the second epoch early (8 batches an epoch): the Trainer runs
    on_epoch_end and an epoch-strategy log, evaluation and save for step 12 after the step's own
    call. Memory step 12 is taken after them: it holds the step's log and evaluation, as the
    Trainer's own checkpoint-12 does (a failure at on_train_end keeps it in memory)."""
    kw: dict[str, Any] = {
        "eval_strategy": "epoch",
        "logging_strategy": "epoch",
        "save_strategy": "epoch",
        "per_device_eval_batch_size": 4,
    }
    trainer = tiny_trainer(tmp_path / "out", _eval_data(), max_steps=STEPS, **kw)
    ckpt = enable_trainer(
        trainer, str(tmp_path / "store"), memory_dir=str(tmp_path / "mem"), memory_every_n_steps=1
    )
    from transformers import TrainerCallback

    class FailAtTheEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            raise Failure("failed as training ended")

    trainer.add_callback(FailAtTheEnd())
    with pytest.raises(Failure):
        trainer.train()
    ckpt.wait()
    job = job_of(str(CheckpointStore(tmp_path / "store").url))
    tier = MemoryTier(tmp_path / "mem", job=job, generation=0, world_size=1)
    (held,) = tier.inventory()
    assert held.step == STEPS
    ours = json.loads(tier.load(0, STEPS, held.generation)["state"]["trainer_state"])
    written = (tmp_path / "out" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text()
    logged = [(e["step"], "eval_loss" in e) for e in ours["log_history"]]
    assert logged == [(e["step"], "eval_loss" in e) for e in json.loads(written)["log_history"]]
    assert logged == [(8, False), (8, True), (STEPS, False), (STEPS, True)]


def test_a_best_checkpoint_whose_save_never_committed_is_dropped_with_a_warning(
    tmp_path: Path,
) -> None:
    """The store's save of step 10 (the best, with load_best_model_at_end) is in flight when
    memory step 10 is taken and lost with the process: the resume from memory warns and drops
    the best checkpoint's path (as the Trainer does for a best folder that is gone), and
    train() ends with a later best checkpoint instead of failing on the missing step."""
    holder: dict[str, Any] = {}

    def metrics(_: Any) -> dict[str, float]:
        return {"mark": 1.0 if holder["trainer"].state.global_step == 10 else 0.0}

    kw: dict[str, Any] = {
        "max_steps": 15,
        "eval_strategy": "steps",
        "eval_steps": 5,
        "load_best_model_at_end": True,
        "metric_for_best_model": "mark",
        "per_device_eval_batch_size": 4,
    }

    def trainer() -> tuple[Any, Any]:
        made = tiny_trainer(tmp_path / "out", _eval_data(), **kw)
        made.compute_metrics = metrics
        holder["trainer"] = made
        return made, enable_trainer(
            made, str(tmp_path / "store"), memory_dir=str(tmp_path / "mem"),
            memory_every_n_steps=1,
        )  # fmt: skip

    first, ckpt = trainer()
    _fail_at(first, 11)
    with pytest.raises(Failure):
        first.train()
    ckpt.wait()
    CheckpointStore(tmp_path / "store").delete(10)  # stands for the save lost in flight
    again, ckpt = trainer()
    with pytest.warns(UserWarning, match="its save \\(step 10\\) never committed to the store"):
        again.train()
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (10, "memory")
    assert again.state.global_step == 15
    assert again.state.best_model_checkpoint is None  # no later evaluation beat step 10's


def test_a_memory_tier_that_cannot_start_leaves_no_signal_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    from accelerate_incremental.trainer import memory as _trainer_memory

    before = signal.getsignal(signal.SIGTERM)
    trainer = tiny_trainer(tmp_path / "out")
    enable_trainer(trainer, str(tmp_path / "store"), memory_every_n_steps=1)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the memory tier's group could not be made")

    monkeypatch.setattr(_trainer_memory.TrainerMemory, "start", broken)
    with pytest.raises(RuntimeError, match="group could not be made"):
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_release_whose_hook_changed_keeps_the_store_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The method a memory step follows is checked like the other hooks: one whose parameters
    changed turns the memory tier off with a warning naming it, not training."""
    from accelerate_incremental.trainer import hf_compat as _hf_compat

    changed = {"_maybe_log_save_evaluate": ("tr_loss", "renamed")}
    monkeypatch.setattr(_hf_compat, "MEMORY_HOOKED", changed)
    trainer = tiny_trainer(tmp_path / "out")
    with pytest.warns(UserWarning, match="memory tier is off.*_maybe_log_save_evaluate takes"):
        ckpt = enable_trainer(trainer, str(tmp_path / "s"), memory_every_n_steps=1)
    assert ckpt is not None and ckpt.memory is None


def test_the_resume_folders_of_processes_that_are_gone_are_swept(tmp_path: Path) -> None:
    """A run killed after a memory resume never reaches ``train()``'s end, which removes its
    resume folder: the next resume on the machine removes those whose process is gone, and
    only those."""
    import os

    from accelerate_incremental.trainer.memory import RESUME_PREFIX, sweep_resume_folders
    from tests.conftest import dead_pid

    dead = dead_pid()  # reused by another process meanwhile: the folder stays
    names = {
        "dead": f"{RESUME_PREFIX}7-{dead}-abc123",
        "alive": f"{RESUME_PREFIX}7-{os.getpid()}-def456",
        "old_name": f"{RESUME_PREFIX}7-ghi789",  # an earlier release's: no process id
        "other": "something-else-1-2-3",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert sweep_resume_folders(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        v for k, v in names.items() if k != "dead"
    )
    assert sweep_resume_folders(str(tmp_path / "missing")) == 0
