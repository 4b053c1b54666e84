"""An Accelerate run under the launch flag resumed on another number of processes
(``tests/jobs/accelerate_resize_job.py``, real ``accelerate launch`` runs over gloo): every
process logs the ids of the samples it trained; the interrupted epoch must train each sample
exactly once, the resumed processes must start from the committed weights and optimizer state bit
for bit, and the account must say what happened."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "accelerate_resize_job.py"
SAMPLES, KILL_AT = 96, 6  # 12 batches of 4 per process and epoch on 2 processes, 24 on 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(processes: int, store: Path, out: Path, *args: str) -> str:
    if processes == 1:
        cmd = [sys.executable, str(JOB), str(out), *args]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            str(JOB), str(out), *args,
        ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_INCREMENTAL")}
    env.update(ACCELERATE_INCREMENTAL=str(store), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    log = done.stdout + done.stderr
    if args:  # killed at a step
        assert done.returncode != 0 and (out / "at_kill.pt").exists(), log[-4000:]
    else:
        assert done.returncode == 0, log[-6000:]
        assert log.count("JOB DONE") == processes, log[-4000:]
    return log


def rows(out: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(out.glob("ids_rank*.jsonl")):
        rank = int(path.stem.rpartition("_rank")[2])
        found += [dict(json.loads(line), rank=rank) for line in path.read_text().splitlines()]
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Killed runs (2 processes at step 6, mid-epoch 0; 1 process at step 6; 2 processes at step
    12, the end of epoch 0), and their stores resumed on other numbers of processes."""
    work = tmp_path_factory.mktemp("accelerate_resize")
    logs = {}
    for killed, processes, at in (("killed", 2, KILL_AT), ("one", 1, KILL_AT), ("end", 2, 12)):
        run(processes, work / killed / "store", work / killed, str(at))
    for name, source, processes in (
        ("2to1", "killed", 1), ("2to3", "killed", 3), ("1to2", "one", 2), ("2to1end", "end", 1)
    ):  # fmt: skip
        shutil.copytree(work / source / "store", work / name / "store")
        logs[name] = run(processes, work / name / "store", work / name)
    return {"work": work, **logs}


def _exactly_once(trained: Counter[int]) -> None:
    never = sorted(set(range(SAMPLES)) - set(trained))
    twice = sorted(i for i, c in trained.items() if c > 1)
    assert not never and not twice, f"never trained: {never}; more than once: {twice}"


def test_one_process_resumed_on_two_trains_the_epoch_exactly_once(runs: dict[str, Any]) -> None:
    work = runs["work"]
    trained = Counter(
        i for r in rows(work / "one") if r["epoch"] == 0 and r["step"] < KILL_AT for i in r["ids"]
    )
    trained.update(i for r in rows(work / "1to2") if r["epoch"] == 0 for i in r["ids"])
    _exactly_once(trained)
    assert_same_state(work / "one", work / "1to2", 2, KILL_AT)
    assert "24 of the epoch's 96 samples were trained; the other 72" in runs["1to2"]
    assert "(36 per process, batches of 4)" in runs["1to2"]


def test_at_an_epoch_end_the_next_epoch_starts_whole_on_the_other_number(
    runs: dict[str, Any],
) -> None:
    work = runs["work"]
    assert_same_state(work / "end", work / "2to1end", 1, 12)
    assert not [r for r in rows(work / "2to1end") if r["epoch"] == 0]
    _exactly_once(Counter(i for r in rows(work / "2to1end") if r["epoch"] == 1 for i in r["ids"]))
    text = runs["2to1end"]
    assert (
        "resuming on 1 process(es) a checkpoint saved by 2 (DataLoader 0, before epoch 1)" in text
    )
    assert "epoch 1 starts whole" in text


@pytest.mark.parametrize(("processes", "per_process"), [(1, 48), (3, 16)])
def test_two_processes_resumed_on_one_or_three_train_the_epoch_exactly_once(
    runs: dict[str, Any], processes: int, per_process: int
) -> None:
    work, name = runs["work"], f"2to{processes}"
    trained: Counter[int] = Counter()
    for row in rows(work / "killed"):
        if row["epoch"] == 0 and row["step"] < KILL_AT:
            trained.update(row["ids"])
    resumed = [row for row in rows(work / name) if row["epoch"] == 0]
    for row in resumed:
        trained.update(row["ids"])
    _exactly_once(trained)
    for rank in range(processes):  # what the account says runs is what ran
        assert sum(len(r["ids"]) for r in resumed if r["rank"] == rank) == per_process
    next_epoch = Counter(i for row in rows(work / name) if row["epoch"] == 1 for i in row["ids"])
    assert sorted(next_epoch) == list(range(SAMPLES)) and set(next_epoch.values()) == {1}
    text = runs[name]
    assert f"resuming on {processes} process(es) a checkpoint saved by 2" in text
    assert "48 of the epoch's 96 samples were trained; the other 48" in text
    assert f"({per_process} per process, batches of 4), each trained once" in text

    assert_same_state(work / "killed", work / name, processes, KILL_AT)


def assert_same_state(killed: Path, resumed: Path, processes: int, step: int) -> None:
    """Every resumed process starts from exactly what the killed run committed."""
    expected = torch.load(killed / "at_kill.pt", weights_only=False)
    for rank in range(processes):
        got = torch.load(resumed / f"at_start_rank{rank}.pt", weights_only=False)
        assert got["step"] == expected["step"] == step
        for key, tensor in expected["weights"].items():
            assert torch.equal(got["weights"][key], tensor), key
        for index, values in expected["optimizer"]["state"].items():
            for field, value in values.items():
                assert torch.equal(got["optimizer"]["state"][index][field], value)
