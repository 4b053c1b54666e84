"""The memory tier end to end: two torchrun agents as two nodes (``--nnodes=2``, two processes
each, each node with its own memory directory), Lightning DDP, memory every step, store every 10
steps, one launch:

- each node's memory holds the replicated state (weights, optimizer) once: a node's second rank
  takes its own state alone (random state, data position);
- rank 1's training process is SIGKILLed at step 25; its agent restarts the group, which resumes
  from the memory tier at step 24 (the store holds step 20);
- at step 29 the second node is lost whole (agent and training processes SIGKILLed) and a
  replacement agent with an empty memory directory joins: the group resumes at step 28, the
  replacement's parts received from the other node's replicas, its first rank passing the
  replicated state on to the second;
- at step 31, once every part and replica of the step is written, one process empties both
  nodes' memory and is SIGKILLed (both nodes lost): the group resumes from the store's step 30;

and the run ends bit-identical to an uninterrupted run of the same job (trained first, in the
same launch)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import two_nodes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "memory_job.py"
TIMEOUT_S = 300
KILLS = ("1:25", "@memory1:29:node", "@memory0:31:all")
WORLD = 4


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("memory_tier")
    started = time.monotonic()
    rcs, logs = two_nodes.run(tmp, JOB, two_nodes.kill_args(KILLS), TIMEOUT_S, per_node=2)
    assert rcs == [0, -signal.SIGKILL, 0], logs[-8000:]
    events = [json.loads(line) for line in (tmp / "out" / "events.jsonl").read_text().splitlines()]
    kills = [e for e in events if e["event"] == "kill"]
    for kill in kills:
        back = min(
            e["time"] for e in events if e["event"] == "started" and e["time"] > kill["time"]
        )
        again = back - kill["time"]
        print(f"\nmemory tier: killed at step {kill['step']}, training again {again:.1f} s later")
    print(f"memory tier, two nodes, three faults: {time.monotonic() - started:.1f} s in all")
    return {"tmp": tmp, "events": events, "logs": logs}


def _incarnations(events: list[dict[str, Any]], world: int = 2) -> list[dict[int, dict[str, Any]]]:
    """Each incarnation's start events, by rank (``world`` starts an incarnation)."""
    starts = [e for e in events if e["event"] == "started"]
    return [{e["rank"]: e for e in starts[i : i + world]} for i in range(0, len(starts), world)]


def test_killed_processes_resume_from_memory_a_peer_or_the_store_bit_identically(
    killed: dict[str, Any],
) -> None:
    events, out = killed["events"], killed["tmp"] / "out"
    kills = [(e["step"], e["wiped"], e["node"]) for e in events if e["event"] == "kill"]
    assert kills == [(25, False, False), (29, True, True), (31, True, False)]
    first, after_kill, after_wipe, after_both = _incarnations(events, WORLD)
    assert {r: e["resumed_from"] for r, e in first.items()} == dict.fromkeys(range(WORLD))
    # step 24: the store holds 20; each rank reads its own node's memory, unless the restart
    # put the ranks on the other nodes (then each receives its part from the node that has it)
    same_nodes = all(after_kill[r]["node"] == first[r]["node"] for r in range(WORLD))
    for start in after_kill.values():
        assert start["resumed_from"] == 24, start
        assert start["resumed_tier"] == ("memory" if same_nodes else "peer"), start
    assert {e["node"][-7:] for e in after_wipe.values()} == {"memory0", "memory2"}
    for start in after_wipe.values():  # the replacement node: its rank's part from a peer
        assert (start["resumed_from"], start["resumed_tier"]) == (28, "peer"), start
    for start in after_both.values():  # no memory anywhere: the store
        assert (start["resumed_from"], start["resumed_tier"]) == (30, "store"), start
    finished = [e for e in events if e["event"] == "finished"]
    assert {e["rank"] for e in finished} == set(range(WORLD))
    assert {e["step"] for e in finished} == {32}
    assert "of the memory tier" in killed["logs"]
    for rank in range(WORLD):
        final = torch.load(out / f"final_rank{rank}.pt")
        reference = torch.load(out / f"ref_rank{rank}.pt")
        assert final.keys() == reference.keys()
        assert all(torch.equal(final[k], reference[k]) for k in reference), rank


def test_a_node_holds_the_replicated_state_once(killed: dict[str, Any]) -> None:
    """At the first kill the node's memory held its ranks' parts and the other node's replicas:
    the replicated state (weights, optimizer) in the parts of each node's first rank only."""
    kill = next(e for e in killed["events"] if e["event"] == "kill")
    two_nodes.assert_one_copy_a_node(kill, WORLD)


def test_the_memory_is_freed_once_the_store_holds_the_end(killed: dict[str, Any]) -> None:
    for node in (0, 2):  # the nodes of the job's end (the lost one's memory went with it)
        assert list((killed["tmp"] / f"memory{node}").glob("*/s*")) == []
