"""Resuming a Lightning DDP run on another number of ranks (``tests/jobs/resize_job.py`` under
torchrun, gloo): every rank logs the ids of the samples it trained, and the counts over the
interrupted epoch say whether each sample was trained exactly once; the state at the resume point
is compared bit for bit with the state the killed run committed; the account the library gives is
checked against what the runs did."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "resize_job.py"
SAMPLES = 96


def launch(world: int, store: Path, out: Path, *args: str) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--monitor-interval",
        "0.1",
        str(JOB),
        "--dir",
        str(store),
        "--out",
        str(out),
        *args,
    ]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    log = done.stdout + done.stderr
    killed = "--kill-at" in args
    assert (done.returncode != 0) == killed, f"exit {done.returncode}:\n{log[-6000:]}"
    return log


def rows(out: Path, incarnation: str = "") -> list[dict[str, Any]]:
    found = []
    for path in sorted(out.glob(f"ids{incarnation}_rank*.jsonl")):
        rank = int(path.stem.rpartition("_rank")[2])
        found += [dict(json.loads(line), rank=rank) for line in path.read_text().splitlines()]
    return found


def counts(killed: Path, resumed: Path, epoch: int, committed: int) -> Counter[int]:
    """How often each sample of ``epoch`` was trained: by the killed run up to its committed
    step, then by the resumed run."""
    trained: Counter[int] = Counter()
    for row in rows(killed):
        if row["epoch"] == epoch and row["step"] < committed:
            trained.update(row["ids"])
    for row in rows(resumed):
        if row["epoch"] == epoch:
            trained.update(row["ids"])
    return trained


def assert_exactly_once(trained: Counter[int]) -> None:
    never = sorted(set(range(SAMPLES)) - set(trained))
    twice = sorted(i for i, c in trained.items() if c > 1)
    assert not never and not twice, f"never trained: {never}; more than once: {twice}"


def assert_same_state(resumed: Path, killed: Path, world: int) -> None:
    """Every resumed rank starts from exactly what the killed run committed (its rank 0)."""
    expected = torch.load(killed / "at_kill_rank0.pt", weights_only=False)
    for rank in range(world):
        got = torch.load(resumed / f"at_start_rank{rank}.pt", weights_only=False)
        assert got["step"] == expected["step"]
        for key, tensor in expected["weights"].items():
            assert torch.equal(got["weights"][key], tensor), key
        for index, values in expected["optimizer"]["state"].items():
            for name, value in values.items():
                assert torch.equal(got["optimizer"]["state"][index][name], value), (index, name)


def account(log: str) -> str:
    found = re.findall(r"IncrementalCheckpoint: resuming on .*", log)
    assert len(found) == 1, log[-4000:]
    return found[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The killed runs, and their stores resumed on other worlds (one launch each)."""
    work = tmp_path_factory.mktemp("resize")
    result: dict[str, Any] = {"work": work}

    def killed(name: str, world: int, *args: str) -> Path:
        launch(world, work / name / "store", work / name, *args)
        return work / name

    def resumed(name: str, source: Path, world: int, *args: str) -> str:
        shutil.copytree(source / "store", work / name / "store")
        return launch(world, work / name / "store", work / name, *args)

    # 2 ranks, gradient accumulation 2: step 3 is batch 6 of 12 of epoch 0
    mid = killed("mid2", 2, "--kill-at", "3", "--accumulate", "2", "--max-epochs", "2")
    result["2to1"] = resumed("2to1", mid, 1, "--accumulate", "2", "--max-epochs", "2")
    result["2to3"] = resumed("2to3", mid, 3, "--accumulate", "2", "--max-epochs", "2")
    # 1 rank read in order (a SequentialSampler): step 6 of 24 of epoch 0
    seq = killed("seq1", 1, "--kill-at", "6", "--sequential", "--max-epochs", "2")
    result["1to2"] = resumed("1to2", seq, 2, "--sequential", "--max-epochs", "2")
    # 1 rank shuffled by a RandomSampler: its order cannot be computed again
    shuf = killed("shuf1", 1, "--kill-at", "6", "--max-epochs", "2")
    result["1to2shuffled"] = resumed("1to2shuffled", shuf, 2, "--max-epochs", "2")
    # 2 ranks, max_steps: step 12 is the end of epoch 0 (12 batches of 4 per rank)
    end = killed("end2", 2, "--kill-at", "12", "--max-steps", "24")
    result["2to1end"] = resumed("2to1end", end, 1, "--max-steps", "24")
    return result


