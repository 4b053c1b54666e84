"""A tiny Accelerate training run for the launch tests (run by ``accelerate launch``).

Environment:
    JOB_STORE: the checkpoint store (mode ``api``); mode ``flag`` reads ACCELERATE_INCREMENTAL.
    JOB_MODE: ``api`` (IncrementalCheckpointer + iterate + maybe_save) or ``flag``
        (``accelerate_incremental.enable`` + ``accelerator.save_state()`` / ``load_state()``).
    JOB_OUT: where the main process writes the final weights and counters (torch.save).
    JOB_CRASH_AFTER: exit abruptly (status 3) right after the checkpoint of this global step
        committed; unset: run to the end.
    JOB_KILL_AT: in the first run of a ``--max_restarts`` launch (TORCHELASTIC_RESTART_COUNT 0),
        process 1 SIGKILLs itself at this global step; the launcher restarts both processes.
    JOB_FLIP_AT: process 1 flips one bit of a weight right before the save of this step (mode
        ``api``), under ``replica_check=JOB_REPLICA_CHECK`` (default ``warn``).
    JOB_PROGRESS: each process appends every finished step to ``JOB_PROGRESS.rank<i>``, then
        sleeps ``JOB_SLOW`` seconds (default 0), so that a test can signal the run mid-way.

Run alone (``python tests/jobs/accelerate_job.py``) it is one process.

The DataLoader shuffles with its own seeded generator, the model has dropout, and every process
seeds its global RNG differently, so a resumed run is bit-identical only if the sampler state,
the data position and each process's random state all come back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import accelerate_incremental
from accelerate_incremental import IncrementalCheckpointer
from lightning_incremental.runtime.state import replicas

EPOCHS = 3
EVERY = 3


class Counter:
    """A registered custom object: the global step, checkpointed with the rest."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    mode = os.environ["JOB_MODE"]
    crash_after = int(os.environ.get("JOB_CRASH_AFTER", "-1"))
    flip_at = int(os.environ.get("JOB_FLIP_AT", "-1"))
    kill_at = int(os.environ.get("JOB_KILL_AT", "-1"))
    progress = os.environ.get("JOB_PROGRESS")
    slow = float(os.environ.get("JOB_SLOW", "0"))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        kill_at = -1
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    loader = DataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    torch.manual_seed(100 + accelerator.process_index)  # per-process dropout streams

    ckpt: IncrementalCheckpointer | None
    if mode == "api":
        ckpt = IncrementalCheckpointer(
            accelerator,
            os.environ["JOB_STORE"],
            every_n_steps=EVERY,
            replica_check=os.environ.get("JOB_REPLICA_CHECK", "warn"),
        )
        resumed = ckpt.load()
    else:
        ckpt = accelerate_incremental.enable(accelerator)
        assert ckpt is not None, "the launch flag did not reach this process"
        resumed = accelerator.load_state() if ckpt.steps() else None
    accelerator.print(f"resumed from {resumed} at global step {counter.step}")

    while loader.iteration < EPOCHS:
        for x, y in ckpt.iterate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.step += 1
            if counter.step == flip_at and accelerator.process_index == 1:
                weight = accelerator.unwrap_model(model)[0].weight.data
                weight.view(torch.int32).view(-1)[5] ^= 1 << 9  # a silent memory error
            if mode == "api":
                ckpt.maybe_save(counter.step)
            elif counter.step % EVERY == 0:
                accelerator.save_state()
            if counter.step == kill_at and accelerator.process_index == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if counter.step == crash_after:
                ckpt.wait()
                accelerator.wait_for_everyone()
                os._exit(3)
            if progress:
                with open(f"{progress}.rank{accelerator.process_index}", "a") as fh:
                    fh.write(f"{counter.step}\n")
                time.sleep(slow)
    ckpt.wait()
    agree = replicas.check_replicas(
        {"model": accelerator.unwrap_model(model).state_dict(), "opt": optimizer.state_dict()}
    ).ok
    if accelerator.is_main_process:
        weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(
            {
                "weights": weights,
                "optimizer": optimizer.state_dict(),
                "step": counter.step,
                "iteration": accelerator.project_configuration.iteration,
                "resumed": resumed,
                "steps": ckpt.steps(),
                "replicas_agree": agree,
                "repairs": {
                    s: ckpt.store.manifest(s).audit["metadata"].get("replica_repair")
                    for s in ckpt.steps()
                },
            },
            os.environ["JOB_OUT"],
        )
    ckpt.close()
    accelerator.wait_for_everyone()
    print(f"JOB DONE process {accelerator.process_index}", flush=True)
    # Every checkpoint is committed and the result written. On this loaded 2-core test machine a
    # non-main gloo process aborts now and then while the interpreter tears down ("terminate
    # called without an active exception", after all work finished); skipping the teardown keeps
    # these tests about checkpoints rather than about gloo's shutdown.
    os._exit(0)


if __name__ == "__main__":
    main()
