"""The memory tier under a Hugging Face ``Trainer``, over two torchrun agents as two nodes (one
process each, each node with its own memory directory), memory every step, the store every 10
steps, one launch (``tests/jobs/memory_trainer_job.py``):

- at step 13 the second node's memory directory is emptied and its process SIGKILLed; its agent
  restarts the group, which resumes from memory step 12, above the store's step 10: the emptied
  node's part comes from the other node's replica (``resumed_tier`` ``"peer"``);
- at step 17 both nodes' memory is emptied and a process SIGKILLed: the group resumes from the
  store's step 10;

and the run ends bit-identical (weights, optimizer, scheduler and each process's random state) to
an uninterrupted run of the same script (trained first, in the same launch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from tests.conftest import assert_state_equal
from tests.jobs import two_nodes
from tests.multiprocess.test_memory_tier import _incarnations

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "memory_trainer_job.py"
TIMEOUT_S = 300
WORLD = 2


def test_a_trainer_resumes_from_a_peers_replica_and_the_store_bit_identically(
    tmp_path: Path,
) -> None:
    kills = two_nodes.kill_args(("1:13:wipe", "0:17:all"))
    rcs, logs = two_nodes.run(tmp_path, JOB, kills, TIMEOUT_S)
    assert rcs == [0, 0], logs[-8000:]
    out = tmp_path / "out"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    done = [(e["rank"], e["step"], e["wiped"]) for e in events if e["event"] == "kill"]
    assert done == [(1, 13, True), (0, 17, True)], logs[-8000:]
    first, after_wipe, after_both = _incarnations(events, WORLD)
    assert {r: e["resumed_from"] for r, e in first.items()} == dict.fromkeys(range(WORLD))
    for start in after_wipe.values():  # the store holds step 10; memory step 12
        assert (start["resumed_from"], start["resumed_tier"]) == (12, "peer"), start
    for start in after_both.values():  # no memory anywhere: the store
        assert (start["resumed_from"], start["resumed_tier"]) == (10, "store"), start
    assert "of the memory tier (memory, some parts from peers)" in logs
    for rank in range(WORLD):
        final = torch.load(out / f"final_rank{rank}.pt", weights_only=False)
        reference = torch.load(out / f"ref_rank{rank}.pt", weights_only=False)
        assert final["step"] == reference["step"] == 24
        for part in ("model", "optimizer", "scheduler", "rng"):
            assert_state_equal(final[part], reference[part], f"rank {rank}: {part}")
