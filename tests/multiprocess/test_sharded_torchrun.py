"""Sharded training end to end (``tests/jobs/sharded_job.py``): FSDP2 + AdamW on 2 gloo ranks, each
writing its own shards' deltas; resharded loads; rank deaths before the commit and mid-training.

Three launches share one module fixture: a fault-free 2-rank run, a 2-rank run under
``torchrun --max-restarts 2`` whose first attempt loses rank 1 between writing its part and the
commit and whose second attempt SIGKILLs rank 0 mid-training, and a 4-rank load of the first
run's checkpoint (uneven shards, empty ones included). The fault-free run and the 4-rank load
also save and load the same model under FSDP1 (``ShardedTensor`` state dicts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore
from lightning_incremental.core.format import layout as mf
from tests.jobs.sharded_job import same

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "sharded_job.py"


def torchrun(nproc: int, *args: str, restarts: int = 0, log: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(JOB),
        *args,
    ]
    # Each restarted attempt gets its own rendezvous store (pytorch/pytorch#135712).
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    with log.open("w") as out:
        rc = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300
        ).returncode
    assert rc == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("sharded")
    for name in ("clean", "faults", "load4"):
        (work / name).mkdir()
    torchrun(2, "train", "--dir", str(work / "clean_store"), "--out", str(work / "clean"),
             "--fsdp1", str(work / "fsdp1_store"), log=work / "clean" / "log")  # fmt: skip
    torchrun(
        2, "train", "--dir", str(work / "faults_store"), "--out", str(work / "faults"),
        "--fault", "before-commit:0:4:1", "--fault", "kill:1:7:0",
        restarts=2, log=work / "faults" / "log",
    )  # fmt: skip
    torchrun(
        4, "load", "--dir", str(work / "clean_store"), "--out", str(work / "load4"),
        "--ref", str(work / "clean" / "final.pt"), "--fsdp1", str(work / "fsdp1_store"),
        log=work / "load4" / "log",
    )  # fmt: skip
    return {"work": work}


def _final(runs: dict[str, Path], name: str) -> Any:
    return torch.load(runs["work"] / name / "final.pt", weights_only=False)


def test_every_rank_writes_its_own_pieces(runs):
    store = CheckpointStore(runs["work"] / "clean_store")
    assert store.steps() == [2, 4, 6, 8]
    doc = store.manifest(8)
    assert doc.version == 3 and doc.audit["world_size"] == 2
    by_path = {t.path: t for t in doc.tensors}
    up = by_path["state['model']['up.weight']"]
    assert up.shape == (12, 5) and [(p.offsets, p.sizes) for p in up.pieces] == [
        ((0, 0), (6, 5)),
        ((6, 0), (6, 5)),
    ]
    assert by_path["state['model']['scale']"].pieces is None  # a plain buffer: rank 0 writes it
    assert not doc.stats["full_base"] and doc.stats["chunks_reused"] > 0


def test_load_on_one_process_gives_full_tensors(runs):
    state = CheckpointStore(runs["work"] / "clean_store").load(8)
    same(state, _final(runs, "clean"))


def test_resharded_load_2_to_4_ranks_uneven(runs):
    results = [json.loads((runs["work"] / "load4" / f"load{r}.json").read_text()) for r in range(4)]
    assert all(r["step"] == 8 and r["checked"] == 25 for r in results)  # 6 params + buffer + 18
    assert [r["local_shapes"]["odd"] for r in results] == [[2, 3], [2, 3], [1, 3], [0, 3]]
    assert [r["local_shapes"]["tiny"] for r in results] == [[1], [0], [0], [0]]


def test_rank_lost_before_the_commit_never_makes_the_step_visible(runs):
    first_restart = json.loads((runs["work"] / "faults" / "attempt1.json").read_text())
    assert first_restart["steps"] == [2] and first_restart["resumed_from"] == 2
    second = json.loads((runs["work"] / "faults" / "attempt2.json").read_text())
    assert second["steps"] == [2, 4, 6] and second["resumed_from"] == 6


def test_killed_ranks_resume_to_a_bit_identical_end(runs):
    same(_final(runs, "faults"), _final(runs, "clean"))
    store = CheckpointStore(runs["work"] / "faults_store")
    assert store.steps() == [2, 4, 6, 8]
    same(store.load(8), _final(runs, "clean"))
    assert mf.manifest_path(8).startswith(mf.MANIFEST_DIR)


def test_dcp_export_reads_back_equal(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_incremental import cli

    out = tmp_path / "dcp"
    rc = cli.main(
        ["export", str(runs["work"] / "clean_store"), "--format", "dcp", "--to", str(out)]
    )
    assert rc == 0
    dcp_to_torch_save(out, tmp_path / "back.pt")
    same(torch.load(tmp_path / "back.pt", weights_only=False), _final(runs, "clean"))


def _pieces_match(shards: Any, full: Any, path: str = "") -> int:
    """Every local shard ``[(offsets, tensor), ...]`` of ``shards`` equals its box of ``full``;
    returns how many were compared."""
    if isinstance(shards, dict):
        return sum(_pieces_match(v, full[k], f"{path}/{k}") for k, v in shards.items())
    if isinstance(shards, list) and isinstance(full, torch.Tensor):
        for offsets, local in shards:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
            same(local, full[box].contiguous(), path)
        return len(shards)
    if isinstance(shards, list):
        return sum(_pieces_match(v, full[i], f"{path}/{i}") for i, v in enumerate(shards))
    same(shards, full, path)
    return 0


def test_fsdp1_sharded_tensors_saved_by_2_ranks_load_on_1_and_4(runs):
    """FSDP1's ``ShardedTensor`` state dicts: each of 2 ranks wrote its own pieces (built on its
    part of the previous checkpoint after the first); the same layout reloaded bit-exactly
    (checked in the job); one process reads whole tensors and 4 ranks their own shards, equal
    to what the 2 ranks held."""
    store = CheckpointStore(runs["work"] / "fsdp1_store")
    assert store.steps() == [1, 2, 3]
    doc = store.manifest(3)
    up = {t.path: t for t in doc.tensors}["state['model']['up.weight']"]
    assert [(p.offsets, p.sizes) for p in up.pieces] == [((0, 0), (6, 5)), ((6, 0), (6, 5))]
    assert not doc.stats["full_base"]  # each rank built on its own part of step 2
    full = store.load(3)
    compared = 0
    for path in [*(runs["work"] / "clean").glob("fsdp1_rank*.pt")] + [
        *(runs["work"] / "load4").glob("fsdp1_load*.pt")
    ]:
        compared += _pieces_match(torch.load(path, weights_only=False), full)
    assert compared >= 2 * 18 + 18  # 6 params and 12 moments: every one on each of 2 ranks
