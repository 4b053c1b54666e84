"""An Accelerate training script that knows nothing of lightning-incremental (the zero-edit tests
run it with ``accelerate launch ... -m accelerate_incremental --dirpath STORE``).

It is written as many scripts are: ``accelerator.save_state()`` every few steps,
``accelerator.load_state()`` at start (a fresh start when there is nothing to load), the epoch
derived from the restored step counter, and a plain ``for batch in loader`` loop. The
DataLoader shuffles with its own seeded generator, the model has dropout, and every process seeds
its global RNG differently, so a resumed run is bit-identical only if the sampler state, the
position in the epoch and each process's random state all come back.

Arguments: ``--out FILE`` (the main process writes the final weights there), ``--crash-after N``
(every process SIGKILLs itself right after the checkpoint of step N was saved), ``--every N``
(save every N steps), ``--slow S`` (sleep S seconds after each step, so that a test can signal
the run mid-way), ``--progress PREFIX`` (each process appends every finished step to
``PREFIX.rank<i>``). It prints ``argv`` and ``__file__`` as it sees them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 3


class Counter:
    """The global step, registered for checkpointing."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--crash-after", type=int, default=-1)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--progress", default=None)
    args = parser.parse_args()
    print(f"argv {sys.argv!r} file {__file__!r} path0 {sys.path[0]!r}", flush=True)

    project = ProjectConfiguration(
        project_dir=os.path.dirname(args.out), automatic_checkpoint_naming=True
    )
    accelerator = Accelerator(cpu=True, project_config=project)
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

    try:
        accelerator.load_state()  # the newest checkpoint
    except FileNotFoundError:  # Accelerate's own load_state, with nothing saved yet
        pass
    accelerator.print(f"starting at global step {counter.step}")

    for _epoch in range(counter.step // len(loader), EPOCHS):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.step += 1
            if counter.step % args.every == 0:
                accelerator.save_state()
            if counter.step == args.crash_after:
                accelerator.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
            if args.progress:
                with open(f"{args.progress}.rank{accelerator.process_index}", "a") as fh:
                    fh.write(f"{counter.step}\n")
            time.sleep(args.slow)
    if accelerator.is_main_process:
        weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(
            {"weights": weights, "optimizer": optimizer.state_dict(), "step": counter.step},
            args.out,
        )
    accelerator.wait_for_everyone()
    print(f"JOB DONE process {accelerator.process_index}", flush=True)
    # See accelerate_job.py: gloo's teardown on a loaded 2-core machine is not under test here.
    os._exit(0)


if __name__ == "__main__":
    main()
