"""enable_trainer(trainer, DST, fork_from="SRC[@STEP]") with a real Trainer: the fork resumes
from the source's step exactly; a restart does not fork again; another source is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from accelerate_incremental import _flag, enable_trainer
from accelerate_incremental.trainer import enable as _trainer_enable
from lightning_incremental.core import CheckpointStore, ConfigError
from tests.hf.test_trainer import _equal
from tests.hf.trainers import tiny_trainer, weights

SHORT = {"max_steps": 2, "save_steps": 2}
LONG = {"max_steps": 4, "save_steps": 2}


def test_a_forked_trainer_resumes_exactly_and_a_restart_does_not_fork_again(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    enable_trainer(first := tiny_trainer(tmp_path / "a", **SHORT), str(src))
    first.train()
    forked = tiny_trainer(tmp_path / "b", **LONG)
    enable_trainer(forked, str(dst), fork_from=f"{src}@2")
    assert forked.train().global_step == 4
    assert CheckpointStore(dst).steps() == [2, 4]
    continued = tiny_trainer(tmp_path / "a", **LONG)
    enable_trainer(continued, str(src))
    assert continued.train().global_step == 4
    assert _equal(weights(forked), weights(continued))

    again = tiny_trainer(tmp_path / "b", **LONG)
    enable_trainer(again, str(dst), fork_from=f"{src}@2")
    with pytest.warns(UserWarning, match="step 4 of"):  # its own newest step, not the fork's
        again.train()
    assert len(list((src / "pins").iterdir())) == 1
    with pytest.raises(ConfigError, match="already holds a fork of step 2"):
        enable_trainer(tiny_trainer(tmp_path / "c"), str(dst), fork_from=str(tmp_path / "x"))


def test_the_launch_flag_json_forks_a_trainer(tmp_path: Path) -> None:
    """``fork_from`` in the flag's config file reaches the Trainer's checkpointer: its first
    train() resumes from the source's step."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    enable_trainer(first := tiny_trainer(tmp_path / "a", **SHORT), str(src))
    first.train()
    config_file = tmp_path / "incremental.json"
    config_file.write_text(json.dumps({"dirpath": str(dst), "fork_from": f"{src}@2"}))
    config = _flag.file_settings(str(config_file), "--config")
    forked = tiny_trainer(tmp_path / "b", **LONG)
    assert _trainer_enable.from_flag(forked, config) is not None
    assert forked.train().global_step == 4
    assert CheckpointStore(dst).steps() == [2, 4]
    assert len(list((src / "pins").iterdir())) == 1


def test_a_fork_of_weights_only_trains_from_step_0_on_the_source_weights(tmp_path: Path) -> None:
    """``fork_weights_only=True``: ``train()`` starts at step 0 from the source step's weights
    (a fresh optimizer and schedule), its first checkpoint is coded against that step, and a
    restart resumes the fork's own checkpoint."""
    import torch

    src, dst = tmp_path / "src", tmp_path / "dst"
    enable_trainer(first := tiny_trainer(tmp_path / "a", **SHORT), str(src))
    first.train()
    trained = weights(first)
    forked = tiny_trainer(tmp_path / "b", **SHORT)
    assert not _equal(weights(forked), trained)
    enable_trainer(forked, str(dst), fork_from=f"{src}@2", fork_weights_only=True)
    seen: list[dict] = []
    real = forked.training_step

    def first_step(*args, **kwargs):
        if not seen:
            seen.append(weights(forked))
        return real(*args, **kwargs)

    forked.training_step = first_step
    assert forked.train().global_step == 2
    assert _equal(seen[0], trained), "training did not start from the source's weights"
    with CheckpointStore(dst) as store:
        assert store.steps() == [2] and store.manifest(2).parent == 2
    # By hand: the same Trainer started from the source's weights, bit for bit.
    by_hand = tiny_trainer(tmp_path / "c", **SHORT)
    with CheckpointStore(src) as store:
        by_hand.model.load_state_dict(store.load(2, keys="model")["model"])
    by_hand.train()
    assert _equal(weights(forked), weights(by_hand))
    again = tiny_trainer(tmp_path / "b", **LONG)
    enable_trainer(again, str(dst), fork_from=f"{src}@2", fork_weights_only=True)
    with pytest.warns(UserWarning, match="step 2 of"):  # its own checkpoint
        assert again.train().global_step == 4
    assert torch.is_tensor(next(iter(weights(again).values())))
