"""IncrementalCheckpointer in an Accelerate script: incremental checkpoints and exact resume.

Fine-tune a small model (a frozen backbone, a trainable head with dropout, AdamW, a step
schedule, a DataLoader that shuffles with its own seeded generator)::

    python examples/accelerate_example.py --dir /tmp/acc-example
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_example.py --dir /tmp/ex2

(On a machine without GPUs, prefix the launch with ``ACCELERATE_USE_CPU=1``: then
``--multi_gpu --num_processes 2`` starts two CPU processes with the gloo backend.)

Simulate a crash, then run the very same command again: it resumes from the newest
committed checkpoint — mid-epoch, with every process's random state restored — and ends with the
weights an uninterrupted run would have::

    python examples/accelerate_example.py --dir /tmp/acc-example --crash-at 20
    python examples/accelerate_example.py --dir /tmp/acc-example

``--compare`` also runs Accelerate's own ``save_state`` at every checkpoint and prints both sizes.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_incremental import IncrementalCheckpointer


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint store (directory or URL)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--crash-at", type=int, default=None, help="SIGKILL after step N")
    parser.add_argument("--compare", action="store_true", help="also time save_state")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 64), torch.randint(0, 4, (256,)))
    loader = DataLoader(
        data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    backbone = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
    backbone.requires_grad_(False)  # frozen: its chunks are never written again
    model = nn.Sequential(backbone, nn.Dropout(0.2), nn.Linear(512, 4))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    torch.manual_seed(1000 + accelerator.process_index)  # each process its own dropout stream

    ckpt = IncrementalCheckpointer(accelerator, args.dir, every_n_steps=args.every, keep_last=3)
    step = ckpt.load() or 0
    accelerator.print(f"{'resumed at step ' + str(step) if step else 'fresh start'} ({ckpt})")

    while loader.iteration < args.epochs:
        for x, y in ckpt.iterate(loader):  # a resumed epoch continues where it stood
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            handle = ckpt.maybe_save(step)
            if handle is not None:
                result = handle.wait()
                line = (
                    f"step {step}: wrote {result.bytes_written / 1e6:.2f} MB of "
                    f"{result.bytes_logical / 1e6:.2f} MB, blocked {result.snapshot_s * 1e3:.1f} ms"
                )
                if args.compare:
                    with tempfile.TemporaryDirectory() as tmp:
                        started = time.perf_counter()
                        Accelerator.save_state(accelerator, tmp)
                        took = time.perf_counter() - started
                        line += (
                            f" | accelerator.save_state: {folder_bytes(Path(tmp)) / 1e6:.2f} MB, "
                            f"{took * 1e3:.1f} ms"
                        )
                print(line, flush=True)
            elif args.compare and step % args.every == 0:
                with tempfile.TemporaryDirectory() as tmp:  # other processes' part of save_state
                    Accelerator.save_state(accelerator, tmp)
            if step == args.crash_at:
                ckpt.wait()
                accelerator.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    accelerator.print(f"done at step {step}; committed checkpoints: {ckpt.steps()}")
    if accelerator.is_main_process:
        digest = sum(
            float(p.detach().double().sum()) for p in accelerator.unwrap_model(model).parameters()
        )
        print(f"weights checksum {digest:.10f}")
    accelerator.end_training()  # destroys the process group cleanly


if __name__ == "__main__":
    main()
