"""The Trainer integration in one process: the one-line API (``enable_trainer``), resume from a
marker folder or from a folder the Trainer wrote itself, the start-up refusals and notes, and the
compat module against the installed ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from accelerate_incremental import _launch, enable_trainer
from accelerate_incremental.trainer import enable as _trainer_enable
from accelerate_incremental.trainer import hf_compat as _hf_compat
from accelerate_incremental.trainer.markers import NAME
from lightning_incremental.core import CheckpointStore
from tests.hf.trainers import tiny_trainer, weights


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_installed_transformers_is_in_the_checked_range(tmp_path: Path) -> None:
    assert _hf_compat.version() >= _hf_compat.OLDEST_SUPPORTED
    if _hf_compat.newer_than_checked():
        pytest.skip("transformers is newer than the sources _hf_compat was checked against")
    assert _hf_compat.problems(tiny_trainer(tmp_path / "out")) == []


def test_enable_trainer_saves_markers_and_resumes_exactly(tmp_path: Path) -> None:
    """One line in the script: checkpoints at the Trainer's save_steps go to the store, the
    folders hold a marker and trainer_state.json, and train(resume_from_checkpoint=<folder>)
    ends where the uninterrupted run ended."""
    store = tmp_path / "store"
    first = tiny_trainer(tmp_path / "out")
    checkpointer = enable_trainer(first, str(store))
    assert checkpointer is not None and enable_trainer(first) is checkpointer
    first.train()
    assert CheckpointStore(store).steps() == [5, 10]
    folder = tmp_path / "out" / "checkpoint-5"
    names = {p.name for p in folder.iterdir()}
    assert {NAME, "trainer_state.json", "config.json", "README.md"} <= names

    again = tiny_trainer(tmp_path / "out")
    enable_trainer(again, str(store), auto_resume=False)
    again.train(resume_from_checkpoint=str(folder))
    assert again.state.global_step == 10
    assert _equal(weights(again), weights(first))


def test_auto_resume_and_an_uncommitted_marker(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = tiny_trainer(tmp_path / "out", max_steps=5)
    enable_trainer(first, str(store))
    first.train()
    # a folder whose save never committed (the process died first)
    ghost = tmp_path / "out" / "checkpoint-9"
    ghost.mkdir()
    (ghost / NAME).write_text(
        json.dumps({"format": "accelerate_incremental.trainer_marker/1", "store": str(store),
                    "step": 9})
    )  # fmt: skip
    (ghost / "trainer_state.json").write_text((tmp_path / "out/checkpoint-5/trainer_state.json")
                                              .read_text())  # fmt: skip
    explicit = tiny_trainer(tmp_path / "out")
    enable_trainer(explicit, str(store))
    with pytest.raises(ValueError, match=r"records step 9, which is not in .*never committed"):
        explicit.train(resume_from_checkpoint=str(ghost))
    latest = tiny_trainer(tmp_path / "out")
    enable_trainer(latest, str(store))
    assert latest.train(resume_from_checkpoint=True).global_step == 10  # falls back to step 5
    auto = tiny_trainer(tmp_path / "out", max_steps=12, save_steps=6)
    enable_trainer(auto, str(store))
    assert auto.train().global_step == 12  # resumes from step 10 by itself


def test_a_folder_the_trainer_wrote_itself_loads_its_way(tmp_path: Path) -> None:
    plain = tiny_trainer(tmp_path / "out")
    plain.train()  # the Trainer's own checkpoint-5 and checkpoint-10
    resumed = tiny_trainer(tmp_path / "out")
    enable_trainer(resumed, str(tmp_path / "store"), auto_resume=False)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-5"))
    assert _equal(weights(resumed), weights(plain))
    assert CheckpointStore(tmp_path / "store").steps() == [10]
    assert (tmp_path / "out" / "checkpoint-5" / "optimizer.pt").is_file()


def test_save_total_limit_deletes_the_rotated_steps_from_the_store(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path / "out", max_steps=12, save_steps=3, save_total_limit=2)
    enable_trainer(trainer, str(tmp_path / "store"))
    trainer.train()
    folders = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert folders == ["checkpoint-12", "checkpoint-9"]
    assert CheckpointStore(tmp_path / "store").steps() == [9, 12]


def test_an_unsupported_release_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the launch flag: a warning naming the reason and what the run gets instead, the
    Trainer untouched; through enable_trainer: a ValueError."""
    trainer = tiny_trainer(tmp_path / "out")
    monkeypatch.setattr(_hf_compat, "version", lambda: (4, 40))
    with pytest.warns(UserWarning) as caught:
        assert _trainer_enable.from_flag(trainer, {"dirpath": str(tmp_path / "s")}) is None
    message = str(caught[0].message)
    assert "checkpoints are NOT incremental" in message
    assert "transformers 4.40 is older than the oldest supported release 5.0" in message
    assert "writes its own full checkpoint-N folders" in message
    assert "train" not in vars(trainer)  # not hooked
    # the flag's generic takeover leaves the Trainer's accelerator alone all the same
    assert _launch.attach(trainer.accelerator, {"dirpath": str(tmp_path / "s")}) is None
    with pytest.raises(ValueError, match="older than the oldest supported release"):
        enable_trainer(tiny_trainer(tmp_path / "out2"), str(tmp_path / "s"))


