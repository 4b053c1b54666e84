"""The CUDA paths, on a GPU (skipped without one; ``scripts/device-check.sh`` runs them where
one is lent): the pinned-memory snapshot, the copies on a side stream ordered against training's
later work, ``load(into=)`` onto device tensors, and a bit-exact resume of a Lightning run on
``accelerator="gpu"``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.save.snapshot import flatten_state, wait_ready

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
REPORT = os.environ.get("LI_DEVICE_REPORT")  # a JSON-lines file the figures are appended to


def _report(name: str, **figures: object) -> None:
    if REPORT:
        with open(REPORT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"test": name, **figures}) + "\n")


def _state(mb: int = 256) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    n = mb * (1 << 20) // 4 // 4
    return {f"w{i}": torch.randn(n, device="cuda", generator=g) for i in range(4)}


def test_the_snapshot_is_pinned_and_its_copies_run_on_a_side_stream() -> None:
    state = _state(64)
    flat = flatten_state(state)
    assert flat.ready, "device copies without an event to wait for"
    wait_ready(flat)
    for leaf, (key, t) in zip(flat.leaves, state.items()):
        assert leaf.data.is_pinned(), key
        assert torch.equal(leaf.data, t.cpu()), key


def test_training_work_queued_after_save_does_not_change_the_checkpoint(tmp_path: Path) -> None:
    """The side stream's copies and an in-place update queued right after ``save`` returns: the
    update waits for the copies on the device, so the checkpoint holds the values at save."""
    state = _state(512)
    expected = {k: v.clone() for k, v in state.items()}
    torch.cuda.synchronize()
    with CheckpointStore(str(tmp_path / "s")) as store:
        for step in range(1, 4):
            started = time.perf_counter()
            handle = store.save(state, step)
            returned = time.perf_counter() - started
            for t in state.values():  # what an optimizer step queued next does
                t.mul_(1.5).add_(1.0)
            result = handle.wait()
            loaded = store.load(step, map_location="cpu")
            for key, value in expected.items():
                assert torch.equal(loaded[key], value.cpu()), (step, key)
            expected = {k: v.clone() for k, v in state.items()}
            _report(
                "side_stream",
                step=step,
                state_mb=sum(t.numel() * 4 for t in state.values()) / 1e6,
                save_returned_s=returned,
                snapshot_s=result.snapshot_s,
                total_s=result.total_s,
            )


def test_load_into_device_tensors_is_bit_exact_and_in_place(tmp_path: Path) -> None:
    state = _state(128)
    with CheckpointStore(str(tmp_path / "s")) as store:
        store.save(state, 1).wait()
        live = {k: torch.zeros_like(v) for k, v in state.items()}
        pointers = {k: v.data_ptr() for k, v in live.items()}
        started = time.perf_counter()
        out = store.load(into=live)
        torch.cuda.synchronize()
        _report("load_into", seconds=time.perf_counter() - started)
    for key, value in state.items():
        assert out[key].device.type == "cuda"
        assert out[key].data_ptr() == pointers[key], key
        assert torch.equal(out[key], value), key


def test_a_lightning_gpu_run_resumes_bit_identical(tmp_path: Path) -> None:
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        from tests.jobs.lightning_job import fit, weights

        gpu = {"accelerator": "gpu", "devices": 1}
        reference, _, _ = fit(tmp_path / "ref", trainer=gpu, every_n_train_steps=5)
        fit(tmp_path / "run", trainer=gpu, every_n_train_steps=5, crash_at=13)
        resumed, _, ckpt = fit(tmp_path / "run", trainer=gpu, every_n_train_steps=5)
        assert ckpt.resumed_from is not None
        for key, value in weights(reference).items():
            assert torch.equal(value, weights(resumed)[key]), key
    finally:
        torch.use_deterministic_algorithms(False)
