"""The ``optimizer_state`` setting where users meet it: the Lightning callback and plug-in, the
Accelerate checkpointer's launch flag and config file, and the command's ``inspect`` / ``verify``
output. The default is exact everywhere; a bad value is an error naming the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accelerate_incremental import _flag, _launch
from lightning_incremental import IncrementalCheckpoint, IncrementalCheckpointIO
from lightning_incremental.cli import main
from lightning_incremental.core.errors import ConfigError
from tests.conftest import small_store


def test_callback_takes_the_setting_and_defaults_to_exact(tmp_path: Path) -> None:
    assert IncrementalCheckpoint(tmp_path).store_config.optimizer_state == "exact"
    cb = IncrementalCheckpoint(tmp_path, optimizer_state="int8")
    assert cb.store_config.optimizer_state == "int8"
    with pytest.raises(ConfigError, match="optimizer_state"):
        IncrementalCheckpoint(tmp_path, optimizer_state="int4")
    with pytest.raises(ConfigError, match="repeats optimizer_state"):
        IncrementalCheckpoint(tmp_path, store_options={"optimizer_state": "int8"})


def test_plugin_takes_the_setting_and_defaults_to_exact() -> None:
    assert IncrementalCheckpointIO().config.optimizer_state == "exact"
    assert IncrementalCheckpointIO(optimizer_state="bf16").config.optimizer_state == "bf16"
    with pytest.raises(ConfigError, match="optimizer_state"):
        IncrementalCheckpointIO(optimizer_state="fp8")


def test_accelerate_flag_and_config_file(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    found, _, _ = _launch.parse(["--dirpath", "ckpts", "--optimizer-state", "int8", str(script)])
    assert found == {"dirpath": "ckpts", "optimizer_state": "int8"}
    found, _, _ = _launch.parse(["--dirpath", "ckpts", str(script)])
    assert "optimizer_state" not in found  # the checkpointer's default: exact
    with pytest.raises(SystemExit):
        _launch.parse(["--dirpath", "ckpts", "--optimizer-state", "int4", str(script)])
    config = tmp_path / "incremental.json"
    config.write_text(json.dumps({"dirpath": "ckpts", "optimizer_state": "bf16"}))
    assert _flag.file_settings(str(config), "test")["optimizer_state"] == "bf16"
    config.write_text(json.dumps({"dirpath": "ckpts", "optimizer_state": "int4"}))
    with pytest.raises(SystemExit):
        _launch.parse(["--config", str(config), str(script)])


def test_inspect_and_verify_show_lossy_tensors(
    local_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    with small_store(local_url, optimizer_state="int8") as store:
        store.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, 1).wait()
    capsys.readouterr()
    assert main(["inspect", local_url]) == 0
    text = capsys.readouterr().out
    assert "stored lossily" in text and "not bit-exact" in text and "lossy" in text
    assert main(["inspect", local_url, "--json"]) == 0
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    lossy = {t["path"]: t["codecs"] for t in tensors if not t["lossless"]}
    assert lossy == {
        "state['optimizer']['state'][0]['exp_avg']": ["q8"],
        "state['optimizer']['state'][0]['exp_avg_sq']": ["l8"],
        "state['optimizer']['state'][1]['exp_avg']": ["q8"],
        "state['optimizer']['state'][1]['exp_avg_sq']": ["l8"],
    }
    assert main(["verify", local_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["checkpoints"][0]
    assert report["ok"] and sorted(report["lossy_tensors"]) == sorted(lossy)
