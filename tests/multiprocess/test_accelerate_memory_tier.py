"""The memory tier under Accelerate, end to end: a plain training loop through the API
(``IncrementalCheckpointer``) over two torchrun agents as two nodes (``--nnodes=2``, one process
each, each with its own memory directory), memory every step, store every 10 steps, one launch:

- at step 25 one node's memory directory is emptied and its process SIGKILLed; its agent
  restarts the group, which resumes from the memory tier at step 25, above the store's step 20:
  the part of the emptied node's rank comes from the other node's replica (``resumed_tier`` is
  ``"peer"``, the group's);
- at step 29 the other node's process is SIGKILLed: both resume from their own node's memory;

and the run ends bit-identical (weights and each process's random state) to an uninterrupted run
of the same loop (trained first, in the same launch)."""

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


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("accelerate_memory_tier")
    rcs, logs = two_nodes.run(tmp, JOB, two_nodes.kill_args(("1:25:wipe", "0:29")), TIMEOUT_S)
    assert rcs == [0, 0], logs[-8000:]
    events = [json.loads(line) for line in (tmp / "out" / "events.jsonl").read_text().splitlines()]
    return {"tmp": tmp, "events": events, "logs": logs}


def test_an_accelerate_loop_resumes_from_its_memory_and_a_peers_bit_identically(
    killed: dict[str, Any],
) -> None:
    events, out = killed["events"], killed["tmp"] / "out"
    kills = [(e["rank"], e["step"], e["wiped"]) for e in events if e["event"] == "kill"]
    assert kills == [(1, 25, True), (0, 29, False)], killed["logs"][-8000:]
    first, after_wipe, after_kill = _incarnations(events)
    assert {r: e["resumed_from"] for r, e in first.items()} == {0: None, 1: None}
    for start in after_wipe.values():  # the store holds step 20; memory the step of the kill
        # the group's tier: a part came from the other node (whichever rank each node now runs)
        assert (start["resumed_from"], start["resumed_tier"]) == (25, "peer"), start
    for start in after_kill.values():
        assert (start["resumed_from"], start["resumed_tier"]) == (29, "memory"), start
    finished = [e for e in events if e["event"] == "finished"]
    assert {e["rank"] for e in finished} == {0, 1} and {e["step"] for e in finished} == {32}
    assert "of the memory tier" in killed["logs"]
    for rank in (0, 1):
        final = torch.load(out / f"final_rank{rank}.pt")
        reference = torch.load(out / f"ref_rank{rank}.pt")
        assert final["step"] == reference["step"] == 32
        assert final["model"].keys() == reference["model"].keys()
        for key, value in reference["model"].items():
            assert torch.equal(final["model"][key], value), (rank, key)
        assert torch.equal(final["rng"], reference["rng"]), rank
