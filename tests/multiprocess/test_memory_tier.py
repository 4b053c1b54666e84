"""The memory tier end to end: two torchrun agents as two nodes (``--nnodes=2``, one process each,
each with its own memory directory), memory every step, store every 10 steps. One node's
training process is SIGKILLed at step 25; its agent restarts the group, which resumes from the
memory tier at step 24 or 25 (the store holds step 20) and ends bit-identical to an
uninterrupted run of the same job (trained first, in the same launch)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.runtime.memory_tier import ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "memory_job.py"
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(tmp: Path, node: int, port: int, kill: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=memory",
        f"--rdzv-conf=is_host={int(node == 0)},join_timeout=120", "--max-restarts=3",
        "--monitor-interval=0.1", str(JOB), "--dir", str(tmp / "stores"), "--out",
        str(tmp / "out"), "--kill", kill,
    ]  # fmt: skip
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        **{ENV: str(tmp / f"memory{node}")},
    )
    with (tmp / f"node{node}.log").open("w") as sink:
        return subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("memory_tier")
    port = _free_port()
    started = time.monotonic()
    nodes = [_agent(tmp, 0, port, kill="1:25")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the first agent hosts the rendezvous
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    nodes.append(_agent(tmp, 1, port, kill="1:25"))
    try:
        rcs = [node.wait(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    logs = "".join((tmp / f"node{n}.log").read_text() for n in (0, 1))
    assert rcs == [0, 0], logs[-8000:]
    events = [json.loads(line) for line in (tmp / "out" / "events.jsonl").read_text().splitlines()]
    print(f"\nmemory tier, two nodes, kill at step 25: {time.monotonic() - started:.1f} s in all")
    return {"tmp": tmp, "events": events, "logs": logs}


def test_a_killed_process_resumes_from_memory_bit_identically(killed: dict[str, Any]) -> None:
    events, out = killed["events"], killed["tmp"] / "out"
    assert [e["step"] for e in events if e["event"] == "kill"] == [25]
    starts = [e for e in events if e["event"] == "started"]
    assert {(e["rank"], e["resumed_from"]) for e in starts[:2]} == {(0, None), (1, None)}
    finished = [e for e in events if e["event"] == "finished"]
    assert {e["rank"] for e in finished} == {0, 1} and {e["step"] for e in finished} == {32}
    final_starts = starts[-2:]  # the incarnation that finished
    assert {e["rank"] for e in final_starts} == {0, 1}
    for start in final_starts:  # the store holds step 20: memory gave 24 or 25
        assert start["resumed_tier"] == "memory" and start["resumed_from"] in (24, 25), start
    assert "of the memory tier" in killed["logs"]
    for rank in (0, 1):
        final = torch.load(out / f"final_rank{rank}.pt")
        reference = torch.load(out / f"ref_rank{rank}.pt")
        assert final.keys() == reference.keys()
        assert all(torch.equal(final[k], reference[k]) for k in reference), rank


def test_every_node_holds_both_parts_of_the_last_step(killed: dict[str, Any]) -> None:
    """Replicated: each node's memory holds its own part and the other node's of step 31 (the
    last before the epoch's end), and nothing older."""
    for node in (0, 1):
        names = sorted(p.name for p in (killed["tmp"] / f"memory{node}" / "parts").iterdir())
        assert [(n[:13], n[-7:]) for n in names] == [
            ("s000000000031", "r000000"),
            ("s000000000031", "r000001"),
        ], names
