"""The many-tensors sweep: three saves of ``n`` tensors of 4 KiB into one store (a full base,
the state unchanged, 1 % of the tensors changed) against ``torch.save`` + fsync and
``torch.load``, and the bytes of the unchanged save's manifest per tensor."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.timing import torch_save
from benchmarks.suites.scale import measure
from benchmarks.suites.scale.figures import (
    DURABLE_TARGET,
    MANIFEST_TARGET_B,
    RESTORE_TARGET,
    STALL_TARGET,
    record,
)

TENSOR_NUMEL = 1024  # 4 KiB of float32
CHANGED_FRACTION = 0.01


def many_tensors_state(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {f"layers.{i // 8}.w{i % 8}": torch.randn(TENSOR_NUMEL) for i in range(n)}}


def newest_manifest_bytes(store_dir: Path) -> int:
    newest = max((store_dir / "manifests").glob("*.json"), key=lambda p: p.name)
    return newest.stat().st_size


def tensors_sweep(n: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    """The many-tensors figures for ``n`` tensors of 4 KiB."""
    from lightning_incremental.core import CheckpointStore

    state = many_tensors_state(n)
    values = list(state["model"].values())
    changed = values[:: max(1, round(1 / CHANGED_FRACTION))]
    saves: dict[str, list[tuple[float, float]]] = {"full": [], "unchanged": [], "1% changed": []}
    manifest = math.inf
    store_dir = root / f"tensors-{n}"
    plain = root / f"tensors-{n}.pt"
    kept = root / f"tensors-{n}-baseline"
    baselines = []
    for _ in range(repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        with CheckpointStore(store_dir) as store:
            saves["full"].append(measure.timed_save(store, state, 1))
            baselines.append(measure.new_file_save(state, kept))  # interleaved: the same disk state
            saves["unchanged"].append(measure.timed_save(store, state, 2))
            manifest = min(manifest, newest_manifest_bytes(store_dir))
            for t in changed:
                t.add_(1)
            saves["1% changed"].append(measure.timed_save(store, state, 3))
            baselines.append(measure.new_file_save(state, kept))
    baseline = min(baselines)
    shutil.rmtree(kept, ignore_errors=True)
    torch_save(state, plain)
    ours_load = measure.fresh_restore("ours", store_dir, repeats)
    torch_load = measure.fresh_restore("torch", plain, repeats)
    case = f"{n:,} tensors"
    rows = []
    for kind, runs in saves.items():
        stall, durable = min(s for s, _ in runs), min(d for _, d in runs)
        rows.append(
            record(
                "tensors",
                case,
                n,
                f"stall, {kind} save",
                stall,
                baseline,
                "torch.save + fsync",
                "s",
                STALL_TARGET,
            )
        )
        rows.append(
            record(
                "tensors",
                case,
                n,
                f"time to durable, {kind} save",
                durable,
                baseline,
                "torch.save + fsync",
                "s",
                DURABLE_TARGET,
            )
        )
    rows.append(
        record(
            "tensors",
            case,
            n,
            "restore, fresh process",
            ours_load,
            torch_load,
            "torch.load",
            "s",
            RESTORE_TARGET,
        )
    )
    rows.append(
        record(
            "tensors",
            case,
            n,
            "manifest of an unchanged save, per tensor",
            manifest / n,
            None,
            None,
            "B",
            MANIFEST_TARGET_B,
            absolute=True,
        )
    )
    shutil.rmtree(store_dir, ignore_errors=True)
    plain.unlink(missing_ok=True)
    return rows
