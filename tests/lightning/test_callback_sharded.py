"""IncrementalCheckpoint under sharded strategies: Lightning's ``ModelParallelStrategy`` (FSDP2)
on 2 CPU ranks, killed after a committed checkpoint, resumed bit-identically; resumed on 1 rank
from the 2-rank checkpoint; ``FSDPStrategy`` on a GPU; which strategies are refused; what
IncrementalCheckpointIO says under these strategies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

from lightning_incremental import IncrementalCheckpointIO
from lightning_incremental.core import ConfigError
from lightning_incremental.lightning import sharded as _sharded
from tests.lightning.test_callback import assert_bit_identical

JOB = Path(__file__).resolve().parents[1] / "jobs" / "lightning_sharded_job.py"
REPO = Path(__file__).resolve().parents[2]


def _launch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The job script, as Lightning's launcher expects to start it (it re-runs it per rank)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, str(JOB), *args]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.slow
def test_model_parallel_two_ranks_killed_resume_from_memory_and_store_and_onto_one_rank(
    tmp_path: Path,
) -> None:
    from tests.jobs.lightning_sharded_job import KILLED

    root, out = tmp_path / "d", tmp_path / "out"
    killed = _launch("kill", "--dir", str(root))
    assert killed.returncode == KILLED, killed.stderr[-4000:]
    shutil.copytree(root / "run", root / "one")  # the killed run's store, for the 1-rank resume
    shutil.copytree(root / "run", root / "store")  # and for a 2-rank resume from the store
    assert len(list((root / "mem").glob("*/s*10-g*-r*"))) == 2  # each rank's shards of step 10

    resumed = _launch("resume", "--dir", str(root), "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert json.loads((out / "result.json").read_text()) == {
        "resumed_from": {"run": [10, "memory"], "store": [9, "store"], "ref": [None, None]}
    }
    assert "resuming from step 10 (epoch 2) of the memory tier" in resumed.stderr
    assert "resumed mid-epoch 2: skipped the 1 batches" in resumed.stderr  # the store's step 9
    for rank in (0, 1):
        reference = torch.load(out / f"ref_rank{rank}.pt")
        for name in ("run", "store"):
            assert_bit_identical(torch.load(out / f"{name}_rank{rank}.pt"), reference)

    one = _launch("one", "--dir", str(root), "--out", str(out))
    assert one.returncode == 0, one.stderr[-4000:]
    # the data position is mapped onto the new mesh: the rest of the epoch, each sample once
    assert "resuming on 1 rank(s) a checkpoint saved by 2 (epoch 2, after 1 batches" in one.stderr
    assert "16 of the epoch's 64 samples were trained; the other 48 are split" in one.stderr
    restored = torch.load(out / "one.pt")
    assert restored["step"] == 9
    assert_bit_identical(restored["restored"], restored["stored"])


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs a GPU")
def test_fsdp_strategy_resume_bit_identical_on_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _launch("fsdp", "--dir", str(tmp_path / "d"), "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((out / "result.json").read_text()) == {"resumed_from": 9}
    assert_bit_identical(torch.load(out / "fsdp_run.pt"), torch.load(out / "fsdp_ref.pt"))


# ---------------------------------------------------------------------------- strategies


def test_sharded_and_replicated_strategies_are_told_apart() -> None:
    assert _sharded.layout(SingleDeviceStrategy(device="cpu")) == _sharded.REPLICATED
    assert _sharded.layout(DDPStrategy()) == _sharded.REPLICATED
    assert _sharded.layout(ModelParallelStrategy()) == _sharded.SHARDED
    assert _sharded.layout(FSDPStrategy()) == _sharded.SHARDED


def test_deepspeed_is_refused_saying_why() -> None:
    class DeepSpeedStrategy(SingleDeviceStrategy):  # as Lightning's: restores after setup
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

        @property
        def lightning_restore_optimizer(self) -> bool:
            return False

    with pytest.raises(
        ConfigError,
        match=r"does not support DeepSpeedStrategy: DeepSpeed's engine owns the partitioned "
        r"optimizer state.*ModelParallelStrategy \(FSDP2 / tensor parallel\) and FSDPStrategy",
    ):
        _sharded.layout(DeepSpeedStrategy(device="cpu"))


# ---------------------------------------------------------------------------- the plug-in


def test_plugin_warns_that_full_state_sharded_strategies_load_without_it() -> None:
    for strategy in (ModelParallelStrategy(save_distributed_checkpoint=False), FSDPStrategy()):
        text = _sharded.plugin_save_warning(strategy, ())
        assert text is not None
        assert "loads checkpoint paths itself with torch.load" in text
        assert "materialize='last'" in text and "IncrementalCheckpoint callback" in text
    materialized = _sharded.plugin_save_warning(ModelParallelStrategy(), ("last",))
    assert materialized is not None and "materialize=('last',) rewrites" in materialized
    assert _sharded.plugin_save_warning(DDPStrategy(), ()) is None
    unused = _sharded.plugin_unused_warning(ModelParallelStrategy())
    assert "never calls a CheckpointIO" in unused


def test_a_pointer_file_is_what_full_state_strategies_cannot_load(tmp_path: Path) -> None:
    """What the warning is about: their load is ``torch.load(path, mmap=True)``."""
    plugin = IncrementalCheckpointIO()
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
    plugin.teardown()
    with pytest.raises(RuntimeError, match="mmap can only be used with files saved"):
        torch.load(tmp_path / "last.ckpt", mmap=True, map_location="cpu", weights_only=False)


def test_the_dump_takes_the_sharded_state_in_place_of_the_strategys_own(tmp_path: Path) -> None:
    from lightning_incremental.lightning import compat as _compat
    from tests.jobs.lightning_job import fit

    _, trainer, _ = fit(tmp_path / "store", trainer={"max_epochs": 1}, every_n_epochs=0)
    checkpoint = _compat.dump_checkpoint(
        trainer,
        model_state=lambda: {"sharded": torch.zeros(1)},
        optimizer_state=lambda optimizer: {"of": type(optimizer).__name__},
    )
    assert list(checkpoint["state_dict"]) == ["sharded"]
    assert checkpoint["optimizer_states"] == [{"of": "SGD"}]
    assert "lightning_module_state_dict" not in vars(trainer.strategy)  # the strategy's again
    assert "net.0.weight" in _compat.dump_checkpoint(trainer)["state_dict"]
