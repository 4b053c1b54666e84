"""The Trainer integration's checkpoint folders and what they hold: the Trainer's small files in
every folder, ``materialize`` and ``export --format hf`` for ``from_pretrained``; the refusal of
``hub_strategy`` uploads of checkpoints; the Trainer's JIT checkpoint right after a save; a run
resumed from an older checkpoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch

from accelerate_incremental import _flag, enable_trainer
from accelerate_incremental.trainer import enable as _trainer_enable
from accelerate_incremental.trainer import hf_compat as _hf_compat
from accelerate_incremental.trainer.markers import NAME
from lightning_incremental import cli
from lightning_incremental.core import CheckpointStore, ConfigError
from tests.hf.trainers import tiny_trainer, weights

SMALL_FILES = {"config.json", "generation_config.json", "training_args.bin", "README.md"}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def _pretrained(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(folder))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_hub_strategies_uploading_checkpoints_are_refused(tmp_path: Path, strategy: str) -> None:
    """Compared by the enum's value (``str(HubStrategy.CHECKPOINT)`` is not "checkpoint")."""
    from transformers.trainer_utils import HubStrategy

    trainer = tiny_trainer(tmp_path / "out")
    trainer.args.push_to_hub = True  # set afterwards: the Trainer's __init__ would reach the Hub
    trainer.args.hub_strategy = HubStrategy(strategy)
    with pytest.raises(ValueError, match=f"hub_strategy='{strategy}'"):
        enable_trainer(trainer, str(tmp_path / "store"))
    with pytest.warns(
        UserWarning, match=f"NOT incremental: push_to_hub with hub_strategy='{strategy}'"
    ):
        assert _trainer_enable.from_flag(trainer, {"dirpath": str(tmp_path / "store")}) is None
    assert "_save_checkpoint" not in vars(trainer)  # its own folders


def test_small_files_materialize_and_export_load_with_from_pretrained(tmp_path: Path) -> None:
    """Every folder holds the Trainer's small files; materialize="last" gives the last folder
    real weights; export --format hf (one file, then shards and an index) of an older step loads
    bit-exactly beside the small files of its folder."""
    store, out = tmp_path / "store", tmp_path / "out"
    trainer = tiny_trainer(out)
    enable_trainer(trainer, str(store), materialize="last")
    trainer.train()
    for step in (5, 10):
        names = {p.name for p in (out / f"checkpoint-{step}").iterdir()}
        assert SMALL_FILES - {"README.md"} | {NAME, "trainer_state.json"} <= names
    first = out / "checkpoint-5"
    assert "model.safetensors" not in {p.name for p in first.iterdir()}
    readme = (first / "README.md").read_text()
    assert f"lightning-incremental export {store} 5 --format hf --to {first}" in readme
    with pytest.raises(OSError):  # transformers' own message; the README is beside it
        _pretrained(first)
    # materialize="last": the last folder loads as the run ended, bit-exactly
    assert (out / "checkpoint-10" / "model.safetensors").is_file()
    assert not (out / "checkpoint-10" / "README.md").exists()
    assert _equal(_pretrained(out / "checkpoint-10"), weights(trainer))
    saved = CheckpointStore(store).load(5, keys="model")["model"]

    whole = tmp_path / "whole"
    code = cli.main(["export", str(store), "5", "--format", "hf", "--to", str(whole),
                     "--from-folder", str(first)])  # fmt: skip
    assert code == 0
    assert {"model.safetensors", "config.json", "training_args.bin"} <= set(os.listdir(whole))
    assert NAME not in os.listdir(whole)
    assert _equal(_pretrained(whole), {k: saved[k] for k in _pretrained(whole)})

    sharded = tmp_path / "sharded"
    code = cli.main(["export", str(store), "5", "--format", "hf", "--to", str(sharded),
                     "--from-folder", str(first), "--max-shard-size", "20KB"])  # fmt: skip
    assert code == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards <= set(os.listdir(sharded))
    assert "model.safetensors" not in os.listdir(sharded)
    assert _equal(_pretrained(sharded), _pretrained(whole))
    # the folder of another step is refused
    assert cli.main(["export", str(store), "10", "--format", "hf", "--to", str(sharded),
                     "--from-folder", str(first)]) == cli.EXIT_USAGE  # fmt: skip


def test_materialize_from_the_launch_flag_json_and_checked(tmp_path: Path) -> None:
    config_file = tmp_path / "incremental.json"
    config_file.write_text(json.dumps({"dirpath": str(tmp_path / "s"), "materialize": "best"}))
    config = _flag.file_settings(str(config_file), "--config")
    checkpointer = _trainer_enable.from_flag(tiny_trainer(tmp_path / "out"), config)
    assert checkpointer is not None and checkpointer.materialize == ("best",)
    with pytest.raises(ConfigError, match="materialize must be"):
        enable_trainer(tiny_trainer(tmp_path / "out2"), str(tmp_path / "s2"), materialize="every")


def test_a_jit_checkpoint_right_after_a_save_of_that_step_is_a_no_op(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Trainer's JIT checkpoint (preemption=False: it acts) saves the step just saved at
    save_steps again: the first save stands, the run stops as the Trainer alone does."""
    from transformers import TrainerCallback

    trainer = tiny_trainer(tmp_path / "out", save_steps=4, enable_jit_checkpoint=True)
    enable_trainer(trainer, str(tmp_path / "store"), preemption=False)
    manager = next(c.jit_manager for c in trainer.callback_handler.callbacks if
                   type(c).__name__ == "JITCheckpointCallback")  # fmt: skip
    manager.kill_wait = 0.0
    requested = threading.Event()

    class Sigterm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 4 and not requested.is_set():
                requested.set()
                os.kill(os.getpid(), signal.SIGTERM)  # its handler starts its timer (0 s)
                for _ in range(2000):  # wait for the timer thread to set the request
                    if manager.is_checkpoint_requested:
                        break
                    threading.Event().wait(0.005)
            return control

    trainer.add_callback(Sigterm())
    with caplog.at_level(logging.WARNING, logger="lightning_incremental"):
        trainer.train()  # the save at step 4, then the JIT save of step 4 at the next step
    assert trainer.state.global_step == 5  # the Trainer finishes the step its JIT save began
    assert CheckpointStore(tmp_path / "store").steps() == [4]
    assert "older checkpoint" not in caplog.text


def test_a_run_resumed_from_an_older_checkpoint_removes_the_newer_folders(tmp_path: Path) -> None:
    """Resumed from step 4 of 2, 4, 6, 8 and stopped at 6: step 8 is deleted from the store at
    the first save, and its folder with it, so get_last_checkpoint never names a deleted step."""
    store, out = tmp_path / "store", tmp_path / "out"
    first = tiny_trainer(out, max_steps=8, save_steps=2)
    enable_trainer(first, str(store))
    first.train()
    resumed = tiny_trainer(out, max_steps=6, save_steps=2)
    checkpointer = enable_trainer(resumed, str(store), auto_resume=False)
    opened = checkpointer.store
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert CheckpointStore(store).steps() == [2, 4, 6]
    assert not (out / "checkpoint-8").exists()
    assert _hf_compat.last_checkpoint(str(out)) == str(out / "checkpoint-6")
    assert checkpointer.store is opened  # the engine accepts step 6 again: no reopening
    again = tiny_trainer(out, max_steps=8, save_steps=2)
    enable_trainer(again, str(store))
    assert again.train(resume_from_checkpoint=True).global_step == 8
