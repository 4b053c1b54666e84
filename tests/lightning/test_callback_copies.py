"""IncrementalCheckpoint beside the rest of a Lightning script: deep copies and pickles of the
callback (and of a Trainer that holds it) after ``fit``, and OmegaConf hyper-parameters (what a
Hydra script saves) in its checkpoints."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_incremental
from lightning_incremental import IncrementalCheckpoint, IncrementalCheckpointIO
from lightning_incremental.core import CheckpointStore
from tests.jobs.lightning_job import TinyModel, fit


def test_callback_deep_copies_and_pickles_after_fit(tmp_path: Path) -> None:
    _, trainer, ckpt = fit(
        tmp_path / "store",
        every_n_train_steps=4,
        keep_last=2,
        trainer={"max_steps": 8},
        callbacks=[ModelCheckpoint(tmp_path / "ckpts")],
    )
    assert ckpt.last_saved_step == 8
    for clone in (copy.deepcopy(ckpt), pickle.loads(pickle.dumps(ckpt))):
        assert isinstance(clone, IncrementalCheckpoint)
        # the configuration and the restored state come along; the fit's machinery does not
        assert clone.dirpath == ckpt.dirpath and clone.every_n_train_steps == 4
        assert clone.store_config == ckpt.store_config and clone.state_key == ckpt.state_key
        assert clone.state_dict() == ckpt.state_dict()
        assert clone.url is None and clone.results == [] and clone.wait() == []
    copies = copy.deepcopy(trainer.callbacks)
    assert [type(cb) for cb in copies] == [type(cb) for cb in trainer.callbacks]
    buffer = io.BytesIO()
    torch.save(trainer, buffer)  # what some scripts (and Lightning's own tests) do
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    clone = next(cb for cb in restored.callbacks if isinstance(cb, IncrementalCheckpoint))
    assert clone.last_saved_step == 8


def test_a_copied_callback_fits_again_on_its_own(tmp_path: Path) -> None:
    _, _, ckpt = fit(tmp_path / "store", every_n_train_steps=4, trainer={"max_steps": 4})
    clone = pickle.loads(pickle.dumps(ckpt))
    trainer = L.Trainer(max_steps=8, logger=False, enable_progress_bar=False, callbacks=[clone])
    trainer.fit(TinyModel())
    assert clone.resumed_from == 4 and clone.last_saved_step == 8
    assert CheckpointStore(tmp_path / "store").steps() == [4, 8]


omegaconf = pytest.importorskip("omegaconf")


class HydraModel(TinyModel):
    """Takes its configuration the way a Hydra script passes it: one ``DictConfig``, which
    becomes ``self.hparams`` itself."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(hidden=cfg.model.hidden)
        self.save_hyperparameters(cfg)


class HydraArgsModel(TinyModel):
    """A ``DictConfig`` and a ``ListConfig`` among the init arguments."""

    def __init__(self, cfg: Any, layers: Any, hidden: int = 16) -> None:
        super().__init__(hidden=hidden)
        self.save_hyperparameters()


def _fit(tmp_path: Path, module: L.LightningModule) -> None:
    ckpt = IncrementalCheckpoint(tmp_path / "store", every_n_train_steps=4)
    trainer = L.Trainer(max_steps=4, logger=False, enable_progress_bar=False, callbacks=[ckpt])
    trainer.fit(module)


