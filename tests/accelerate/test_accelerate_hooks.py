"""Accelerate's save/load state pre-hooks under ``accelerate_incremental.enable``, modelled on
Accelerate's ``test_save_load_model_with_hooks``: the hooks run with the arguments Accelerate
gives them (models, weights, the directory) and what they remove is theirs to save and load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

from accelerate_incremental import enable
from tests.accelerate.test_accelerate import _fresh_state, make_run, same, weights  # noqa: F401


def _randomize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def test_save_load_model_with_hooks(tmp_path: Path) -> None:
    run = make_run()
    enable(run.acc, str(tmp_path / "store"))
    signature = weights(run)

    def save_config(models: list[Any], weights_: list[Any], output_dir: str) -> None:
        config = {"class_name": models[0].__class__.__name__}
        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump(config, f)

    def load_config(models: list[Any], input_dir: str) -> None:
        with open(os.path.join(input_dir, "data.json")) as f:
            config = json.load(f)
        models[0].class_name = config["class_name"]

    save_hook = run.acc.register_save_state_pre_hook(save_config)
    load_hook = run.acc.register_load_state_pre_hook(load_config)
    first = tmp_path / "first"
    run.acc.save_state(str(first))
    _randomize(run.model)
    assert not same(signature, weights(run))
    run.model.class_name = "random"
    run.acc.load_state(str(first))
    assert same(signature, weights(run))
    assert run.model.class_name == run.model.__class__.__name__

    save_hook.remove()
    load_hook.remove()
    second = tmp_path / "second"
    run.acc.save_state(str(second))
    assert not (second / "data.json").exists()
    _randomize(run.model)
    run.model.class_name = "random"
    run.acc.load_state(str(second))
    assert same(signature, weights(run))
    assert run.model.class_name != run.model.__class__.__name__


def test_hooks_get_accelerates_arguments_with_automatic_naming(tmp_path: Path) -> None:
    project = ProjectConfiguration(
        project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True
    )
    run = make_run(project=project)
    ckpt = enable(run.acc, str(tmp_path / "store"))
    assert ckpt is not None
    calls: list[tuple[str, Any, Any, str]] = []

    def on_save(models: list[Any], weights_: list[Any], output_dir: str) -> None:
        assert models is run.acc._models
        assert len(weights_) == 1 and same(weights_[0], weights(run))
        assert os.path.isdir(output_dir)
        calls.append(("save", list(models), len(weights_), output_dir))

    def on_load(models: list[Any], input_dir: str) -> None:
        assert models == run.acc._models and models is not run.acc._models
        calls.append(("load", list(models), None, input_dir))

    run.acc.register_save_state_pre_hook(on_save)
    run.acc.register_load_state_pre_hook(on_load)
    run.acc.save_state()
    run.acc.save_state()
    checkpoints = tmp_path / "proj" / "checkpoints"
    assert [c[3] for c in calls] == [
        str(checkpoints / "checkpoint_0"),
        str(checkpoints / "checkpoint_1"),
    ]
    assert ckpt.steps() == [0, 1]
    assert run.acc.load_state() == 1
    assert calls[-1] == ("load", [run.model], None, str(checkpoints / "checkpoint_1"))


def test_hooks_that_save_and_load_a_model_themselves(tmp_path: Path) -> None:
    """The pattern of libraries that save a model in their own format: the save hook writes it
    and removes its weights (not saved again), the load hook loads it and removes the model
    (the checkpoint's weights go to the models left)."""
    run = make_run()
    ckpt = enable(run.acc, str(tmp_path / "store"))
    assert ckpt is not None
    saved = weights(run)

    def save_own(models: list[Any], weights_: list[Any], output_dir: str) -> None:
        torch.save(weights_.pop(), os.path.join(output_dir, "own.pt"))

    def load_own(models: list[Any], input_dir: str) -> None:
        model = models.pop()
        run.acc.unwrap_model(model).load_state_dict(torch.load(os.path.join(input_dir, "own.pt")))

    run.acc.register_save_state_pre_hook(save_own)
    run.acc.register_load_state_pre_hook(load_own)
    run.acc.save_state(str(tmp_path / "ck"))
    assert ckpt.store.load()["models"] == []  # the hook saved the only model itself
    _randomize(run.model)
    run.acc.load_state(str(tmp_path / "ck"))
    assert same(saved, weights(run))


def test_hooks_without_a_directory_are_an_error_not_skipped(tmp_path: Path) -> None:
    run = make_run()
    enable(run.acc, str(tmp_path / "store"))
    called: list[str] = []
    run.acc.register_save_state_pre_hook(lambda *a: called.append("save"))
    with pytest.raises(ValueError, match="register_save_state_pre_hook"):
        run.acc.save_state()
    run.acc.save_state(str(tmp_path / "ck"))
    run.acc.register_load_state_pre_hook(lambda *a: called.append("load"))
    with pytest.raises(ValueError, match="register_load_state_pre_hook"):
        run.acc.load_state()
    with pytest.raises(ValueError, match="folder does not exist"):
        run.acc.load_state(str(tmp_path / "nowhere"))
    assert run.acc.load_state(str(tmp_path / "ck")) == 0
    assert called == ["save", "load"]


def test_load_hook_directory_of_the_restored_step_must_exist(tmp_path: Path) -> None:
    project = ProjectConfiguration(
        project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True
    )
    run = make_run(project=project)
    enable(run.acc, str(tmp_path / "store"))
    run.acc.save_state()  # no hooks: no checkpoint directory is made
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fresh = make_run(
        project=ProjectConfiguration(
            project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True
        )
    )
    enable(fresh.acc, str(tmp_path / "store"))
    fresh.acc.register_load_state_pre_hook(lambda models, d: None)
    with pytest.raises(ValueError, match=r"checkpoint_0, which does not exist"):
        fresh.acc.load_state()
