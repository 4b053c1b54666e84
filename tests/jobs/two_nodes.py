"""Two torchrun agents as two nodes on this machine (one training process each unless told, each
node with its own memory directory), for the memory tier's two-node tests and
``benchmarks.suites.recovery``.

:func:`run` starts node 0 (it hosts the rendezvous) and node 1 with a job; when the job reports a
node lost whole (a ``"node": true`` event: agent and process SIGKILLed), it starts a replacement
agent, node 2, whose memory directory is empty.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from lightning_incremental.runtime.memory.tier import ENV

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def agent(
    tmp: Path, node: int, port: int, job: Path, args: Sequence[str], per_node: int = 1
) -> subprocess.Popen[bytes]:
    """Node ``node``'s torchrun agent (``per_node`` processes) running ``job --dir TMP/stores
    --out TMP/out ARGS``, its memory directory ``TMP/memory<node>``, its output in
    ``TMP/node<node>.log``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=memory",
        f"--rdzv-conf=is_host={int(node == 0)},join_timeout=120", "--max-restarts=3",
        "--monitor-interval=0.1", str(job), "--dir", str(tmp / "stores"), "--out",
        str(tmp / "out"), *args,
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


def kill_args(kills: Sequence[str]) -> list[str]:
    """The job's ``--kill`` arguments for ``kills`` (``RANK:STEP[:HOW]`` each)."""
    return [arg for kill in kills for arg in ("--kill", kill)]


def reap(nodes: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the agents still running (with their workers: a session each) and reap all."""
    for node in nodes:
        if node.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def run(
    tmp: Path, job: Path, args: Sequence[str], timeout_s: float, per_node: int = 1
) -> tuple[list[int], str]:
    """Run ``job`` on two nodes of ``per_node`` processes (and a replacement for a node lost
    whole) until every agent ended or ``timeout_s`` passed (then what is left is killed);
    returns the agents' exit codes (node 0, 1, then the replacement's) and their logs."""
    port = free_port()
    nodes = [agent(tmp, 0, port, job, args, per_node)]
    wait_for_port(port)  # the first agent hosts the rendezvous
    nodes.append(agent(tmp, 1, port, job, args, per_node))
    events = tmp / "out" / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    try:
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            if len(nodes) == 2 and events.exists() and '"node": true' in events.read_text():
                nodes[1].wait(timeout=30)  # the lost node's agent
                nodes.append(agent(tmp, 2, port, job, args, per_node))  # replacement, no memory
            time.sleep(0.1)
    finally:
        reap(nodes)
    logs = "".join((tmp / f"node{n}.log").read_text() for n in range(len(nodes)))
    return [int(node.returncode) for node in nodes], logs


def empty(memory: Path, *, every_node: bool = False) -> None:
    """Delete a node's memory directory (``every_node``: every node's, its siblings named
    ``memory*``), as a replacement node would find it. The other processes may still be
    pruning in it: deleted again until it is gone."""
    for directory in memory.parent.glob("memory*") if every_node else [memory]:
        for _ in range(100):
            shutil.rmtree(directory, ignore_errors=True)
            if not directory.exists():
                break


def parts_held(memory: Path, key: str) -> dict[str, list[Any]]:
    """The parts in a node's memory directory: each one's data size and whether its index names
    ``key`` (the optimizer state's), for the jobs' kill events. A part another rank's background
    work deleted meanwhile is left out."""
    held = {}
    for path in memory.glob("*/s*"):
        try:
            holds = f'"{key}"'.encode() in (path / "index.json").read_bytes()
            held[path.name] = [(path / "data.bin").stat().st_size, holds]
        except FileNotFoundError:
            continue
    return held


def assert_one_copy_a_node(kill: dict[str, Any], world: int) -> None:
    """A kill event's ``parts`` (:func:`parts_held`, two ranks a node) show the node's own ranks'
    parts and the other node's replicas, the replicated state (weights, optimizer) in the parts
    of each node's first rank only (ranks 0 and 2), the others' smaller."""
    ranks: dict[int, list[list[Any]]] = {}
    for name, part in kill["parts"].items():
        ranks.setdefault(int(name.rsplit("-r", 1)[1]), []).append(part)
    assert sorted(ranks) == list(range(world)), kill["parts"]  # own ranks and the replicas
    assert all(holds for r in (0, 2) for _, holds in ranks[r]), kill["parts"]
    assert not any(holds for r in (1, 3) for _, holds in ranks[r]), kill["parts"]
    assert max(n for r in (1, 3) for n, _ in ranks[r]) < min(n for r in (0, 2) for n, _ in ranks[r])


def job_arguments(description: str | None) -> tuple[argparse.Namespace, Path, Path]:
    """A two-node job's command line (``--dir D --out O [--kill RANK:STEP[:HOW] ...]``), with
    ``O`` created: the arguments, ``O`` and ``D``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out, Path(args.dir)


def reference_then_final(
    out: Path,
    events: Callable[..., None],
    reference: Callable[[], dict[str, Any]],
    final: Callable[[], dict[str, Any]],
) -> NoReturn:
    """A two-node job's body: the uninterrupted reference run (first incarnation only), each
    process's result to ``O/ref_rank<r>.pt``; then the run under test, to ``O/final_rank<r>.pt``
    and a ``finished`` event; then the process ends past gloo's teardown (see torchrun_job)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not all((out / f"ref_rank{r}.pt").exists() for r in range(world)):
        torch.save(reference(), out / f"ref_rank{rank}.pt")
    result = final()
    torch.save(result, out / f"final_rank{rank}.pt")
    events("finished", step=result["step"])
    torch.distributed.barrier()
    logging.shutdown()
    os._exit(0)