def test_dictconfig_hyperparameters_are_saved_as_plain_containers(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    plain = {
        "model": {"hidden": 8, "width": "${model.hidden}"},
        "tags": ["a", "b"],
        **{"shuffle": "generator", "num_workers": 0, "persistent_workers": False, "batch_size": 8},
    }
    cfg = OmegaConf.create(plain)
    _fit(tmp_path, HydraModel(cfg))
    saved = CheckpointStore(tmp_path / "store").load()
    hparams = saved["hyper_parameters"]
    assert type(hparams) is dict and type(hparams["model"]) is dict
    assert hparams == plain
    assert saved["hparams_type"] == "omegaconf.dictconfig.DictConfig"
    # lossless: the same configuration again, interpolations unresolved
    assert OmegaConf.create(hparams) == cfg


def test_dictconfig_init_arguments_are_saved_as_plain_containers(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg, layers = OmegaConf.create({"lr": 0.1}), OmegaConf.create([4, {"k": 2}])
    _fit(tmp_path, HydraArgsModel(cfg, layers, hidden=8))
    hparams = CheckpointStore(tmp_path / "store").load()["hyper_parameters"]
    assert (hparams["cfg"], hparams["layers"], hparams["hidden"]) == ({"lr": 0.1}, [4, {"k": 2}], 8)
    assert type(hparams["cfg"]) is dict and type(hparams["layers"]) is list


def test_the_plugin_saves_dictconfig_hyperparameters_as_the_callback_does(tmp_path: Path) -> None:
    """Through ``IncrementalCheckpointIO`` (ModelCheckpoint's saves) as well: a Hydra model's
    configuration is saved without pickling, and Lightning's loader gives it back."""
    from omegaconf import OmegaConf

    plain = {"model": {"hidden": 8}, "shuffle": "generator", "num_workers": 0}
    plain |= {"persistent_workers": False, "batch_size": 8}
    cfg = OmegaConf.create(plain)
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        plugins=[IncrementalCheckpointIO()],
    )
    trainer.fit(HydraModel(cfg))
    path = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    store = next((tmp_path / "checkpoints").glob("*.incremental"))
    stored = CheckpointStore(store).load()  # what the store holds: plain, no pickle
    assert stored["hyper_parameters"] == plain and type(stored["hyper_parameters"]) is dict
    assert isinstance(cfg, omegaconf.DictConfig)  # the model's own configuration is untouched
    loaded = IncrementalCheckpointIO().load_checkpoint(path)  # what Lightning gets: OmegaConf
    assert isinstance(loaded["hyper_parameters"], omegaconf.DictConfig)
    assert loaded["hyper_parameters"] == cfg
    restored = lightning_incremental.load_from_checkpoint(HydraModel, path)
    assert restored.hparams.model.hidden == 8  # nested attribute access, as from torch.save


def test_a_mocked_model_checkpoint_without_dirpath_is_tolerated(tmp_path: Path) -> None:
    """``Mock(spec=ModelCheckpoint)`` (how some frameworks stub it) has no ``dirpath``."""
    from unittest.mock import Mock

    mock = Mock(spec=ModelCheckpoint)
    mock.state_dict.return_value = {}  # what a checkpoint holds of it
    mock.state_key = "mocked"
    ckpt = IncrementalCheckpoint(tmp_path / "store", every_n_train_steps=2)
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_progress_bar=False, callbacks=[mock, ckpt]
    )
    trainer.fit(TinyModel())
    assert CheckpointStore(tmp_path / "store").steps() == [2]


def test_omegaconf_hyperparameters_round_trip_through_plain_containers() -> None:
    """What is saved is plain (no pickle); what a load hands Lightning is OmegaConf again, at the
    same places, with the type Lightning rebuilds the configuration with."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    from lightning_incremental.lightning.hparams import (
        MARK,
        plain_hyperparameters,
        typed_hyperparameters,
    )

    cfg = OmegaConf.create({"model": {"hidden": 8, "width": "${model.hidden}"}})
    layers = OmegaConf.create([4, {"k": 2}])
    checkpoint = {
        "hyper_parameters": {"cfg": cfg, "layers": layers, "lr": 0.1},
        "hparams_type": DictConfig,
    }
    plain = plain_hyperparameters(dict(checkpoint))
    assert plain["hyper_parameters"] == {
        "cfg": {"model": {"hidden": 8, "width": "${model.hidden}"}},
        "layers": [4, {"k": 2}],
        "lr": 0.1,
    }
    assert plain["hparams_type"] == "omegaconf.dictconfig.DictConfig"
    assert sorted(plain[MARK]) == [["hyper_parameters", "cfg"], ["hyper_parameters", "layers"]]
    typed = typed_hyperparameters(plain)
    assert MARK not in typed and typed["hparams_type"] is DictConfig
    assert isinstance(typed["hyper_parameters"]["cfg"], DictConfig)
    assert isinstance(typed["hyper_parameters"]["layers"], ListConfig)
    assert (
        typed["hyper_parameters"]["cfg"] == cfg
        and typed["hyper_parameters"]["cfg"].model.width == 8
    )
    assert typed["hyper_parameters"]["lr"] == 0.1