def test_start_up_notes(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path / "out", save_only_model=True)
    with pytest.warns(UserWarning) as caught:
        _trainer_enable.from_flag(
            trainer, {"dirpath": str(tmp_path / "s"), "keep_last": 2, "replica_check": "warn"}
        )
    text = "\n".join(str(w.message) for w in caught)
    assert "save_only_model=True: the store keeps the whole training state" in text
    assert "keep_last is ignored for a Trainer: its save_total_limit rules" in text
    assert "replica_check is not used for a Trainer" in text


def test_a_dropped_trainer_is_collected_with_its_store(tmp_path: Path) -> None:
    """The registry of enabled Trainers holds neither the Trainer nor its checkpointer: a
    process that creates Trainer after Trainer (a search over hyper-parameters) keeps none."""
    import gc
    import weakref

    trainer = tiny_trainer(tmp_path / "out")
    checkpointer = enable_trainer(trainer, str(tmp_path / "store"))
    assert checkpointer is not None
    dropped = weakref.ref(trainer)
    store = weakref.ref(checkpointer.store)
    del trainer, checkpointer
    gc.collect()
    assert dropped() is None and store() is None


def test_a_signal_during_train_saves_that_step_and_exits_143(tmp_path: Path) -> None:
    """SIGTERM twice during step 3 (a signal delivered again): the Trainer saves step 3 through the
    store (outside its save_steps), stops, ``train()`` waits for the commit and the process
    exits 143 (a late signal no longer ends it first); the JIT checkpoint the run asked for
    stands aside (its handler is not the one
    the signal finds, and it saves nothing of its own)."""
    import os
    import signal

    from transformers import TrainerCallback

    from lightning_incremental.runtime.policy.preemption import EXIT_PREEMPTED

    class Signal(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:  # step 3 begins
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = tiny_trainer(tmp_path / "out", enable_jit_checkpoint=True)
    (jit,) = [c for c in trainer.callback_handler.callbacks if getattr(c, "jit_manager", None)]
    before = signal.getsignal(signal.SIGTERM)
    assert before == jit.jit_manager._sigterm_handler
    checkpointer = enable_trainer(trainer, str(tmp_path / "store"))
    assert checkpointer is not None and jit.jit_manager is None
    assert signal.getsignal(signal.SIGTERM) != before, "the JIT checkpoint's handler is put back"
    trainer.add_callback(Signal())
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as exited:
            trainer.train()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, "ignored until the exit"
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert exited.value.code == EXIT_PREEMPTED
    assert trainer.state.global_step == 3
    assert CheckpointStore(tmp_path / "store").steps() == [3]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-3"]
