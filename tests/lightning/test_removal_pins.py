"""The plug-in's removal of a store whose checkpoints are all gone keeps it while forks
reference its objects (its pins)."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_incremental import IncrementalCheckpointIO
from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.maintain.pool import fork
from tests.conftest import assert_state_equal


def test_removing_the_last_checkpoint_keeps_a_forked_store(tmp_path: Path) -> None:
    weights = tmp_path / "run" / "last.ckpt"
    expected = {"state_dict": {"w": torch.randn(64, 64)}, "global_step": 3}
    saver = IncrementalCheckpointIO(min_object_age_s=0)
    saver.save_checkpoint(expected, weights)
    saver.close()
    [store] = [p for p in (tmp_path / "run").iterdir() if p.is_dir()]
    [step] = CheckpointStore(store).steps()
    fork(store, tmp_path / "fork", step, min_age_s=0.0)
    # A process that does not save there (ddp_spawn's main one, a clean-up script) removes it.
    IncrementalCheckpointIO(min_object_age_s=0).remove_checkpoint(weights)
    assert not weights.exists() and (store / "pins").is_dir()
    with CheckpointStore(tmp_path / "fork", min_object_age_s=0.0) as forked:
        assert_state_equal(forked.load(step), expected)
