"""IncrementalCheckpoint(fork_from="SRC[@STEP]") on real Trainers: the fork resumes from the
source's step exactly and stores no copy of it; a restart does not fork again; a store forked
from another source is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_incremental.core import CheckpointStore, ConfigError
from tests.jobs.lightning_job import fit
from tests.lightning.test_callback import assert_bit_identical, final_state


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_fork_resumes_exactly_without_a_copy_and_a_restart_does_not_fork_again(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    fit(src, trainer={"max_steps": 8}, every_n_train_steps=4)
    assert CheckpointStore(src).steps()[-1] == 8
    source_objects = {k for k in _files(src) if k.startswith("packs/")}
    assert source_objects

    module, trainer, ckpt = fit(
        dst, trainer={"max_steps": 16}, every_n_train_steps=4, fork_from=f"{src}@8"
    )
    assert ckpt.resumed_from == 8 and trainer.global_step == 16
    assert CheckpointStore(dst).steps() == [8, 12, 16]
    assert len(list((src / "pins").iterdir())) == 1
    # The step forked is the source's: none of its objects is at the fork's location.
    assert not source_objects & _files(dst).keys()
    forked = final_state(module, trainer)

    # The source continued from step 8 itself: the same training, bit for bit.
    module, trainer, ckpt = fit(src, trainer={"max_steps": 16}, every_n_train_steps=4)
    assert ckpt.resumed_from == 8
    assert_bit_identical(forked, final_state(module, trainer))

    # A restart of the fork resumes from its own newest step and forks nothing again.
    _, trainer, ckpt = fit(
        dst, trainer={"max_steps": 16}, every_n_train_steps=4, fork_from=f"{src}@8"
    )
    assert ckpt.resumed_from == 16 and trainer.global_step == 16
    assert len(list((src / "pins").iterdir())) == 1


def test_a_store_forked_from_another_source_or_step_is_refused(tmp_path: Path) -> None:
    src, other, dst = tmp_path / "src", tmp_path / "other", tmp_path / "dst"
    fit(src, trainer={"max_steps": 8}, every_n_train_steps=4)
    fit(dst, trainer={"max_steps": 8}, fork_from=f"{src}@4")
    for wrong in (str(other), f"{src}@8"):
        with pytest.raises(ConfigError, match="already holds a fork of step 4") as info:
            fit(dst, trainer={"max_steps": 8}, fork_from=wrong)
        assert str(src) in str(info.value) and wrong in str(info.value)
    plain = tmp_path / "plain"
    fit(plain, trainer={"max_steps": 4}, every_n_train_steps=4)
    with pytest.raises(ConfigError, match="checkpoints that are no fork"):
        fit(plain, trainer={"max_steps": 8}, fork_from=str(src))
    with pytest.raises(ConfigError, match="needs resume=True"):
        fit(tmp_path / "new", fork_from=str(src), resume=False)


class _LoadWeights(Callback):
    """The run a user would write by hand: the source step's weights loaded at setup."""

    def __init__(self, src: Path, step: int) -> None:
        self.src, self.step = src, step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        with CheckpointStore(self.src) as store:
            pl_module.load_state_dict(store.load(self.step, keys="state_dict")["state_dict"])


def test_a_fork_of_weights_only_trains_from_step_0_on_the_source_weights(tmp_path: Path) -> None:
    src, dst, by_hand = tmp_path / "src", tmp_path / "dst", tmp_path / "by_hand"
    fit(src, trainer={"max_steps": 8}, every_n_train_steps=4)
    module, trainer, ckpt = fit(
        dst,
        trainer={"max_steps": 8},
        every_n_train_steps=4,
        fork_from=f"{src}@8",
        fork_weights_only=True,
    )
    assert ckpt.resumed_from is None and trainer.global_step == 8
    forked = final_state(module, trainer)
    with CheckpointStore(dst) as store:
        assert store.steps() == [4, 8], "the source's step 8 is no step of the fork"
        assert store.manifest(4).parent == 8, "its first save is coded against the source's step"
    assert len(list((src / "pins").iterdir())) == 1
    # The same training with the weights loaded by hand into a fresh store, bit for bit.
    module, trainer, _ = fit(
        by_hand,
        trainer={"max_steps": 8},
        every_n_train_steps=4,
        callbacks=[_LoadWeights(src, 8)],
    )
    assert_bit_identical(forked, final_state(module, trainer))
    # A restart resumes the fork's own newest step and loads nothing from the source.
    _, trainer, ckpt = fit(
        dst,
        trainer={"max_steps": 12},
        every_n_train_steps=4,
        fork_from=f"{src}@8",
        fork_weights_only=True,
    )
    assert ckpt.resumed_from == 8 and trainer.global_step == 12
    # Asking a whole fork's store for weights only (or the reverse) is refused.
    fit(tmp_path / "whole", trainer={"max_steps": 8}, fork_from=f"{src}@4")
    with pytest.raises(ConfigError, match="a fork of the whole checkpoint"):
        fit(tmp_path / "whole", fork_from=f"{src}@4", fork_weights_only=True)
    with pytest.raises(ConfigError, match="needs fork_from"):
        fit(tmp_path / "new", fork_weights_only=True)
