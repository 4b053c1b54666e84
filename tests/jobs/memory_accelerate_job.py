"""An Accelerate training loop over two torchrun agents (two nodes, two processes each) through
the API (``IncrementalCheckpointer``: ``load``, ``iterate``, ``maybe_save``) with the memory tier
every step and the store every 10 steps, for ``tests/multiprocess/test_accelerate_memory_tier.py``.

``python -m torch.distributed.run --nnodes=2 --nproc-per-node=2 ...
tests/jobs/memory_accelerate_job.py --dir D --out O [--kill RANK:STEP[:wipe|:all] ...]``, each agent
with its own ``LIGHTNING_INCREMENTAL_MEMORY_DIR``.

The first incarnation first trains an uninterrupted reference (memory tier off, its own store)
and writes each process's final state to ``O/ref_rank<r>.pt``; then the run under test starts.
Each ``--kill`` SIGKILLs RANK's training process once it finished STEP and its memory step is
taken and replicated (once in the job; its agent restarts the group); with ``wipe`` it first
empties its node's memory directory, so that its part must come from the other node; with
``all`` every node's (both nodes lost: the store). The
incarnation that finishes writes ``O/final_rank<r>.pt``. Events (starts with ``resumed_from``,
``resumed_tier`` and the node's memory directory; the kills, with the size of each part the
node's memory held and whether it holds the optimizer state; the end) go to ``O/events.jsonl``.

The DataLoader shuffles with its own seeded generator, the model has dropout and batch norm
(DDP does not broadcast buffers here: each process's running statistics are its own; its
gradient buckets are fixed, see ``train``), and each
process seeds its global RNG differently: the run ends bit-identical to the reference only if
the weights, the optimizer, the scheduler, the sampler state, the data position, each process's
buffers and random state all come back from memory.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_incremental import IncrementalCheckpointer
from lightning_incremental.runtime.memory.tier import ENV
from tests.jobs import two_nodes
from tests.jobs.torchrun_job import Events

EPOCHS = 2  # 16 steps an epoch on each of the four processes


def train(
    store: Path, kills: list[str], events: Events | None, out: Path, **memory: Any
) -> dict[str, Any]:
    """One run into ``store`` (an accelerator of its own); returns this process's final state."""
    # Buffers are each process's own. DDP regroups its gradient buckets after a process's first
    # step (unless it looks for unused parameters), and with 3 or more processes the order of a
    # float sum shows in the last bit: a restarted process would reduce its first step in
    # another order than the uninterrupted run does at that step. Fixed buckets keep it exact.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False, find_unused_parameters=True)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ddp])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
    loader = DataLoader(
        data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    model = nn.Sequential(
        nn.Linear(8, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    torch.manual_seed(100 + accelerator.process_index)  # per-process dropout streams
    ckpt = IncrementalCheckpointer(accelerator, str(store), every_n_steps=10, **memory)
    resumed = ckpt.load()
    step = resumed or 0
    if events is not None:
        events(
            "started", step=step, resumed_from=resumed, resumed_tier=ckpt.resumed_tier,
            node=os.environ[ENV],
        )  # fmt: skip
    while loader.iteration < EPOCHS:
        for x, y in ckpt.iterate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            ckpt.maybe_save(step)
            for spec in kills:
                _maybe_kill(ckpt, spec, step, accelerator.process_index, events, out)
    ckpt.wait()
    final = {
        "step": step,
        "model": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "rng": torch.get_rng_state(),
    }
    ckpt.close()
    return final


def _maybe_kill(
    ckpt: IncrementalCheckpointer, spec: str, step: int, rank: int, events: Events | None, out: Path
) -> None:
    who, at, *how = spec.split(":")
    if step != int(at) or rank != int(who):
        return
    try:
        (out / f"killed-{who}-{at}").touch(exist_ok=False)
    except FileExistsError:  # once in the job
        return
    ckpt.wait()  # this process's memory step, replicated (every rank wrote its part)
    memory = Path(os.environ[ENV])
    parts = two_nodes.parts_held(memory, "optimizers")
    if events is not None:
        events("kill", step=step, wiped=bool(how), node=str(memory), parts=parts)
    if how:
        two_nodes.empty(memory, every_node=how == ["all"])
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args, out, root = two_nodes.job_arguments(__doc__)
    torch.set_num_threads(1)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("accelerate_incremental").setLevel(logging.INFO)  # the resume line
    events = Events(out)
    two_nodes.reference_then_final(
        out,
        events,
        reference=lambda: train(root / "ref", [], None, out),
        final=lambda: train(root / "final", args.kill, events, out, memory_every_n_steps=1),
    )


if __name__ == "__main__":
    main()
