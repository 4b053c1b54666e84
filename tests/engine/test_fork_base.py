"""A fork of weights only (``fork(..., as_base=True)``): the source's step becomes the new
store's delta base, not a step of it. The new run numbers its own steps from 0, its first save
references what did not change and delta-codes what did, it loads bit-identically after the
source moved on and collected, and the pin goes only once nothing needs the source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.core.commit.history import FORK_BASE
from lightning_incremental.core.maintain.pool import unpin
from lightning_incremental.runtime.session.fork import ensure_fork
from tests.conftest import assert_state_equal
from tests.engine.test_pool import OPTIONS, base_state, packs, train

BACKBONE_BYTES = 64 * 256 * 4


def source(tmp_path: Path) -> Path:
    """A run with steps 1 and 2 (head and optimizer state trained, backbone frozen)."""
    src = tmp_path / "src"
    with CheckpointStore(src, **OPTIONS) as store:
        state = base_state()
        store.save(state, 1).wait()
        store.save(train(state, 2), 2).wait()
    return src


def fresh_run(weights: dict[str, Any], step: int) -> dict[str, Any]:
    """A new run on the source's weights: its own optimizer and counters."""
    head = weights["head"] - 0.5 * (step + 1)
    return {
        "model": {"backbone": weights["backbone"], "head": head},
        "optim": {"m": torch.zeros(16), "lr": torch.tensor(1e-4)},
        "step": step,
    }


def test_weights_only_fork_starts_at_step_0_and_references_the_source(tmp_path: Path) -> None:
    src, dst = source(tmp_path), tmp_path / "ft"
    assert CheckpointStore.fork(str(src), str(dst), 2, as_base=True) == 2
    assert packs(dst) == set() and (dst / FORK_BASE).exists()
    with CheckpointStore(src) as store:
        weights = store.load(2, keys="model")["model"]
    with CheckpointStore(dst, **OPTIONS) as fork:
        assert fork.steps() == [], "the source's step is no step of the fork"
        first = fresh_run(weights, 0)
        result = fork.save(first, 0).wait()  # steps of its own, from 0
        assert result.bytes_written < BACKBONE_BYTES / 4, "the frozen backbone was written again"
        assert result.chunks_reused >= BACKBONE_BYTES // 4096
        second = fresh_run(weights, 1)
        fork.save(second, 1).wait()
        assert fork.steps() == [0, 1]
    # The source moves on and collects with no minimum age: its pin keeps step 2's objects.
    with CheckpointStore(src, **OPTIONS) as store:
        store.save(train(base_state(), 3), 3).wait()
        store.save(train(base_state(), 4), 4).wait()
        store.gc(keep_last=1)
        assert store.steps() == [2, 4]
    with CheckpointStore(dst) as fork:  # reopens from its links alone
        assert fork.verify(0).ok and fork.verify(1).ok
        assert_state_equal(fork.load(0), first)
        assert_state_equal(fork.load(1), second)
    # The pin stays while a checkpoint of the fork names the source's objects (the frozen
    # backbone: for good, compacted or not).
    with CheckpointStore(dst, **OPTIONS) as fork:
        fork.compact()
        fork.gc(keep_last=1)
    with pytest.raises(ConfigError, match="still names objects held in"):
        unpin(str(src), str(dst))
    assert (dst / FORK_BASE).exists()


def test_a_weights_only_fork_without_a_checkpoint_keeps_its_pin(tmp_path: Path) -> None:
    src, dst = source(tmp_path), tmp_path / "ft"
    CheckpointStore.fork(str(src), str(dst), 2, as_base=True)
    with pytest.raises(ConfigError, match="holds no checkpoint yet"):
        unpin(str(src), str(dst))
    unpin(str(src), str(dst), force=True)  # the base goes with the pin: a full save next
    assert not (dst / FORK_BASE).exists()
    with CheckpointStore(dst, **OPTIONS) as fork:
        result = fork.save(fresh_run(base_state()["model"], 0), 0).wait()
        assert result.full_base and result.bytes_written > BACKBONE_BYTES / 2


def test_ensure_fork_restarts_a_weights_only_fork_before_its_first_checkpoint(
    tmp_path: Path,
) -> None:
    src, dst = source(tmp_path), str(tmp_path / "ft")
    assert ensure_fork(dst, f"{src}@2", weights_only=True) == 2
    assert ensure_fork(dst, f"{src}@2", weights_only=True) is None  # a restart: no checkpoint yet
    with pytest.raises(ConfigError, match="weights only"):
        ensure_fork(dst, f"{src}@2")  # the whole checkpoint from a fork of weights only
    with CheckpointStore(dst, **OPTIONS) as fork:
        fork.save(fresh_run(base_state()["model"], 0), 0).wait()
    assert ensure_fork(dst, f"{src}@2", weights_only=True) is None
    assert ensure_fork(dst, f"{src}@2") is None  # once it holds checkpoints, they resume
    whole = str(tmp_path / "whole")
    ensure_fork(whole, f"{src}@2")
    with pytest.raises(ConfigError, match="weights only"):
        ensure_fork(whole, f"{src}@2", weights_only=True)
