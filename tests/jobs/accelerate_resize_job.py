"""An Accelerate job under the launch flag whose number of processes changes between runs:
``ACCELERATE_INCREMENTAL=<store> accelerate launch --multi_gpu --num_processes N
tests/jobs/accelerate_resize_job.py <out> [kill_at]`` (or plain ``python`` for one process).

Plain Accelerate code: ``accelerator.save_state()`` every 3 steps, ``load_state()`` at start when
the store has a checkpoint, ``for batch in loader``. Every process appends, per batch, the step it
belongs to, the epoch and the ids of its samples to ``<out>/ids_rank<i>.jsonl``. With
``kill_at``, once the save at that step committed, the main process writes its weights and
optimizer state to ``<out>/at_kill.pt`` and every process exits (status 3). Otherwise every
process writes its state at the start of training to ``<out>/at_start_rank<i>.pt`` and trains
2 epochs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import accelerate_incremental
from tests.jobs.accelerate_job import Counter

EPOCHS, EVERY, SAMPLES, BATCH = 2, 3, 96, 4


class Ids(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def state(accelerator: Accelerator, model: Any, optimizer: Any, step: int) -> dict[str, Any]:
    weights = accelerator.unwrap_model(model).state_dict()
    return {"step": step, "weights": weights, "optimizer": optimizer.state_dict()}


def main() -> None:
    out = Path(sys.argv[1])
    kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else None
    out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True)
    loader = DataLoader(
        Ids(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    ckpt = accelerate_incremental.enable(accelerator)
    assert ckpt is not None, "the launch flag did not reach this process"
    if ckpt.steps():
        accelerator.load_state()
    rank = accelerator.process_index
    if kill_at is None:
        torch.save(
            state(accelerator, model, optimizer, counter.step), out / f"at_start_rank{rank}.pt"
        )
    while loader.iteration < EPOCHS:
        for x, y, ids in loader:
            row = {"epoch": loader.iteration, "step": counter.step, "ids": ids.tolist()}
            with (out / f"ids_rank{rank}.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            counter.step += 1
            if counter.step % EVERY == 0:
                accelerator.save_state()  # returns once committed
            if counter.step == kill_at:
                if accelerator.is_main_process:
                    torch.save(
                        state(accelerator, model, optimizer, counter.step), out / "at_kill.pt"
                    )
                accelerator.wait_for_everyone()
                os._exit(3)
    ckpt.wait()
    (out / f"result_rank{rank}.json").write_text(json.dumps({"step": counter.step}))
    ckpt.close()
    accelerator.wait_for_everyone()
    print(f"JOB DONE process {rank}", flush=True)
    os._exit(0)  # past gloo's teardown at interpreter exit (see accelerate_job.py)


if __name__ == "__main__":
    main()