@pytest.mark.parametrize(
    ("name", "world", "done", "per_rank"), [("2to1", 1, 48, 48), ("2to3", 3, 48, 16)]
)
def test_two_ranks_resumed_mid_epoch_on_one_or_three_train_the_epoch_exactly_once(
    runs: dict[str, Any], name: str, world: int, done: int, per_rank: int
) -> None:
    work = runs["work"]
    assert_same_state(work / name, work / "mid2", world)
    assert_exactly_once(counts(work / "mid2", work / name, epoch=0, committed=3))
    assert_exactly_once(counts(work / "mid2", work / name, epoch=1, committed=0))
    text = account(runs[name])
    assert f"resuming on {world} rank(s) a checkpoint saved by 2" in text
    assert f"{done} of the epoch's {SAMPLES} samples were trained" in text
    assert f"({per_rank} per rank, batches of 4), each trained once;" in text
    assert "not bit-exact" in text and f"global batch changes by {world}/2" in text
    # what it said runs is what ran: this many batches of the epoch on every rank
    for rank in range(world):
        resumed = [r for r in rows(work / name) if r["rank"] == rank and r["epoch"] == 0]
        assert sum(len(r["ids"]) for r in resumed) == per_rank


def test_one_rank_read_in_order_resumed_on_two_trains_the_epoch_exactly_once(
    runs: dict[str, Any],
) -> None:
    work = runs["work"]
    assert_same_state(work / "1to2", work / "seq1", 2)
    assert_exactly_once(counts(work / "seq1", work / "1to2", epoch=0, committed=6))
    assert_exactly_once(counts(work / "seq1", work / "1to2", epoch=1, committed=0))
    assert "24 of the epoch's 96 samples were trained; the other 72" in account(runs["1to2"])


def test_an_order_that_cannot_be_computed_again_is_said_so_and_what_runs_is_what_it_says(
    runs: dict[str, Any],
) -> None:
    work = runs["work"]
    assert_same_state(work / "1to2shuffled", work / "shuf1", 2)
    text = account(runs["1to2shuffled"])
    assert "the rest of the interrupted epoch is not known" in text
    assert "RandomSampler" in text and "resume on 1 rank(s)" in text
    more = int(re.search(r"Lightning trains (\d+) more batch", text).group(1))  # type: ignore[union-attr]
    assert more == 12 - 6  # a new world's epoch of 12 batches per rank, 6 counted as done
    for rank in range(2):
        resumed = [r for r in rows(work / "1to2shuffled") if r["rank"] == rank and r["epoch"] == 0]
        assert len(resumed) == more
    assert_exactly_once(counts(work / "shuf1", work / "1to2shuffled", epoch=1, committed=0))


