"""IncrementalCheckpoint's memory tier in one process, on a real Trainer: a crashed fit resumes
from the newest memory step (newer than the store's) bit-identically and frees the memory once
the store holds the end; another job's memory is ignored; a memory copy whose bytes changed is
refused and the store is used; the tier is off by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.runtime.memory.tier import ENV
from tests.jobs.lightning_job import Interrupted, fit
from tests.lightning.test_callback import assert_bit_identical, final_state

ARGS = {"every_n_train_steps": 5, "save_on_exception": False}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    module, trainer, _ = fit(tmp_path_factory.mktemp("reference") / "store", **ARGS)
    return final_state(module, trainer)


def _parts(memory: Path) -> list[str]:
    return sorted(p.name for p in memory.glob("*/s*"))  # every job's


def test_a_crashed_fit_resumes_from_memory_bit_identically(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    store, memory = tmp_path / "store", tmp_path / "memory"
    args = {**ARGS, "memory_every_n_train_steps": 1, "memory_dir": memory}
    fit(store, crash_at=7, **args)  # the crash comes before step 7's memory step
    assert _parts(memory) == ["s000000000006-g000001-r000000"]  # only the newest is kept
    module, trainer, ckpt = fit(store, **args)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, "memory")  # the store holds step 5
    assert_bit_identical(final_state(module, trainer), uninterrupted)
    assert _parts(memory) == []  # the store holds the last step: the memory is freed


def test_another_jobs_memory_is_ignored(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    args = {**ARGS, "memory_every_n_train_steps": 1, "memory_dir": memory}
    fit(tmp_path / "one", crash_at=7, **args)
    _, _, ckpt = fit(tmp_path / "other", trainer={"max_steps": 3}, **args)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (None, None)
    assert _parts(memory) == ["s000000000006-g000001-r000000"]  # the other job's, untouched


def test_a_changed_memory_copy_is_refused_and_the_store_used(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    store, memory = tmp_path / "store", tmp_path / "memory"
    args = {**ARGS, "memory_every_n_train_steps": 2, "memory_dir": memory}
    fit(store, crash_at=7, **args)
    (data,) = memory.glob("*/*/data.bin")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="memory step 6 could not be restored.*does not match"):
        module, trainer, ckpt = fit(store, **args)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (5, "store")
    assert_bit_identical(final_state(module, trainer), uninterrupted)


def test_the_memory_tier_is_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "memory"))
    store = tmp_path / "store"
    fit(store, crash_at=7, **ARGS)
    _, _, ckpt = fit(store, trainer={"max_steps": 8}, **ARGS)
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (5, "store")
    assert not (tmp_path / "memory").exists()
    with pytest.raises(ConfigError, match="memory_every_n_train_steps"):
        fit(store, memory_every_n_train_steps=0)


def test_a_ranks_own_part_keeps_everything_but_the_replicated_state() -> None:
    """Under DDP a node's other ranks take all of their checkpoint but the weights and optimizer
    state (their loops, callbacks, schedulers, random state and data position, and their own
    buffers in their rank state); a resume puts the node's first rank's weights and optimizer
    state under them."""
    from lightning_incremental.lightning import memory
    from lightning_incremental.lightning.resume import KEY

    whole = {
        "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{"state": {0: {"momentum_buffer": torch.ones(2)}}}],
        "loops": {"fit_loop": "leader's"},
        KEY: {"ranks": [{"rng": "leader's"}]},
        "global_step": 7,
    }
    own = {
        "loops": {"fit_loop": "own"},
        "lr_schedulers": [{"last_epoch": 3}],
        KEY: {"ranks": [{"rng": "own", "buffers": {"seen": torch.full((2,), 5.0)}}]},
        "global_step": 7,
    }
    merged = memory._merge(whole, own)
    assert merged["loops"] == {"fit_loop": "own"} and merged[KEY]["ranks"][0]["rng"] == "own"
    assert merged["lr_schedulers"] == [{"last_epoch": 3}]
    assert merged["optimizer_states"] is whole["optimizer_states"]
    assert merged["state_dict"] is whole["state_dict"]


def test_a_save_the_memory_step_records_but_the_store_lost_is_made_again(tmp_path: Path) -> None:
    """A memory step records the store's save of its own batch as made (the callback's
    ``last_saved_step``), but that save commits in the background and can die with the
    process. Resumed from memory with the store lacking that step, the callback does not take
    it as saved: a failure on the first batch after the resume (accumulating, still step 5)
    saves step 5 (before, it was skipped as already saved, and the store held nothing)."""
    store, memory = tmp_path / "store", tmp_path / "memory"
    args = {**ARGS, "memory_every_n_train_steps": 1, "memory_dir": memory}
    accumulate = {"accumulate_grad_batches": 2}
    fit(store, crash_at=6, trainer=accumulate, **args)
    assert _parts(memory) == ["s000000000005-g000001-r000000"]
    CheckpointStore(store).delete(5)  # stands for the save lost in flight with the process
    assert CheckpointStore(store).steps() == []
    _, trainer, ckpt = fit(
        store, crash_at=5, trainer=accumulate, **{**args, "save_on_exception": True}
    )
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (5, "memory")
    assert trainer.global_step == 5
    assert CheckpointStore(store).steps() == [5]


class _LateCrash(Interrupted):
    pass


def _crash_after_every_callback(at: int) -> type:
    """A TinyModel whose own ``on_train_batch_end`` (run after every callback's: the memory
    step of that batch is taken) raises at step ``at``."""
    from tests.jobs.lightning_job import TinyModel

    class LateCrash(TinyModel):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.trainer.global_step == at:
                raise _LateCrash(f"after the memory step of step {at}")

    return LateCrash


@pytest.mark.parametrize("store_kept_it", [False, True])
def test_a_resume_from_memory_at_the_last_step_saves_it_and_frees_the_memory(
    tmp_path: Path, store_kept_it: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process dies after the memory step of the last step (max_steps=10), with the store's
    save of that step lost in flight (or, the other case, committed). The next fit resumes from
    memory at step 10, where Lightning skips the training loop and with it on_train_end: the
    callback still saves step 10 to the store when the store lacks it, and frees the memory."""
    import tests.jobs.lightning_job as job

    store, memory = tmp_path / "store", tmp_path / "memory"
    args = {**ARGS, "memory_every_n_train_steps": 1, "memory_dir": memory}
    monkeypatch.setattr(job, "TinyModel", _crash_after_every_callback(10))
    with pytest.raises(_LateCrash):
        fit(store, trainer={"max_steps": 10}, **args)
    assert _parts(memory) == ["s000000000010-g000001-r000000"]
    if not store_kept_it:
        CheckpointStore(store).delete(10)  # stands for the save lost in flight
    monkeypatch.undo()
    _, trainer, ckpt = fit(store, trainer={"max_steps": 10}, **args)
    assert (ckpt.resumed_from, ckpt.resumed_tier, trainer.global_step) == (10, "memory", 10)
    assert CheckpointStore(store).steps()[-1] == 10
    assert _parts(memory) == []


