"""The memory tier under Accelerate, end to end: a plain training loop through the API
(``IncrementalCheckpointer``) over two torchrun agents as two nodes (``--nnodes=2``, two
processes each, each node with its own memory directory), memory every step, store every 10
steps, one launch:

- each node's memory holds the replicated state (weights, optimizer) once: the second process of
  a node takes its own state alone (random state, data position, its batch norm statistics);
- at step 25 one node's memory directory is emptied and its rank-2 process SIGKILLed; its agent
  restarts the group, which resumes from the memory tier at step 25, above the store's step 20:
  the parts of the emptied node's ranks come from the other node's replicas, the node's first
  rank passing the replicated state on to the second (``resumed_tier`` is ``"peer"``, the
  group's);
- at step 29 the other node's first process is SIGKILLed: all resume from their own node's
  memory;
- at step 31 both nodes' memory is emptied and a process SIGKILLed: all resume from the
  store's step 30, each process with its own batch norm statistics (saved with its random
  state: the store's weights are the main process's);

and the run ends bit-identical (weights, buffers and each process's random state) to an
uninterrupted run of the same loop (trained first, in the same launch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import two_nodes
from tests.multiprocess.test_memory_tier import _incarnations

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "memory_accelerate_job.py"
TIMEOUT_S = 300
WORLD = 4


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("accelerate_memory_tier")
    kills = two_nodes.kill_args(("2:25:wipe", "0:29", "0:31:all"))
    rcs, logs = two_nodes.run(tmp, JOB, kills, TIMEOUT_S, per_node=2)
    assert rcs == [0, 0], logs[-8000:]
    events = [json.loads(line) for line in (tmp / "out" / "events.jsonl").read_text().splitlines()]
    return {"tmp": tmp, "events": events, "logs": logs}


def test_an_accelerate_loop_resumes_from_its_memory_and_a_peers_bit_identically(
    killed: dict[str, Any],
) -> None:
    events, out = killed["events"], killed["tmp"] / "out"
    kills = [(e["rank"], e["step"], e["wiped"]) for e in events if e["event"] == "kill"]
    assert kills == [(2, 25, True), (0, 29, False), (0, 31, True)], killed["logs"][-8000:]
    first, after_wipe, after_kill, after_both = _incarnations(events, WORLD)
    assert {r: e["resumed_from"] for r, e in first.items()} == dict.fromkeys(range(WORLD))
    for start in after_wipe.values():  # the store holds step 20; memory the step of the kill
        # the group's tier: a part came from the other node (whichever rank each node now runs)
        assert (start["resumed_from"], start["resumed_tier"]) == (25, "peer"), start
    for start in after_kill.values():
        assert (start["resumed_from"], start["resumed_tier"]) == (29, "memory"), start
    for start in after_both.values():  # no memory anywhere: the store
        assert (start["resumed_from"], start["resumed_tier"]) == (30, "store"), start
    finished = [e for e in events if e["event"] == "finished"]
    assert {e["rank"] for e in finished} == set(range(WORLD))
    assert {e["step"] for e in finished} == {32}
    assert "of the memory tier" in killed["logs"]
    for rank in range(WORLD):
        final = torch.load(out / f"final_rank{rank}.pt")
        reference = torch.load(out / f"ref_rank{rank}.pt")
        assert final["step"] == reference["step"] == 32
        assert final["model"].keys() == reference["model"].keys()
        for key, value in reference["model"].items():
            assert torch.equal(final["model"][key], value), (rank, key)
        assert torch.equal(final["rng"], reference["rng"]), rank


def test_a_node_holds_the_replicated_state_once(killed: dict[str, Any]) -> None:
    """At the first kill the node's memory held its ranks' parts and the other node's replicas:
    the replicated state (weights, optimizer) in the parts of each node's first rank only."""
    kill = next(e for e in killed["events"] if e["event"] == "kill")
    two_nodes.assert_one_copy_a_node(kill, WORLD)
