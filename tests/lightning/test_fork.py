"""IncrementalCheckpoint(fork_from="SRC[@STEP]") on real Trainers: the fork resumes from the
source's step exactly and stores no copy of it; a restart does not fork again; a store forked
from another source is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

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
