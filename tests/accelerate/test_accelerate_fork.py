"""IncrementalCheckpointer(fork_from="SRC[@STEP]") with a real Accelerator: the fork loads the
source's step exactly and stores no copy of it; a restart does not fork again; a store forked
from another source is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

import accelerate_incremental
from accelerate_incremental import IncrementalCheckpointer
from lightning_incremental.core import ConfigError
from tests.accelerate.test_accelerate import _fresh_state, epoch_batches, make_run, same, weights

__all__ = ["_fresh_state"]  # its reset of Accelerate's global state after each test


def _fresh() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _packs(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "packs").rglob("*") if p.is_file()}


def _continue(store: str, expect: int, **options: object) -> tuple[dict, dict]:
    """A new process: load ``store`` (``expect`` is the step found), train the rest of the
    epoch and one more, save; the weights and the optimizer's state."""
    _fresh()
    run = make_run()
    torch.manual_seed(999)  # differs before load: load sets it
    with IncrementalCheckpointer(run.acc, store, **options) as ckpt:
        assert ckpt.load() == expect
        epoch_batches(ckpt, run)
        epoch_batches(ckpt, run)
        ckpt.save(20)
    return weights(run), run.opt.state_dict()["state"]


def test_fork_loads_exactly_without_a_copy_and_a_restart_does_not_fork_again(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(src)) as ckpt:
        epoch_batches(ckpt, run)
        epoch_batches(ckpt, run, stop_after=2)
        ckpt.save(8)
    source_packs = _packs(src)
    assert source_packs

    forked, forked_opt = _continue(str(dst), 8, fork_from=f"{src}@8")
    assert not source_packs & _packs(dst)  # step 8's objects stay the source's
    assert len(list((src / "pins").iterdir())) == 1
    continued, continued_opt = _continue(str(src), 8)
    assert same(forked, continued)
    for pid, entry in continued_opt.items():
        for key, value in entry.items():
            assert torch.equal(forked_opt[pid][key], value), key

    _fresh()  # a restart of the fork: its own newest step, no second fork
    again = make_run()
    with IncrementalCheckpointer(again.acc, str(dst), fork_from=f"{src}@8") as ckpt:
        assert ckpt.load() == 20 and ckpt.steps() == [8, 20]
    assert len(list((src / "pins").iterdir())) == 1


def test_a_store_forked_from_another_source_is_refused(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(src)) as ckpt:
        ckpt.save(4)
    IncrementalCheckpointer(run.acc, str(dst), fork_from=str(src)).close()
    with pytest.raises(ConfigError, match="already holds a fork of step 4") as info:
        IncrementalCheckpointer(run.acc, str(dst), fork_from=str(tmp_path / "other"))
    assert str(src) in str(info.value) and "other" in str(info.value)


def test_the_launch_flag_json_forks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``{"dirpath": DST, "fork_from": "SRC@STEP"}`` in the flag's config file: the store the
    flag enables starts from the source's step, as ``IncrementalCheckpointer(fork_from=)``."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(src)) as ckpt:
        epoch_batches(ckpt, run, stop_after=2)
        ckpt.save(2)
        epoch_batches(ckpt, run, stop_after=2)
        ckpt.save(4)
    config = tmp_path / "incremental.json"
    config.write_text(json.dumps({"dirpath": str(dst), "fork_from": f"{src}@2"}))
    monkeypatch.setenv(accelerate_incremental.ENV_CONFIG, str(config))
    _fresh()
    again = make_run()
    ckpt = accelerate_incremental.enable(again.acc)
    assert ckpt is not None
    try:
        assert ckpt.load() == 2 and ckpt.steps() == [2]
    finally:
        ckpt.close()
    assert len(list((src / "pins").iterdir())) == 1 and not _packs(dst)  # a fork, no copy


def test_a_fork_of_weights_only_loads_the_weights_and_nothing_else(tmp_path: Path) -> None:
    """``fork_weights_only=True``: ``load`` puts the source step's weights into the model and
    restores nothing else (a fresh optimizer, step 0); the fork's first checkpoint is coded
    against the source's step; a restart loads the fork's own checkpoint; the launch flag's JSON
    takes the key too."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    run = make_run()
    with IncrementalCheckpointer(run.acc, str(src)) as ckpt:
        epoch_batches(ckpt, run, stop_after=2)
        ckpt.save(8)
    trained = weights(run)

    _fresh()
    fresh = make_run()
    with IncrementalCheckpointer(
        fresh.acc, str(dst), fork_from=f"{src}@8", fork_weights_only=True
    ) as ckpt:
        assert not same(weights(fresh), trained)
        assert ckpt.load() is None and ckpt.steps() == []
        assert same(weights(fresh), trained)
        assert fresh.opt.state_dict()["state"] == {}, "the optimizer is the run's own, fresh"
        epoch_batches(ckpt, fresh, stop_after=2)
        ckpt.save(2)
        ckpt.wait()
        assert ckpt.store.manifest(2).parent == 8
    assert len(list((src / "pins").iterdir())) == 1

    _fresh()  # a restart: the fork's own step, nothing from the source
    again = make_run()
    with IncrementalCheckpointer(
        again.acc, str(dst), fork_from=f"{src}@8", fork_weights_only=True
    ) as ckpt:
        assert ckpt.load() == 2

    config = tmp_path / "incremental.json"
    config.write_text(
        json.dumps(
            {"dirpath": str(tmp_path / "flag"), "fork_from": f"{src}@8", "fork_weights_only": True}
        )
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(accelerate_incremental.ENV_CONFIG, str(config))
        _fresh()
        third = make_run()
        flagged = accelerate_incremental.enable(third.acc)
        assert flagged is not None
        try:
            assert flagged.load() is None and same(weights(third), trained)
        finally:
            flagged.close()
    with pytest.raises(ConfigError, match="needs fork_from"):
        IncrementalCheckpointer(third.acc, str(tmp_path / "x"), fork_weights_only=True)
