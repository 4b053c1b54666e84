"""Two processes of one node (``torchrun --standalone --nproc-per-node 2 --max-restarts 1``,
gloo) taking memory steps through :class:`MemorySteps` as the adapters do, for
``tests/multiprocess/test_memory_pruning.py``.

``python -m torch.distributed.run ... tests/jobs/memory_pruning_job.py --memory M --out O``

The replicated state is held once on the node (rank 0's part holds it, 4 MiB; rank 1's part
its own few bytes), one node, so no replica goes anywhere. In the first run both ranks take
steps 1 to 3; rank 0's write of its part of step 3 is held back (a slow write of the whole
state: it never ends in this run). Rank 1, once its own part of step 3 is in the node's memory
and its background work had a few seconds to end, records what the node's memory holds
(``O/held.json``) and SIGKILLs itself; the agent restarts both. The second run resumes from the
memory tier and records each rank's ``(step, tier)`` (``O/resumed_rank<r>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_incremental.runtime.memory.steps import MemoryOptions, MemorySteps
from lightning_incremental.runtime.memory.tier import MemoryTier

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
HELD_STEP = 3
DEADLINE_S = 120.0


def _hold_rank0_write_of(step: int) -> None:
    write = MemoryTier.write

    def slow(self: MemoryTier, snap: Any, rank: int, at: int) -> bool:
        if rank == 0 and at == step:
            time.sleep(DEADLINE_S)  # the agent ends this process first
        return write(self, snap, rank, at)

    MemoryTier.write = slow  # type: ignore[method-assign]


def _checkpoint(steps: MemorySteps, step: int) -> dict[str, Any]:
    own = {"rank": steps.rank, "rng": torch.full((8,), float(steps.rank))}
    if not steps.whole:
        return {"own": own}
    return {"model": torch.full((1 << 20,), float(step)), "step": step, "own": own}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = MemorySteps(
        MemoryOptions(every_n_train_steps=1, replicas=1, directory=args.memory),
        rank=rank,
        world_size=world,
        ranks_per_node=world,
        url=str(out / "store"),
        generation=None,
        allow_pickle=False,
        owner="memory_pruning_job",
        info=print,
        warn=print,
        replicated=True,
    )
    if RESTART == 0:
        _hold_rank0_write_of(HELD_STEP)
        for step in range(1, HELD_STEP + 1):
            steps.take(step, _checkpoint(steps, step))
            dist.barrier()  # a training step's collectives keep the ranks together
        if rank == 1:
            mine = steps.tier.parts / steps.tier.name(1, HELD_STEP)
            deadline = time.monotonic() + DEADLINE_S
            while not mine.exists():
                assert time.monotonic() < deadline, f"{mine} never appeared"
                time.sleep(0.01)
            steps.wait(timeout=3.0)  # its pruning, were it to prune on its own part's word
            held = sorted(f"{h.step}:{h.rank}" for h in steps.tier.inventory())
            (out / "held.json").write_text(json.dumps(held))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(DEADLINE_S)  # the agent ends it once rank 1 is gone
        return

    def check(checkpoint: Any, step: int) -> None:
        assert checkpoint["own"]["rank"] == rank, checkpoint
        assert checkpoint["step"] == step and bool((checkpoint["model"] == step).all())

    def merge(whole: Any, own: Any) -> Any:
        return {**whole, **own}

    found = steps.resume(None, check, merge)
    resumed = None if found is None else [found[0], found[2]]
    (out / f"resumed_rank{rank}.json").write_text(json.dumps(resumed))
    steps.close()
    dist.barrier()
    os._exit(0)  # without gloo's teardown at exit (see torchrun_job)


if __name__ == "__main__":
    main()
