"""Aligned packs in a shared pool: runs that store the same tensors (a sweep's frozen base) with
tensors of their own in between (adapters, heads, optimizer state) write byte-identical packs
for what they share, so the pool holds it once — without a fork, from independent runs; a run
whose tensors differ somewhere shares again after the difference; stores outside a pool keep
their packs as before; every checkpoint loads bit-identically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.chunks.packs import ALIGNED_FROM, aligned_from
from tests.conftest import assert_state_equal

OPTIONS: dict[str, Any] = {"chunk_size": 256 << 10, "fsync": False, "min_object_age_s": 0.0}
LAYERS = 8


def base(layer: int) -> torch.Tensor:
    """A frozen weight of the shared base: 768 KiB, three chunks."""
    return torch.randn(384, 512, generator=torch.Generator().manual_seed(layer))


def run_state(run: int, changed: int | None = None) -> dict[str, Any]:
    """Run ``run``'s checkpoint: per layer the base's weight, the run's adapters (12 KiB: below
    the aligned size) and a norm; ``changed``: that layer's base weight is another one."""
    g = torch.Generator().manual_seed(1000 + run)
    model: dict[str, Any] = {}
    for layer in range(LAYERS):
        model[f"layer{layer}.weight"] = base(layer + (100 if layer == changed else 0))
        model[f"layer{layer}.lora_A"] = torch.randn(8, 384, generator=g)
        model[f"layer{layer}.lora_B"] = torch.randn(8, 384, generator=g)
        model[f"layer{layer}.norm"] = torch.ones(384) * run
    return {"model": model, "optimizer": {"m": torch.randn(4096, generator=g)}, "step": 1}


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def pack_names(root: Path) -> set[str]:
    return {p.name for p in (root / "packs").rglob("*.pack")}


def test_independent_runs_in_a_pool_store_their_shared_base_once(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    states = [run_state(run) for run in range(4)]
    for run, state in enumerate(states):
        with CheckpointStore(tmp_path / f"run{run}", pool=pool, **OPTIONS) as store:
            assert aligned_from(store.storage) == ALIGNED_FROM
            store.save(state, 1).wait()
    base_bytes = LAYERS * 384 * 512 * 4
    stored = disk_bytes(pool / "packs")
    # Four runs: the base once (it barely compresses), plus each run's own few hundred KiB.
    assert stored < 1.35 * base_bytes, f"{stored / base_bytes:.2f}x the base"
    for run, state in enumerate(states):
        with CheckpointStore(tmp_path / f"run{run}") as store:
            assert_state_equal(store.load(1), state)
            assert store.verify(1).ok


def test_a_run_that_differs_in_one_tensor_shares_the_rest(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    with CheckpointStore(tmp_path / "a", pool=pool, **OPTIONS) as store:
        store.save(run_state(0), 1).wait()
    first = pack_names(pool)
    with CheckpointStore(tmp_path / "b", pool=pool, **OPTIONS) as store:
        store.save(run_state(1, changed=2), 1).wait()
        assert_state_equal(store.load(1), run_state(1, changed=2))
    new = pack_names(pool) - first
    base_bytes = LAYERS * 384 * 512 * 4
    new_bytes = sum(os.path.getsize(p) for p in (pool / "packs").rglob("*.pack") if p.name in new)
    # Layer 2 (and the pack it shares with its neighbours) is new; the other layers are not.
    assert new_bytes < 0.55 * base_bytes, f"{new_bytes / base_bytes:.2f}x the base written again"


def test_stores_outside_a_pool_pack_as_before(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path / "plain", **OPTIONS) as store:
        assert aligned_from(store.storage) is None
        store.save(run_state(0), 1).wait()
        assert_state_equal(store.load(1), run_state(0))