def test_an_epoch_boundary_with_max_steps_trains_the_next_epoch_whole(
    runs: dict[str, Any],
) -> None:
    work = runs["work"]
    assert_same_state(work / "2to1end", work / "end2", 1)
    text = account(runs["2to1end"])
    assert "at the end of epoch 0" in text and "epoch 1 starts whole" in text
    assert "the 12 steps left are 24 steps of the new one (max_steps=36 for this run)" in text
    assert_exactly_once(counts(work / "end2", work / "2to1end", epoch=1, committed=0))
    result = json.loads((work / "2to1end" / "result_rank0.json").read_text())
    assert result == {"resumed_from": 12, "step": 36}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _accepting(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _elastic_command(store: Path, out: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=resize",
        "--rdzv-conf=last_call_timeout=2,join_timeout=120", "--max-restarts=2",
        "--monitor-interval=0.1", str(JOB), "--dir", str(store), "--out", str(out),
        "--elastic", "--pause", "0.3", "--max-epochs", "2",
    ]  # fmt: skip


def _start_agent(command: list[str], log: Path, *, hosts: bool) -> subprocess.Popen[bytes]:
    """One torchrun agent (a node); ``hosts``: wait until it hosts the rendezvous."""
    # the workers' store apart from the rendezvous's: two agents on one host re-rendezvous
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    with log.open("w") as sink:
        node = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    port = int(command[6].rpartition(":")[2])
    deadline = time.monotonic() + 60
    while hosts and not _accepting(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    return node


def _kill_all(node: subprocess.Popen[bytes]) -> None:
    """The agent and every process below it (torchrun starts its workers in sessions of their
    own, so killing the agent's group would leave them)."""
    for pid in [node.pid, *_descendants(node.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    node.wait()


def _wait_for_step(out: Path, world: int, step: int, store: Path, *nodes: Any) -> None:
    """Until rank 0 of the ``world``-rank incarnation started the batch after ``step + 1`` and
    ``step`` has committed."""
    from lightning_incremental.core import CheckpointStore

    first = out / f"ids{world}_rank0.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert all(node.poll() is None for node in nodes), "an agent ended early"
        if first.exists() and len(first.read_text().splitlines()) >= step + 3:
            break
        time.sleep(0.02)
    while time.monotonic() < deadline and step not in CheckpointStore(store).steps():
        time.sleep(0.02)
    assert step in CheckpointStore(store).steps(), f"step {step} never committed"


def _epoch_zero(out: Path, before: str, after: str, committed: int) -> Counter[int]:
    trained: Counter[int] = Counter()
    for row in rows(out, before):
        if row["epoch"] == 0 and row["step"] < committed:
            trained.update(row["ids"])
    for row in rows(out, after):
        if row["epoch"] == 0:
            trained.update(row["ids"])
    return trained


def test_an_elastic_job_that_loses_a_node_goes_on_alone_and_trains_the_epoch_once(
    tmp_path: Path,
) -> None:
    """Two torchrun agents (``--nnodes=1:2``, one process each) form one job; once step 6 has
    committed, one agent and its worker are SIGKILLed (a lost node). The other agent restarts
    its worker alone (the rendezvous needs one node), which resumes on one rank: the interrupted
    epoch is trained exactly once, and the account says 2 -> 1."""
    store, out = tmp_path / "store", tmp_path / "out"
    command = _elastic_command(store, out, _free_port())
    nodes: list[subprocess.Popen[bytes]] = []
    try:  # the first hosts the rendezvous: it is the node that survives
        nodes.append(_start_agent(command, tmp_path / "node0.log", hosts=True))
        nodes.append(_start_agent(command, tmp_path / "node1.log", hosts=False))
        _wait_for_step(out, 2, 6, store, *nodes)
        _kill_all(nodes[1])  # the lost node
        rc = nodes[0].wait(timeout=300)
    finally:
        for node in nodes:
            _kill_all(node)
    log = (tmp_path / "node0.log").read_text()
    assert rc == 0, log[-6000:]
    committed = json.loads((out / "result_rank0.json").read_text())["resumed_from"]
    assert committed is not None and committed >= 6
    assert {r["rank"] for r in rows(out, "2")} == {0, 1}  # the first incarnation: two ranks
    assert {r["rank"] for r in rows(out, "1")} == {0}  # the restarted one: alone
    assert_exactly_once(_epoch_zero(out, "2", "1", committed))
    assert "resuming on 1 rank(s) a checkpoint saved by 2" in account(log)


def test_an_elastic_job_that_gains_a_node_goes_on_with_both_and_trains_the_epoch_once(
    tmp_path: Path,
) -> None:
    """One agent trains alone (``--nnodes=1:2`` needs one node); after step 6 a second joins.
    The first agent stops its worker (SIGTERM: the preemption path commits that step) and the
    job restarts on two ranks, which resume it: the interrupted epoch is trained exactly once."""
    store, out = tmp_path / "store", tmp_path / "out"
    command = _elastic_command(store, out, _free_port())
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        nodes.append(_start_agent(command, tmp_path / "node0.log", hosts=True))
        _wait_for_step(out, 1, 6, store, *nodes)
        nodes.append(_start_agent(command, tmp_path / "node1.log", hosts=False))
        rcs = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            _kill_all(node)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert rcs == [0, 0], "\n".join(log[-4000:] for log in logs)
    committed = json.loads((out / "result_rank0.json").read_text())["resumed_from"]
    assert committed is not None and committed >= 6
    assert {r["rank"] for r in rows(out, "1")} == {0}
    assert {r["rank"] for r in rows(out, "2")} == {0, 1}
    assert_exactly_once(_epoch_zero(out, "1", "2", committed))
    assert "resuming on 2 rank(s) a checkpoint saved by 1" in account("".join(logs))