def test_a_model_checkpoint_save_lost_in_flight_is_out_of_its_top_k_after_a_memory_resume(
    tmp_path: Path,
) -> None:
    """ModelCheckpoint saves through IncrementalCheckpointIO every 2 steps (top 2 by step, and
    last). The process dies after step 6's memory step, with ModelCheckpoint's save of step 6
    lost in flight (it commits in the background; here its store step is deleted). Resumed from
    memory, step 6 is out of ModelCheckpoint's top-k with a warning that names it; its best is
    step 4, which ``validate(ckpt_path="best")`` loads. Before, ``best_model_path`` named step 6,
    which never committed, and that validate raised CheckpointNotFoundError."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_incremental import IncrementalCheckpointIO
    from tests.lightning.test_checkpoint_io import pointer

    store, memory, saves = tmp_path / "store", tmp_path / "memory", tmp_path / "saves"
    args = {**ARGS, "memory_every_n_train_steps": 1, "memory_dir": memory}

    def run(**options: Any) -> tuple[Any, ModelCheckpoint]:
        mc = ModelCheckpoint(
            saves, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True
        )
        trainer = {"plugins": [IncrementalCheckpointIO()], "max_steps": 7}
        return fit(store, callbacks=[mc], trainer=trainer, **args, **options), mc

    run(crash_at=7)
    by_step = {pointer(p)["global_step"]: p for p in saves.glob("epoch=*.ckpt")}
    assert sorted(by_step) == [4, 6]
    with CheckpointStore(saves / ".incremental") as lost:  # step 6's saves, lost in flight
        for p in saves.glob("*.ckpt"):
            if pointer(p)["global_step"] == 6:
                lost.delete(pointer(p)["step"])
    with pytest.warns(UserWarning, match="never finished") as caught:
        (_, trainer, ckpt), mc = run()
    assert (ckpt.resumed_from, ckpt.resumed_tier) == (6, "memory")
    assert any(str(by_step[6]) in str(w.message) for w in caught)
    assert mc.best_model_path == str(by_step[4])
    assert list(mc.best_k_models) == [str(by_step[4])]
    assert float(mc.best_model_score) == 4.0
    trainer.validate(trainer.lightning_module, ckpt_path="best", verbose=False)
    assert IncrementalCheckpointIO().load_checkpoint(mc.best_model_path)["global_step"] == 4
